"""Which registered model spec serves a model name an sglang test passes to ``popen_launch_server``, which budget
opt-outs the suite declared, and what the re-exported model constants become.

sglang's suites name models by Hugging Face id (``DEFAULT_SMALL_MODEL_NAME_FOR_TEST`` is
``meta-llama/Llama-3.2-1B-Instruct``); the plugin launches specs. A name resolves, first match wins, to:

1. the spec ``SGLWORKER_COMPAT_MODELS`` maps it to (``NAME=SPEC[,NAME=SPEC...]``: CI remaps without editing code);
2. the spec :func:`map_model` maps it to (called from a ``conftest.py``);
3. the spec *named* NAME;
4. the one spec whose ``model`` is NAME, or whose local copy (``SGLWORKER_MODEL_ROOT``) is NAME; several such
   specs are an error that names them.

Nothing else (no guess by similarity): a name no spec serves is an error that says how to register or map one.

The model constants re-exported by :mod:`pytest_sglworker.compat` (``DEFAULT_*MODEL*`` names) follow the same
mapping: a constant whose value resolves to a spec becomes the path that spec's worker loads (its ``model``, or
its local copy). A test that builds a tokenizer from the constant (``get_tokenizer(DEFAULT_SMALL_MODEL_NAME_FOR_TEST)``)
then loads the model its worker serves, with no edit of the test file.

sglang renames flags between versions (0.5.23 split ``--cuda-graph-max-bs`` into ``--cuda-graph-max-bs-decode`` and
``--cuda-graph-max-bs-prefill``), and a suite written for another version passes the old name, which the engine's
own parser then rejects before anything launches. :func:`rename_flag`, called from a ``conftest.py`` with the reason,
renames it in every ``other_args`` (the worker's argv shows the new name); nothing is renamed unless asked.

Plain Python, no pytest.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping

from ..engine.specs import ModelSpec, SpecRegistry
from ..errors import SglWorkerError

__all__ = [
    "ENV_MODELS",
    "CompatError",
    "budget_opt_out",
    "clear",
    "env_mapping",
    "map_model",
    "mapped_constant",
    "opt_out_for",
    "rename_flag",
    "renamed_args",
    "resolve_spec",
]

#: ``NAME=SPEC[,NAME=SPEC...]``: model names of the suite mapped to registered spec names
ENV_MODELS = "SGLWORKER_COMPAT_MODELS"

_MAPPED: dict[str, str] = {}
_OPT_OUTS: list[tuple[str, str]] = []
_RENAMED: dict[str, tuple[str, str]] = {}


class CompatError(SglWorkerError):
    """A drop-in of :mod:`pytest_sglworker.compat` cannot do what the test asked (an unknown model name, a
    non-loopback URL, a feature it does not offer); the message says why and what to change."""


def map_model(model: str, spec: str) -> None:
    """Serve the model name ``model`` (as the suite passes it to ``popen_launch_server``) with the registered spec
    named ``spec``. Call it from a ``conftest.py``; ``SGLWORKER_COMPAT_MODELS`` overrides it."""
    if not isinstance(model, str) or not model or not isinstance(spec, str) or not spec:
        raise CompatError(f"map_model(model, spec) takes two non-empty strings, got {model!r}, {spec!r}")
    _MAPPED[model] = spec


def budget_opt_out(pattern: str, reason: str) -> None:
    """Let the servers launched by the tests ``pattern`` names break the mandatory budget, for ``reason``: a node id
    glob (``*test_srt_endpoint.py::TestSRTEndpoint``) or a part of one (a class name, ``TestSRTEndpoint``). The
    same as ``@pytest.mark.sgl_budget_opt_out(reason=...)`` on those tests, without editing their file."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise CompatError(f"budget_opt_out(pattern, reason): pattern must be a node id glob or a class name, "
                          f"got {pattern!r}")
    if not isinstance(reason, str) or not reason.strip():
        raise CompatError(f"budget_opt_out({pattern!r}, reason=...) needs a reason: why this suite may break the "
                          "budget")
    _OPT_OUTS.append((pattern.strip(), reason.strip()))


def rename_flag(old: str, new: str, *, reason: str) -> None:
    """Pass ``new`` wherever a suite's ``other_args`` pass the flag ``old`` (``--old value`` and ``--old=value``),
    for ``reason`` (the engine's version renamed it). Exact spelling only: no abbreviation is expanded."""
    for flag in (old, new):
        if not isinstance(flag, str) or not flag.startswith("--") or "=" in flag or len(flag) < 3:
            raise CompatError(f"rename_flag(old, new, reason=...): flags are '--name' strings, got {flag!r}")
    if not isinstance(reason, str) or not reason.strip():
        raise CompatError(f"rename_flag({old!r}, {new!r}, reason=...) needs a reason: which engine version renamed it")
    _RENAMED[old] = (new, reason.strip())


def renamed_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` with the :func:`rename_flag` renames applied, and one note per rename made."""
    out: list[str] = []
    notes: list[str] = []
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in _RENAMED:
            new, reason = _RENAMED[name]
            out.append(f"{new}{eq}{value}")
            note = f"{name} -> {new} ({reason})"
            if note not in notes:
                notes.append(note)
        else:
            out.append(arg)
    return out, notes


def clear() -> None:
    """Forget every :func:`map_model`, :func:`budget_opt_out` and :func:`rename_flag` (a test of this module resets
    between cases)."""
    _MAPPED.clear()
    _OPT_OUTS.clear()
    _RENAMED.clear()


def opt_out_for(nodeid: str) -> str | None:
    """The reason of the first :func:`budget_opt_out` whose pattern matches ``nodeid``, or None."""
    parts = nodeid.split("::")
    for pattern, reason in _OPT_OUTS:
        if fnmatch.fnmatchcase(nodeid, pattern) or pattern in parts:
            return reason
    return None


def env_mapping(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``SGLWORKER_COMPAT_MODELS`` read: ``{model name: spec name}``. A malformed entry is a :class:`CompatError`."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_MODELS, "").strip()
    found: dict[str, str] = {}
    if not value:
        return found
    for entry in value.split(","):
        if not entry.strip():
            continue
        # A model name may hold '=' only in theory; the spec name never does: split at the last one.
        name, sep, spec = entry.strip().rpartition("=")
        if not sep or not name.strip() or not spec.strip():
            raise CompatError(f"{ENV_MODELS}={value!r}: entry {entry.strip()!r} is not NAME=SPEC (e.g. "
                              f"{ENV_MODELS}='meta-llama/Llama-3.2-1B-Instruct=tiny-cpu')")
        found[name.strip()] = spec.strip()
    return found


def _same_path(a: str, b: str) -> bool:
    if not (os.path.isabs(a) or os.path.isabs(b)):
        return a == b
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def resolve_spec(model: str, registry: SpecRegistry, environ: Mapping[str, str] | None = None) -> ModelSpec:
    """The registered spec that serves ``model`` (see the module docstring for the order); a
    :class:`CompatError` that says how to register or map one when none does, or when several specs claim it."""
    environ = os.environ if environ is None else environ
    for source, mapping in ((ENV_MODELS, env_mapping(environ)), ("map_model()", _MAPPED)):
        if model in mapping:
            name = mapping[model]
            if name not in registry:
                raise CompatError(f"{source} maps {model!r} to the model spec {name!r}, which is not registered; "
                                  f"known: {', '.join(registry.names()) or '(none)'} (register it with the "
                                  "pytest_sglworker_register_specs hook)")
            return registry.get(name)
    if model in registry:
        return registry.get(model)
    claims = [spec for spec in registry
              if _same_path(spec.model, model) or _same_path(spec.resolve_model_path(environ), model)]
    if len(claims) == 1:
        return claims[0]
    if claims:
        names = ", ".join(repr(spec.name) for spec in claims)
        raise CompatError(f"model {model!r} is served by several registered specs ({names}); choose one: "
                          f"{ENV_MODELS}='{model}={claims[0].name}' or pytest_sglworker.compat.map_model({model!r}, "
                          f"{claims[0].name!r}) in a conftest.py")
    raise CompatError(
        f"no registered model spec serves {model!r} (known specs: {', '.join(registry.names()) or '(none)'}); "
        f"register one whose model is {model!r} with the pytest_sglworker_register_specs hook, or map the name to "
        f"a registered spec: {ENV_MODELS}='{model}=<spec>' or pytest_sglworker.compat.map_model({model!r}, '<spec>') "
        "in a conftest.py")


def mapped_constant(name: str, value: object, registry: SpecRegistry,
                    environ: Mapping[str, str] | None = None) -> object:
    """``value`` of sglang's constant ``name`` as the drop-in re-exports it: a ``DEFAULT_*MODEL*`` string that
    resolves to a spec becomes the path that spec's worker loads; anything else is unchanged."""
    if not isinstance(value, str) or not name.startswith("DEFAULT_") or "MODEL" not in name:
        return value
    try:
        spec = resolve_spec(value, registry, environ)
    except CompatError:
        return value  # a model no spec serves: its tests fail when they launch, with the message that says why
    return spec.resolve_model_path(environ)
