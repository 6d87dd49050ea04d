"""Model specs, the mandatory memory budget they carry, and the registry that holds them.

Plain Python: no pytest here. A spec says *what* to launch; :mod:`budget` checks that its argv keeps the
mandatory budget; :mod:`launcher` turns it into a process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import SpecError

#: The mandatory budget every spec carries. With the engine's default ``--mem-fraction-static`` (~0.83 on
#: an 80 GB card) the KV pool takes the slack that CUDA graph capture needs and the worker dies with -9
#: during startup; see the docs' explanation "The budget and the memory ledger".
CI_WORKER_ARGS: tuple[str, ...] = ("--mem-fraction-static=0.6", "--cuda-graph-backend-prefill=disabled")

#: Environment variables naming a directory of local model copies (``<root>/<hf id>``), first match wins.
MODEL_ROOT_ENV_VARS: tuple[str, ...] = ("SGLWORKER_MODEL_ROOT", "ROUTER_LOCAL_MODEL_PATH")

#: The largest ``memory_gb`` (GiB per GPU) and ``tp`` a spec may say: a thousand times any GPU or node there is,
#: so a larger one is a typo; said where the spec is made, never as an overflow in a later computation.
MAX_MEMORY_GB = 1024.0 * 1024.0
MAX_TP = 4096
#: a declared startup beyond a day is a typo
MAX_STARTUP_SECONDS = 86400.0

_SPEC_DICT_KEYS = frozenset({"model", "memory_gb", "tp", "features", "worker_args", "env", "description",
                             "startup_seconds"})


def _short(value: object) -> str:
    """``repr(value)``, cut short: a 4000-digit integer in a message helps nobody."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit for str()
        return "an integer of thousands of digits"
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


@dataclass(frozen=True)
class ModelSpec:
    """An sglang worker to launch: which model, how much GPU memory it needs, and its argv.

    ``worker_args`` must carry :data:`CI_WORKER_ARGS` (checked at collection by :mod:`budget`).
    ``env`` is added to the worker's environment (e.g. ``SGLANG_USE_CPU_ENGINE=1`` for the CPU recipe).
    """

    name: str
    model: str
    memory_gb: float
    tp: int = 1
    features: frozenset[str] = frozenset()
    worker_args: tuple[str, ...] = CI_WORKER_ARGS
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    description: str = ""
    #: seconds a launch of this spec takes on your machines, declared for the xdist scheduler's first run (it
    #: starts the longest launches early and gives an idle xdist worker the one ready soonest); what a run
    #: measures replaces it from the next run on (pytest's cache). None: unknown. Not part of what makes two
    #: workers interchangeable.
    startup_seconds: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or any(c.isspace() or c == "," for c in self.name):
            raise SpecError(f"model spec name {self.name!r} must be a non-empty string without spaces or commas")
        if not isinstance(self.model, str) or not self.model or "\0" in self.model:
            raise SpecError(f"model spec {self.name!r}: 'model' must be a Hugging Face id or a local path")
        memory = self.memory_gb
        # math.isfinite: NaN passes "<= 0" and inf passes everything, and both crash round() in memory_mib later.
        # An int is compared as it is (math.isfinite of a 400-digit int raises OverflowError).
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0 or (
                isinstance(memory, float) and not math.isfinite(memory)):
            raise SpecError(f"model spec {self.name!r}: 'memory_gb' must be a positive number (finite, in GiB), "
                            f"got {_short(memory)}")
        if memory > MAX_MEMORY_GB:
            raise SpecError(f"model spec {self.name!r}: 'memory_gb' (GiB of memory on each GPU) must be at most "
                            f"{MAX_MEMORY_GB:.0f}, got {_short(memory)}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or not 1 <= self.tp <= MAX_TP:
            raise SpecError(f"model spec {self.name!r}: 'tp' must be an integer from 1 to {MAX_TP} (GPUs per worker), "
                            f"got {_short(self.tp)}")
        if isinstance(self.worker_args, str):
            raise SpecError(
                f"model spec {self.name!r}: 'worker_args' must be a list of arguments, not one string "
                f"(write [{', '.join(repr(a) for a in self.worker_args.split())}])"
            )
        try:
            args = tuple(self.worker_args)
        except TypeError:
            raise SpecError(f"model spec {self.name!r}: 'worker_args' must be a list of strings") from None
        if not all(isinstance(a, str) for a in args):
            raise SpecError(f"model spec {self.name!r}: every worker arg must be a string, got {args!r}")
        if any("\0" in a for a in args):
            raise SpecError(f"model spec {self.name!r}: a worker arg holds a NUL character")
        features = self.features
        if isinstance(features, str):
            features = frozenset({features})
        try:
            features = frozenset(features)
        except TypeError:
            raise SpecError(f"model spec {self.name!r}: 'features' must be a list of feature names, "
                            f"got {features!r}") from None
        if not all(isinstance(f, str) and f for f in features):
            raise SpecError(f"model spec {self.name!r}: every feature must be a non-empty string, "
                            f"got {sorted(map(repr, features))}")
        object.__setattr__(self, "features", features)
        object.__setattr__(self, "worker_args", args)
        try:
            env = dict(self.env)
        except (TypeError, ValueError):
            raise SpecError(f"model spec {self.name!r}: 'env' must map strings to strings") from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise SpecError(f"model spec {self.name!r}: 'env' must map strings to strings")
        if any(not k or "=" in k or "\0" in k or "\0" in v for k, v in env.items()):
            raise SpecError(f"model spec {self.name!r}: an 'env' name is empty or holds '=' or NUL, or a value "
                            "holds NUL")
        object.__setattr__(self, "env", MappingProxyType(env))
        startup = self.startup_seconds
        if startup is not None and (isinstance(startup, bool) or not isinstance(startup, (int, float))
                                    or (isinstance(startup, float) and not math.isfinite(startup))
                                    or not 0 < startup <= MAX_STARTUP_SECONDS):
            raise SpecError(f"model spec {self.name!r}: 'startup_seconds' must be a positive number of seconds, at "
                            f"most {MAX_STARTUP_SECONDS:.0f} (what a launch takes, for the xdist scheduler) or None, "
                            f"got {_short(startup)}")
        if not isinstance(self.description, str):
            raise SpecError(f"model spec {self.name!r}: 'description' must be a string, got {self.description!r}")

    def __hash__(self) -> int:
        return hash((self.name, self.model, self.memory_gb, self.tp, self.features, self.worker_args,
                     tuple(sorted(self.env.items())), self.description))

    @property
    def memory_mib(self) -> int:
        return round(self.memory_gb * 1024)

    def resolve_model_path(self, environ: Mapping[str, str] | None = None) -> str:
        """The local copy ``<root>/<model>`` under a model root env var if it exists, else ``model``."""
        environ = os.environ if environ is None else environ
        if os.path.isabs(self.model):
            return self.model
        for var in MODEL_ROOT_ENV_VARS:
            root = environ.get(var)
            if root:
                candidate = Path(root) / self.model
                if candidate.exists():
                    return str(candidate)
        return self.model

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> ModelSpec:
        """Build a spec from the sglang gateway's dict shape ``{"model", "memory_gb", "tp", "features",
        "worker_args"}`` (``env``, ``description`` and ``startup_seconds`` are accepted too)."""
        if not isinstance(data, Mapping):
            raise SpecError(f"model spec {name!r}: expected a dict, got {type(data).__name__}")
        unknown = set(data) - _SPEC_DICT_KEYS
        if unknown:
            raise SpecError(
                f"model spec {name!r}: unknown key(s) {sorted(unknown)}; known keys: {sorted(_SPEC_DICT_KEYS)}"
            )
        if "model" not in data or "memory_gb" not in data:
            raise SpecError(f"model spec {name!r}: 'model' and 'memory_gb' are required")
        env = data.get("env", {})
        if not isinstance(env, Mapping):
            raise SpecError(f"model spec {name!r}: 'env' must map strings to strings, got {env!r}")
        return cls(  # every field is validated in __post_init__, as for a ModelSpec made directly
            name=name,
            model=data["model"],
            memory_gb=data["memory_gb"],
            tp=data.get("tp", 1),
            features=data.get("features", frozenset()),  # a plain string is one feature (see __post_init__)
            worker_args=data.get("worker_args", ()),
            env=dict(env),
            description=data.get("description", ""),
            startup_seconds=data.get("startup_seconds"),
        )


#: The specs every session's registry starts with (``pytest --sgl-list-models`` shows them).
BUILTIN_SPECS: tuple[ModelSpec, ...] = (
    ModelSpec("qwen3-0.6b", "Qwen/Qwen3-0.6B", 4, 1, frozenset({"chat", "streaming"})),
    ModelSpec("llama-1b", "meta-llama/Llama-3.2-1B-Instruct", 4, 1, frozenset({"chat", "streaming"})),
    ModelSpec("llama-8b", "meta-llama/Llama-3.1-8B-Instruct", 16, 1, frozenset({"chat", "streaming"})),
)


class SpecRegistry:
    """Named model specs. The plugin builds one per session: the built-ins plus what conftests register
    through the ``pytest_sglworker_register_specs(registry)`` hook."""

    def __init__(self, specs: Iterable[ModelSpec] = ()) -> None:
        self._specs: dict[str, ModelSpec] = {}
        for spec in specs:
            self.add(spec)

    @classmethod
    def with_builtins(cls) -> SpecRegistry:
        return cls(BUILTIN_SPECS)

    def add(self, spec: ModelSpec | Mapping[str, Any], name: str | None = None, *, replace: bool = False) -> ModelSpec:
        """Register a spec (a :class:`ModelSpec`, or a gateway-style dict with ``name=``).

        A name that is already registered is an error unless ``replace=True`` (to override a built-in).
        """
        if not isinstance(spec, ModelSpec):
            if name is None:
                raise SpecError("registry.add(dict) needs name=...: registry.add({...}, name='my-model')")
            spec = ModelSpec.from_dict(name, spec)
        elif name is not None and name != spec.name:
            raise SpecError(f"registry.add: name={name!r} does not match spec.name={spec.name!r}")
        if spec.name in self._specs and not replace and self._specs[spec.name] != spec:
            raise SpecError(f"model spec {spec.name!r} is already registered; pass replace=True to override it")
        self._specs[spec.name] = spec
        return spec

    def update(self, specs: Mapping[str, Mapping[str, Any] | ModelSpec], *, replace: bool = False) -> None:
        """Register a whole gateway-style ``MODEL_SPECS`` dict ``{name: {...}}``."""
        for name, data in specs.items():
            self.add(data, name=name, replace=replace)

    def get(self, name: str) -> ModelSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise SpecError(f"unknown model spec {name!r}; known: {', '.join(self.names()) or '(none)'}") from None

    def names(self) -> list[str]:
        return sorted(self._specs)

    def with_feature(self, feature: str) -> list[ModelSpec]:
        return [s for s in self if feature in s.features]

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(sorted(self._specs.values(), key=lambda s: s.name))

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs


_active: SpecRegistry | None = None


def active_registry() -> SpecRegistry:
    """The registry of the running session (set by the plugin), else the built-ins."""
    global _active
    if _active is None:
        _active = SpecRegistry.with_builtins()
    return _active


def set_active_registry(registry: SpecRegistry | None) -> None:
    global _active
    _active = registry


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered under ``name``; an unknown name raises :class:`SpecError` listing the known ones."""
    return active_registry().get(name)


def get_models_with_feature(feature: str) -> list[str]:
    """Names of the registered specs that have ``feature`` (e.g. ``"chat"``, ``"streaming"``)."""
    return [s.name for s in active_registry().with_feature(feature)]
