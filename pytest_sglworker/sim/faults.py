"""The simulated engine's faults: one record per fault in :data:`FAULTS`, their parsing and their run-time state.

Part of :mod:`pytest_sglworker.sim`; stdlib only. Faults come in two kinds: *startup* faults (``crash_oom``,
``kv_oom``, ...) are read from ``SGLSIM_FAULT`` once; *request* faults (``fail_first``, ``latency``,
``trickle``, ...) are read from ``SGLSIM_FAULT`` too and can be changed while the server runs through its
control endpoint ``/_sim/faults``. A record names the fault, the kind of value it takes, its ``--help`` line
and the field of :class:`Faults` (startup) or :class:`RequestFaults` (request) it sets; everything else here
(the parser, the error messages, the ``--help`` list, ``/_sim/faults``) is read from the records. What a fault
does is where it acts: the startup faults in :mod:`.startup`, the request faults in the request hook of
:mod:`.routes.common` (and the gRPC servicer's), ``die_after`` and ``die_on_request`` in :meth:`.state.Sim.die`.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, fields
from typing import Any

from .core import CONTROL_PATH, ENV_FAULT


class FaultError(ValueError):
    """``SGLSIM_FAULT`` (or another ``SGLSIM_*`` variable, or a ``/_sim/faults`` body) cannot be parsed."""


@dataclass
class Faults:
    """Startup faults (read once from ``SGLSIM_FAULT``)."""

    crash_oom: bool = False
    kv_oom: bool = False
    exit_code: int | None = None
    hang: bool = False
    hang_before_bind: bool = False
    flood_mb: float = 0.0
    ignore_sigterm: bool = False
    escape_child: bool = False
    shutdown_seconds: float = 0.0


@dataclass
class RequestFaults:
    """Request faults: read from ``SGLSIM_FAULT`` and changed at run time through ``/_sim/faults``."""

    fail_first: int = 0
    fail_rate: float = 0.0
    fail_seed: int = 0
    status: int | None = None
    latency: float = 0.0
    hang_request: int = 0
    hang_requests: bool = False
    die_after: int | None = None
    die_on_request: int | None = None
    slow_health: float = 0.0
    health_fail_after: float | None = None
    api_key: str | None = None
    max_payload: int | None = None
    trickle: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Fault:
    """One fault. ``kind``: flag (no value), int, pos (int >= 1), nonneg (int >= 0), seconds (float >= 0), mb
    (float >= 0), fraction (0..1), code (exit code 0..255), status (HTTP 200..599), bytes (int >= 1), key (text).
    ``startup``: a startup fault (a field of :class:`Faults`), else a request fault (of :class:`RequestFaults`).
    ``field``: the field it sets (default: its name); ``flag_value``: what a flag sets it to."""

    name: str
    kind: str
    help: str
    startup: bool = False
    field: str = ""
    flag_value: Any = True

    @property
    def target(self) -> str:
        return self.field or self.name


#: Every fault, startup faults first (the order of ``--help`` and of the "known:" lists).
FAULTS: tuple[Fault, ...] = (
    Fault("crash_oom", "flag", "CUDA OOM in the prefill-graph capture (forced even with the prefill graph disabled), "
          "the breakable-graph error record, the num_active_captures_ assert, 'Received sigquit', then SIGKILL of "
          "itself (returncode -9)", startup=True),
    Fault("kv_oom", "flag", "0.5.23's 'Loaded weights leave no GPU memory for the KV cache' failure, exit 1",
          startup=True),
    Fault("exit", "code", "a scheduler traceback after the weights load, exit N", startup=True, field="exit_code"),
    Fault("hang", "flag", "binds, then never becomes ready", startup=True),
    Fault("hang_before_bind", "flag", "never binds", startup=True),
    Fault("flood", "mb", "MB MiB of log lines to stdout and as many to stderr while the weights load", startup=True,
          field="flood_mb"),
    Fault("ignore_sigterm", "flag", "SIGTERM is ignored (SIGINT and SIGKILL still work)", startup=True),
    Fault("shutdown", "seconds", "on SIGTERM or SIGINT, its clean shutdown takes S seconds more before it exits 0 "
          "(sglang's stops its scheduler and detokenizer first: about 4 s)", startup=True, field="shutdown_seconds"),
    Fault("escape_child", "flag", "spawns a child in its own session (SGLSIM_ESCAPED=1), logged as 'spawned "
          "scheduler pid=N'; it outlives a kill of the sim's process group, exits by itself after 600 s",
          startup=True),
    Fault("die_after", "pos", "SIGKILL of itself right after answering the N-th inference request"),
    Fault("die_on_request", "pos", "SIGKILL of itself when the N-th inference request (from when it is set) "
          "arrives, before any byte of its answer: the client's connection just closes"),
    Fault("slow_health", "seconds", "every /health, /health_generate and /ready answer is delayed by S seconds"),
    Fault("fail_first", "nonneg", "the first N inference requests (from when it is set) fail with 500 (or status=)"),
    Fault("fail_rate", "fraction", "a fraction P of the inference requests fail with 500 (or status=), "
          "deterministically: request k fails when crc32('<seed>:<k>') / 2**32 < P"),
    Fault("fail_seed", "int", "the seed of fail_rate (default 0)"),
    Fault("status", "status", "the status code of the failures; alone, every inference request answers it"),
    Fault("latency", "seconds",
          "every inference request waits S seconds in the queue (counted in its load) before it is answered"),
    Fault("hang_request", "nonneg", "the N-th inference request (from when it is set) is never answered (0: none)"),
    Fault("hang_requests", "flag", "every inference request is never answered"),
    Fault("health_fail_after", "seconds", "/health, /health_generate and /ready answer 503 from S seconds after the "
          "fault is set (0: from now on)"),
    Fault("health_fail", "flag", "/health, /health_generate and /ready answer 503 from now on (health_fail_after=0)",
          field="health_fail_after", flag_value=0.0),
    Fault("api_key", "key", "require 'Authorization: Bearer KEY' on everything but /health*, /ready*, /metrics* and "
          "/_sim/* (like --api-key, which it overrides)"),
    Fault("max_payload", "bytes", "a request body over N bytes is refused with 413 (sglang and uvicorn have no "
          "limit)"),
    Fault("trickle", "seconds", "every response (health included) is written one byte every S seconds"),
)
_BY_NAME = {fault.name: fault for fault in FAULTS}
#: name -> (kind, help) of the startup faults, and of the request faults.
STARTUP_FAULTS: dict[str, tuple[str, str]] = {f.name: (f.kind, f.help) for f in FAULTS if f.startup}
REQUEST_FAULTS: dict[str, tuple[str, str]] = {f.name: (f.kind, f.help) for f in FAULTS if not f.startup}


def known_faults() -> str:
    return ", ".join(f.name if f.kind == "flag" else f"{f.name}=..." for f in FAULTS)


_KIND_WORDS = {
    "code": "an exit code 0..255",
    "pos": "a positive integer",
    "nonneg": "a non-negative integer",
    "int": "an integer",
    "seconds": "a non-negative number of seconds",
    "mb": "a non-negative number",
    "fraction": "a number between 0 and 1",
    "status": "an HTTP status code 200..599",
    "bytes": "a positive number of bytes",
    "key": "a non-empty key without commas",
}


def _convert(name: str, kind: str, value: Any, source: str) -> Any:
    try:
        if kind == "key":
            text = str(value).strip()
            if not text or "," in text:
                raise ValueError
            return text
        if kind in ("seconds", "mb", "fraction"):
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if number != number or number < 0 or number == float("inf") or (kind == "fraction" and number > 1):
                raise ValueError
            return number
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        integer = int(value)
        low, high = {"code": (0, 255), "pos": (1, None), "nonneg": (0, None), "int": (None, None),
                     "status": (200, 599), "bytes": (1, None)}[kind]
        if (low is not None and integer < low) or (high is not None and integer > high):
            raise ValueError
        return integer
    except (TypeError, ValueError):
        raise FaultError(f"{source}: fault {name!r} needs {_KIND_WORDS[kind]}, got {value!r} "
                         f"(known: {known_faults()})") from None


def parse_fault_items(items: list[tuple[str, bool, Any]], source: str, *,
                      startup: bool) -> tuple[Faults, RequestFaults]:
    """Parse ``(name, has_value, value)`` items; ``startup``: startup faults are allowed."""
    faults, request = Faults(), RequestFaults()
    for name, has_value, value in items:
        fault = _BY_NAME.get(name)
        if fault is None:
            raise FaultError(f"{source}: unknown fault {name!r} (known: {known_faults()})")
        if fault.startup and not startup:
            raise FaultError(f"{source}: fault {name!r} is a startup fault; set it in {ENV_FAULT} before the launch "
                             f"(changeable at run time: {', '.join(REQUEST_FAULTS)})")
        target: Faults | RequestFaults = faults if fault.startup else request
        if fault.kind == "flag":
            if has_value and value not in (True, None):
                raise FaultError(f"{source}: fault {name!r} takes no value (got {value!r}; known: {known_faults()})")
            setattr(target, fault.target, fault.flag_value)
            continue
        if not has_value or value in ("", None):
            raise FaultError(f"{source}: fault {name!r} needs a value, e.g. {name}=1 (known: {known_faults()})")
        setattr(target, fault.target, _convert(name, fault.kind, value, source))
    return faults, request


def split_spec(spec: str) -> list[tuple[str, bool, Any]]:
    items = []
    for item in (part.strip() for part in spec.split(",")):
        if item:
            name, has_value, value = (s.strip() for s in item.partition("="))
            items.append((name, bool(has_value), value))
    return items


def parse_fault_spec(spec: str, source: str = ENV_FAULT) -> tuple[Faults, RequestFaults]:
    """Parse ``SGLSIM_FAULT`` (``"crash_oom"``, ``"die_after=3,latency=0.5"``, ...)."""
    return parse_fault_items(split_spec(spec), source, startup=True)


def parse_faults(spec: str) -> Faults:
    """Parse the startup faults of ``SGLSIM_FAULT`` (``"crash_oom"``, ``"exit=3,flood=2"``, ...); the request
    faults of the same spec are checked too (see :func:`parse_fault_spec`)."""
    return parse_fault_spec(spec)[0]


class FaultState:
    """The request faults of a running server and the counters they need, behind one lock."""

    def __init__(self, faults: RequestFaults, cli_api_key: str | None) -> None:
        self.lock = threading.Lock()
        self.cli_api_key = cli_api_key
        self.faults = faults
        self.set_at = time.monotonic()
        self.counted = 0  # inference requests since the faults were last set
        self.failed = 0

    def replace(self, faults: RequestFaults) -> None:
        with self.lock:
            self.faults = faults
            self.set_at = time.monotonic()
            self.counted = 0
            self.failed = 0

    def update(self, body: Any) -> RequestFaults:
        """Apply a ``POST /_sim/faults`` body: ``{"spec": "a=1,b"}`` or ``{"a": 1, "b": true}`` (``null``
        clears one), ``"reset": true`` clears all first. Raises :class:`FaultError`."""
        source = f"POST {CONTROL_PATH}"
        if not isinstance(body, dict):
            raise FaultError(f"{source}: the body must be a JSON object, e.g. {{\"fail_first\": 2}} or "
                             f"{{\"spec\": \"fail_first=2\"}}")
        body = dict(body)
        reset = bool(body.pop("reset", False))
        spec = body.pop("spec", None)
        items: list[tuple[str, bool, Any]] = split_spec(spec) if isinstance(spec, str) else []
        if spec is not None and not isinstance(spec, str):
            raise FaultError(f"{source}: 'spec' must be a string like {ENV_FAULT}")
        cleared = [name for name, value in body.items() if value is None or value is False]
        items += [(name, True, value) for name, value in body.items() if name not in cleared]
        for name in cleared:
            if name not in REQUEST_FAULTS:
                raise FaultError(f"{source}: unknown fault {name!r} (known: {known_faults()})")
        _, parsed = parse_fault_items(items, source, startup=False)
        with self.lock:
            base = RequestFaults() if reset else RequestFaults(**self.faults.as_dict())
            defaults = RequestFaults()
            given = {name for name, _, _ in items}
            for name in given:
                target = _BY_NAME[name].target
                setattr(base, target, getattr(parsed, target))
            for name in cleared:
                target = _BY_NAME[name].target
                setattr(base, target, getattr(defaults, target))
            self.faults = base
            self.set_at = time.monotonic()
            self.counted = 0
            self.failed = 0
            return base

    def snapshot(self) -> RequestFaults:
        with self.lock:
            return RequestFaults(**self.faults.as_dict())

    def api_key(self) -> str | None:
        with self.lock:
            return self.faults.api_key or self.cli_api_key

    def health_failing(self) -> bool:
        with self.lock:
            after = self.faults.health_fail_after
            return after is not None and time.monotonic() - self.set_at >= after

    def next_request(self) -> tuple[int, str | None, int]:
        """Count one inference request: ``(k, verdict, status)`` with verdict ``"die"``, ``"hang"``, ``"fail"`` or
        None."""
        with self.lock:
            f = self.faults
            self.counted += 1
            k = self.counted
            status = f.status or 500
            if f.die_on_request is not None and k == f.die_on_request:
                return k, "die", status
            if f.hang_requests or (f.hang_request and k == f.hang_request):
                return k, "hang", status
            if f.fail_first and k <= f.fail_first:
                self.failed += 1
                return k, "fail", status
            if f.fail_rate and zlib.crc32(f"{f.fail_seed}:{k}".encode()) / 2**32 < f.fail_rate:
                self.failed += 1
                return k, "fail", status
            if f.status is not None and not (f.fail_first or f.fail_rate):
                self.failed += 1
                return k, "fail", status
            return k, None, status

    def describe(self) -> dict[str, Any]:
        with self.lock:
            return {
                "faults": self.faults.as_dict(),
                "since_set": {"inference_requests": self.counted, "failed": self.failed,
                              "seconds": round(time.monotonic() - self.set_at, 3)},
            }


_PLACEHOLDER = {"code": "N", "pos": "N", "nonneg": "N", "int": "N", "bytes": "N", "seconds": "S", "fraction": "P",
                "status": "CODE", "key": "KEY", "mb": "MB"}


def fault_help() -> str:
    """The fault list, for ``--help``."""

    def block(table: dict[str, tuple[str, str]]) -> list[str]:
        import textwrap

        out = []
        for name, (kind, text) in table.items():
            shown = name if kind == "flag" else f"{name}={_PLACEHOLDER[kind]}"
            out += textwrap.wrap(text, 96, initial_indent=f"  {shown:<22} ", subsequent_indent=" " * 25)
        return out

    return "\n".join([
        f"startup faults ({ENV_FAULT} only, comma-separated):",
        *block(STARTUP_FAULTS),
        "",
        f"request faults ({ENV_FAULT}, or at run time through {CONTROL_PATH}):",
        *block(REQUEST_FAULTS),
    ])
