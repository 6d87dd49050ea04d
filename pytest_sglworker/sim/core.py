"""The simulated engine's shared pieces: environment names, the log, the event recorder and the faults.

Part of :mod:`pytest_sglworker.sim` (``python -m pytest_sglworker.sim``); stdlib only. Faults come in two
kinds: *startup* faults (``crash_oom``, ``kv_oom``, ...) are read from ``SGLSIM_FAULT`` once; *request*
faults (``fail_first``, ``latency``, ``trickle``, ...) are read from ``SGLSIM_FAULT`` too and can be changed
while the server runs through its control endpoint ``/_sim/faults``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import zlib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.sglang_facts import ModelDims
    from .tokens import ModelDir

ENV_STARTUP = "SGLSIM_STARTUP_SECONDS"
ENV_WARMUP = "SGLSIM_WARMUP_SECONDS"
ENV_GPU_MEM = "SGLSIM_GPU_MEM_GIB"
ENV_GPU_FREE = "SGLSIM_GPU_FREE_MIB"
ENV_TOKEN = "SGLSIM_TOKEN_SECONDS"
ENV_RECORD = "SGLSIM_RECORD"
ENV_FAULT = "SGLSIM_FAULT"
ENV_PD_WAIT = "SGLSIM_PD_WAIT_SECONDS"
#: Set in the environment of the child that ``escape_child`` leaves behind.
ENV_ESCAPED = "SGLSIM_ESCAPED"

#: Every response carries this header: ``<port>/<pid>`` of the worker that served it.
WORKER_HEADER = "X-SGLSim-Worker"
#: The control endpoint of the request faults.
CONTROL_PATH = "/_sim/faults"

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


# ---------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """The resolved configuration and the memory arithmetic of one simulated server (MiB are exact, GB are
    GiB, as sglang prints them)."""

    args: dict[str, Any]
    facts: ModelDims
    served_model_name: str
    total_gib: float
    avail_before: float
    weights: float
    avail_after: float
    fraction: float
    rest: float
    kv_bytes_per_token: int
    page_size: int
    max_total_tokens: int
    profiled_tokens: int
    chunked_prefill_size: int
    decode_max_bs: int
    prefill_buckets: tuple[int, ...]
    decode_backend: str
    prefill_backend: str
    context_len: int
    max_running_requests: int
    model: ModelDir
    mode: str = "null"
    free_mib: float = 0.0
    hidden_size: int = 0
    is_embedding: bool = False

    @property
    def vocab_size(self) -> int:
        return self.model.vocab.vocab_size

    @property
    def max_req_input_len(self) -> int:
        """sglang's scheduler refuses prompts of this many tokens or more (``tp_worker.py``)."""
        return min(self.context_len - 1, self.max_total_tokens - 1) - 5


# ---------------------------------------------------------------------------------------------- log


class Log:
    """sglang-like log lines on stdout (``[2026-12-02 10:00:00] ...``, ``[... TP1] ...`` on the other ranks of
    a tp>1 server), each flushed at once. Uvicorn's lines carry the same timestamp prefix, as in 0.5.23."""

    def __init__(self, level: str, http_level: str, tp_size: int = 1) -> None:
        self.level = _LEVELS.get(level.lower(), 20)
        self.http_level = _LEVELS.get(http_level.lower(), 20)
        self.tp_size = max(int(tp_size), 1)
        self._lock = threading.Lock()

    def write(self, text: str, stream: Any = None) -> None:
        out = stream if stream is not None else sys.stdout
        with self._lock:
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):  # the reader went away: keep serving
                pass

    @staticmethod
    def stamp() -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S")

    def log(self, message: str, *, level: int = 20, tp: bool = False) -> None:
        """One record; ``tp``: a per-rank record, repeated for every rank with ``TPk`` when tp > 1 (with
        ``--tp-size 1`` the real prefix has no rank at all)."""
        if level < self.level:
            return
        stamp = self.stamp()
        if tp and self.tp_size > 1:
            self.write("".join(f"[{stamp} TP{rank}] {message}\n" for rank in range(self.tp_size)))
        else:
            self.write(f"[{stamp}] {message}\n")

    def rank0(self, message: str, *, level: int = 20) -> None:
        """A record of rank 0 only (``[ts TP0]`` when tp > 1)."""
        if level < self.level:
            return
        prefix = " TP0" if self.tp_size > 1 else ""
        self.write(f"[{self.stamp()}{prefix}] {message}\n")

    def info(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=20, tp=tp)

    def warning(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=30, tp=tp)

    def error(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=40, tp=tp)

    def uvicorn(self, level: str, message: str) -> None:
        if _LEVELS[level.lower()] < self.http_level:
            return
        self.write(f"[{self.stamp()}] {level.upper() + ':':<10}{message}\n")


class Recorder:
    """One JSON line per event, appended with a single ``os.write`` on an ``O_APPEND`` descriptor."""

    def __init__(self, path: str | None, fields_: dict[str, Any]) -> None:
        self.path = path
        self.fields = fields_
        self.started = time.time()

    def record(self, event: str, **extra: Any) -> None:
        if not self.path:
            return
        entry: dict[str, Any] = {"event": event, "pid": os.getpid(), **self.fields, "time": time.time()}
        entry.update(extra)
        data = (json.dumps(entry) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            sys.stderr.write(f"{ENV_RECORD}: cannot append to {self.path!r}: {exc}\n")


# ---------------------------------------------------------------------------------------------- faults


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
    slow_health: float = 0.0
    health_fail_after: float | None = None
    api_key: str | None = None
    max_payload: int | None = None
    trickle: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: name -> (kind, help). Kinds: flag (no value), int, pos (int >= 1), nonneg (int >= 0), seconds (float >= 0),
#: mb (float >= 0), fraction (0..1), code (exit code 0..255), status (HTTP 200..599), bytes (int >= 1), key (text).
STARTUP_FAULTS: dict[str, tuple[str, str]] = {
    "crash_oom": ("flag", "CUDA OOM in the prefill-graph capture (forced even with the prefill graph disabled), the "
                          "breakable-graph error record, the num_active_captures_ assert, 'Received sigquit', then "
                          "SIGKILL of itself (returncode -9)"),
    "kv_oom": ("flag", "0.5.23's 'Loaded weights leave no GPU memory for the KV cache' failure, exit 1"),
    "exit": ("code", "a scheduler traceback after the weights load, exit N"),
    "hang": ("flag", "binds, then never becomes ready"),
    "hang_before_bind": ("flag", "never binds"),
    "flood": ("mb", "MB MiB of log lines to stdout and as many to stderr while the weights load"),
    "ignore_sigterm": ("flag", "SIGTERM is ignored (SIGINT and SIGKILL still work)"),
    "escape_child": ("flag", "spawns a child in its own session (SGLSIM_ESCAPED=1), logged as 'spawned scheduler "
                             "pid=N'; it outlives a kill of the sim's process group, exits by itself after 600 s"),
}
REQUEST_FAULTS: dict[str, tuple[str, str]] = {
    "die_after": ("pos", "SIGKILL of itself right after answering the N-th inference request"),
    "slow_health": ("seconds", "every /health, /health_generate and /ready answer is delayed by S seconds"),
    "fail_first": ("nonneg", "the first N inference requests (from when it is set) fail with 500 (or status=)"),
    "fail_rate": ("fraction", "a fraction P of the inference requests fail with 500 (or status=), "
                              "deterministically: request k fails when crc32('<seed>:<k>') / 2**32 < P"),
    "fail_seed": ("int", "the seed of fail_rate (default 0)"),
    "status": ("status", "the status code of the failures; alone, every inference request answers it"),
    "latency": ("seconds", "every inference request waits S seconds before it is answered"),
    "hang_request": ("nonneg", "the N-th inference request (from when it is set) is never answered (0: none)"),
    "hang_requests": ("flag", "every inference request is never answered"),
    "health_fail_after": ("seconds", "/health, /health_generate and /ready answer 503 from S seconds after the "
                                     "fault is set (0: from now on)"),
    "health_fail": ("flag", "/health, /health_generate and /ready answer 503 from now on (health_fail_after=0)"),
    "api_key": ("key", "require 'Authorization: Bearer KEY' on everything but /health*, /ready*, /metrics* and "
                       "/_sim/* (like --api-key, which it overrides)"),
    "max_payload": ("bytes", "a request body over N bytes is refused with 413 (sglang and uvicorn have no limit)"),
    "trickle": ("seconds", "every response (health included) is written one byte every S seconds"),
}
#: The inference paths the request faults apply to.
INFERENCE_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/encode",
                   "/v1/score", "/v1/responses")


def known_faults() -> str:
    names = [*STARTUP_FAULTS, *REQUEST_FAULTS]
    kinds = {**STARTUP_FAULTS, **REQUEST_FAULTS}
    return ", ".join(name if kinds[name][0] == "flag" else f"{name}=..." for name in names)


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


def _set_request(faults: RequestFaults, name: str, value: Any) -> None:
    if name == "health_fail":
        faults.health_fail_after = 0.0
    else:
        setattr(faults, name, value)


def parse_fault_items(items: list[tuple[str, bool, Any]], source: str, *,
                      startup: bool) -> tuple[Faults, RequestFaults]:
    """Parse ``(name, has_value, value)`` items; ``startup``: startup faults are allowed."""
    faults, request = Faults(), RequestFaults()
    for name, has_value, value in items:
        kinds = {**STARTUP_FAULTS, **REQUEST_FAULTS}
        if name not in kinds:
            raise FaultError(f"{source}: unknown fault {name!r} (known: {known_faults()})")
        if name in STARTUP_FAULTS and not startup:
            raise FaultError(f"{source}: fault {name!r} is a startup fault; set it in {ENV_FAULT} before the launch "
                             f"(changeable at run time: {', '.join(REQUEST_FAULTS)})")
        kind = kinds[name][0]
        if kind == "flag":
            if has_value and value not in (True, None):
                raise FaultError(f"{source}: fault {name!r} takes no value (got {value!r}; known: {known_faults()})")
            if name in STARTUP_FAULTS:
                setattr(faults, name, True)
            else:
                _set_request(request, name, True)
            continue
        if not has_value or value in ("", None):
            raise FaultError(f"{source}: fault {name!r} needs a value, e.g. {name}=1 (known: {known_faults()})")
        converted = _convert(name, kind, value, source)
        if name == "exit":
            faults.exit_code = converted
        elif name == "flood":
            faults.flood_mb = converted
        else:
            _set_request(request, name, converted)
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
                if name == "health_fail":
                    base.health_fail_after = parsed.health_fail_after
                else:
                    setattr(base, name, getattr(parsed, name))
            for name in cleared:
                if name == "health_fail":
                    base.health_fail_after = None
                else:
                    setattr(base, name, getattr(defaults, name))
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
        """Count one inference request: ``(k, verdict, status)`` with verdict ``"hang"``, ``"fail"`` or None."""
        with self.lock:
            f = self.faults
            self.counted += 1
            k = self.counted
            status = f.status or 500
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
        f"request faults ({ENV_FAULT}, or at run time through {CONTROL_PATH}):",
        *block(REQUEST_FAULTS),
    ])
