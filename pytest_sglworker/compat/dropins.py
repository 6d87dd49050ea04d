"""The two drop-ins a suite calls, ``popen_launch_server`` and ``kill_process_tree``: sglang's signatures, served by
the running pytest session's :class:`~pytest_sglworker.compat.launches.CompatRuntime`, or sglang's own functions
where no session runs.

Importable without pytest, as the whole of :mod:`pytest_sglworker.compat` is: a test module that changed its import
is imported again in processes that have no pytest. sglang's engine unpickles a custom logit processor (``dill``)
by importing the test module that defined it, in its scheduler process, whose Python need not have pytest. The
runtime (:mod:`.launches`, which needs pytest) is imported only where pytest is loaded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import SglWorkerError
from .models import CompatError

if TYPE_CHECKING:
    from .launches import CompatRuntime

__all__ = ["kill_process_tree", "popen_launch_server"]


def _runtime() -> CompatRuntime | None:
    """The running session's runtime; None outside a pytest run (pytest not even loaded: never imported here)."""
    if sys.modules.get("pytest") is None:
        return None
    from .launches import runtime

    return runtime()


def popen_launch_server(
    model: str,
    base_url: str,
    timeout: float,
    api_key: str | None = None,
    other_args: Sequence[Any] | None = None,
    env: Mapping[str, Any] | None = None,
    return_stdout_stderr: tuple[Any, Any] | None = None,
    device: str = "auto",
    pd_separated: bool = False,
    num_replicas: int | None = None,
) -> Any:
    """sglang's ``popen_launch_server`` (same signature), served by the running pytest session: a worker of the
    model spec that serves ``model``, on ``base_url``'s port, ready when it returns. Returns a
    :class:`~pytest_sglworker.compat.launches.ServerProcess` whose ``pid`` is the worker's root process.

    ``other_args`` are checked against the mandatory budget (a violation raises
    :class:`~pytest_sglworker.BudgetViolation` naming the test class and the fix) and by sglang's own parser;
    ``api_key`` adds ``--api-key``; ``device`` other than ``"auto"`` adds ``--device`` (``"auto"`` leaves the
    device to the spec's args); ``env`` is added to the worker's environment; ``return_stdout_stderr`` gets the
    worker's log (stdout and stderr are one log file: its lines go to the second stream); ``timeout`` is the
    startup timeout. A startup failure raises the plugin's worker error (diagnosis, argv, log path and tail).
    Prefill/decode launches (``pd_separated``, ``num_replicas``) are not offered: use the plugin's
    ``sgl_workers(prefill=P, decode=D)`` fixture.

    Outside a pytest session with the plugin, this is sglang's own ``popen_launch_server``, unchanged.
    """
    __tracebackhide__ = True  # a failure shows the test's own line and the plugin's message, not its internals
    active = _runtime()
    if active is None:
        return _sglang("popen_launch_server")(model, base_url, timeout, api_key=api_key, other_args=other_args,
                                              env=env, return_stdout_stderr=return_stdout_stderr, device=device,
                                              pd_separated=pd_separated, num_replicas=num_replicas)
    if pd_separated or num_replicas is not None:
        raise CompatError("popen_launch_server(pd_separated=True / num_replicas=...) is not offered by "
                          "pytest_sglworker.compat: use the plugin's @pytest.mark.sgl_workers(prefill=P, decode=D) "
                          "with the sgl_workers and sgl_router fixtures")
    try:
        return active.launch(model, base_url, timeout, api_key=api_key, other_args=other_args or (), env=env,
                             return_stdout_stderr=return_stdout_stderr, device=device)
    except SglWorkerError as exc:
        raise exc.with_traceback(None) from None


def kill_process_tree(parent_pid: int | None, include_parent: bool = True, skip_pid: int | None = None,
                      wait_timeout: float | None = 60) -> None:
    """sglang's ``kill_process_tree`` (same signature). The root of a server :func:`popen_launch_server` launched
    is ended by the plugin (its whole tree, the lease and port given back, counted as a stop); any other pid goes
    to sglang's own function (or, without sglang, the same walk of the tree)."""
    active = _runtime()
    if (active is not None and parent_pid is not None and include_parent and skip_pid is None
            and active.end(parent_pid)):
        return
    try:
        sglang_kill = _sglang("kill_process_tree", module="sglang.srt.utils")
    except CompatError:
        _kill_tree(parent_pid, include_parent, skip_pid, wait_timeout)
        return
    sglang_kill(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)


def _sglang(name: str, module: str = "sglang.test.test_utils") -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:
        raise CompatError(f"no pytest session with pytest-sglworker is running here, and sglang's own {name} cannot "
                          f"be used instead ({type(exc).__name__}: {exc}); run the file with pytest") from None


def _kill_tree(parent_pid: int | None, include_parent: bool, skip_pid: int | None, wait_timeout: float | None) -> None:
    """sglang's walk without sglang: SIGKILL ``parent_pid``'s descendants (and itself), then wait for them."""
    import psutil

    if parent_pid is None:
        parent_pid, include_parent = os.getpid(), False
    try:
        root = psutil.Process(parent_pid)
        procs = [p for p in root.children(recursive=True) if p.pid != skip_pid]
    except psutil.NoSuchProcess:
        return
    if include_parent and parent_pid != os.getpid():
        procs.append(root)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    if wait_timeout is not None:
        _, alive = psutil.wait_procs(procs, timeout=wait_timeout)
        if alive:
            raise subprocess.TimeoutExpired(f"kill_process_tree({parent_pid})", wait_timeout)
