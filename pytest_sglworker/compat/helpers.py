"""The helpers of ``sglang.test.test_utils`` that start an engine themselves, as :mod:`pytest_sglworker.compat`
hands them out: through the plugin's launch, or refused with the supported path.

sglang's helpers call ``popen_launch_server`` (and ``kill_process_tree``) by their module's global names, so a
file that imports ``run_bench_serving`` from the drop-in would still get sglang's own launch: no model map, no
budget check, no GPU lease, no plugin log, a port the plugin does not know (under ``--sgl-engine sim`` it starts
the real model named in the helper). Two kinds, told apart by reading the helper's code, not by a list of names
that a new sglang would outgrow:

- **Routed**: a helper whose code (or that of a helper it calls) names ``popen_launch_server``
  (``run_bench_serving``, ``run_bench_serving_multi``, ``run_bench_one_batch_server``, ``run_and_check_memory_leak``,
  ``run_mmlu_test``, ``run_embeddings_benchmark(_multi)``, ``run_score_benchmark(_multi)`` in sglang 0.5.23) is
  handed out as a copy of itself whose global ``popen_launch_server`` and ``kill_process_tree`` are the drop-ins:
  every server it starts is a worker of the plugin, launched and ended as the test's own would be.
- **Refused**: a helper that starts an engine without a server the plugin could serve (:data:`REFUSED`: an
  offline benchmark run as ``python -m sglang.benchmark...``, a prefill/decode pair) raises
  :class:`~pytest_sglworker.compat.CompatError` naming the supported path when it is *called* (importing it
  stays harmless, as sglang's files import many names they do not use). So does a generic command runner
  (:data:`COMMAND_RUNNERS`) handed a command that starts an sglang engine, and a routed helper that reaches one
  of these.

Outside a pytest session with the plugin the drop-ins are sglang's own functions, so a routed helper behaves as
upstream's; the refusals hold only inside one (where an engine outside the plugin would escape the pool).
"""

from __future__ import annotations

import functools
import shlex
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .models import CompatError

__all__ = ["COMMAND_RUNNERS", "LAUNCH_NAMES", "REFUSED", "classify", "helper"]

#: the names whose call starts a server: a helper that names one (directly or through another helper) is routed
LAUNCH_NAMES = ("popen_launch_server",)

_SERVING = ("a server through popen_launch_server from pytest_sglworker.compat (or the sgl_worker fixture) and run "
            "sglang's serving benchmark against its URL (run_bench_serving from pytest_sglworker.compat does both)")
#: helpers that start an engine the plugin cannot serve, and what to use instead
REFUSED: dict[str, str] = {
    "popen_launch_pd_server": "a prefill/decode pair: use @pytest.mark.sgl_workers(prefill=P, decode=D) with the "
                              "sgl_workers and sgl_router fixtures",
    "run_bench_one_batch": "an offline engine (python -m sglang.benchmark.one_batch) that loads the model outside "
                           "any server: launch " + _SERVING,
    "run_bench_offline_throughput": "an offline engine (python -m sglang.benchmark.offline_throughput) that loads the "
                                    "model outside any server: launch " + _SERVING,
}
#: generic runners of a command line: refused only when the command starts an sglang engine
COMMAND_RUNNERS = ("popen_with_error_check", "run_command_and_capture_output")
#: a command that starts an sglang engine: one of these modules after ``-m``, or ``sglang serve``
ENGINE_MODULES = ("sglang.launch_server", "sglang.bench_one_batch", "sglang.bench_offline_throughput",
                  "sglang.bench_one_batch_server", "sglang.benchmark.one_batch", "sglang.benchmark.offline_throughput",
                  "sglang.benchmark.one_batch_server")


def _names(code: types.CodeType) -> Iterator[str]:
    """Every global name ``code`` and the functions defined inside it refer to."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def classify(module: types.ModuleType) -> tuple[frozenset[str], frozenset[str]]:
    """``(routed, refused)``: the module's functions that start a server by ``popen_launch_server``, and those that
    start an engine the plugin cannot serve (:data:`REFUSED`, and any function that reaches one), each through
    the module's other functions as far as they go."""
    functions = {name: value for name, value in vars(module).items()
                 if isinstance(value, types.FunctionType) and value.__module__ == module.__name__}
    uses = {name: set(_names(fn.__code__)) & (set(functions) | set(LAUNCH_NAMES)) for name, fn in functions.items()}

    def reaching(seeds: set[str]) -> set[str]:
        found = set(seeds)
        grown = True
        while grown:
            grown = False
            for name, used in uses.items():
                if name not in found and used & found:
                    found.add(name)
                    grown = True
        return found

    refused = reaching(set(REFUSED) & set(functions)) - set(LAUNCH_NAMES)
    routed = reaching(set(LAUNCH_NAMES)) - set(LAUNCH_NAMES) - refused - set(REFUSED)
    return frozenset(routed), frozenset(refused)


def _refuser(name: str, why: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if _in_session():
            raise CompatError(f"{name} from sglang.test.test_utils starts {why}; pytest_sglworker.compat refuses it "
                              "inside a pytest session, where an engine outside the plugin would escape its GPU "
                              "leases, budget and logs")
        return _original(name)(*args, **kwargs)

    refused.__name__ = refused.__qualname__ = name
    return refused


def _command_text(command: Any) -> str:
    if isinstance(command, str):
        return command
    if isinstance(command, Sequence):
        return shlex.join(str(part) for part in command)
    return str(command)


def starts_engine(command: Any) -> bool:
    """Whether a command line starts an sglang engine (``-m`` one of :data:`ENGINE_MODULES`, or ``sglang serve``)."""
    parts = command.split() if isinstance(command, str) else [str(part) for part in command]
    for i, part in enumerate(parts[:-1]):
        if part == "-m" and parts[i + 1] in ENGINE_MODULES:
            return True
        if part.rsplit("/", 1)[-1] == "sglang" and parts[i + 1] == "serve":
            return True
    return False


def _guarded_runner(name: str) -> Callable[..., Any]:
    original = _original(name)

    @functools.wraps(original)
    def run(command: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if _in_session() and starts_engine(command):
            raise CompatError(f"{name}({_command_text(command)!r}) from sglang.test.test_utils starts an sglang engine "
                              "outside the plugin; launch servers with popen_launch_server from "
                              "pytest_sglworker.compat (or the sgl_worker fixture) instead")
        return original(command, *args, **kwargs)

    return run


def _in_session() -> bool:
    if sys.modules.get("pytest") is None:
        return False
    from ..plugin.session import active_session

    return active_session() is not None


def _module() -> types.ModuleType:
    import importlib

    return importlib.import_module("sglang.test.test_utils")


def _original(name: str) -> Any:
    return getattr(_module(), name)


def _routed(module: types.ModuleType, name: str, routed: frozenset[str], refused: frozenset[str]) -> Callable[..., Any]:
    """A copy of the module's function ``name`` whose globals are the module's, read when it is called (a constant
    patched meanwhile is seen), with the drop-ins and the other routed and refused helpers in place of sglang's."""
    original = getattr(module, name)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        from .dropins import kill_process_tree, popen_launch_server

        scope: dict[str, Any] = dict(vars(module))
        scope.update(popen_launch_server=popen_launch_server, kill_process_tree=kill_process_tree)
        for other in refused | set(REFUSED):
            if other in scope:
                scope[other] = helper(other, module)
        for other in COMMAND_RUNNERS:
            if other in scope:
                scope[other] = _guarded_runner(other)
        for other in routed:
            fn = getattr(module, other)
            copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            scope[other] = copy
        return scope[name](*args, **kwargs)

    return call


def helper(name: str, module: types.ModuleType) -> Callable[..., Any] | None:
    """What the drop-in hands out for ``module``'s function ``name``: routed, refused or guarded; None for a name
    that starts nothing (handed out as sglang's)."""
    if name in COMMAND_RUNNERS:
        return _guarded_runner(name)
    routed, refused = classify(module)
    if name in REFUSED or name in refused:
        through = sorted((refused | set(REFUSED)) & set(_names(getattr(module, name).__code__)))
        return _refuser(name, REFUSED.get(name, f"an engine the plugin cannot serve (through {', '.join(through)})"))
    if name in routed:
        return _routed(module, name, routed, refused)
    return None
