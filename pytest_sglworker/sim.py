"""A simulated sglang engine: a CPU-only stand-in for ``python -m sglang.launch_server``.

Run as ``python -m pytest_sglworker.sim <sglang argv>``. It is a real subprocess serving real HTTP on
the given host and port, with sglang 0.5.23's flags, startup log lines, endpoints and response shapes
(the facts in :mod:`sglang_facts`), deterministic text (the prompt's words echoed), and injectable faults.
Stdlib only, so that it starts in a few tens of milliseconds.

Startup, as the real engine does it: the server-args line, ``Load weight begin/end``, ``KV Cache is
allocated``, the decode and prefill CUDA-graph captures (unless their backend is ``disabled``),
``max_total_num_tokens=...``; only then is the port bound (``Uvicorn running on ...``); ``/health``
answers 503 until the warmup is over (``The server is fired up and ready to roll!``), 200 after.

Environment:

- ``SGLSIM_STARTUP_SECONDS`` (float, default 0.3): total simulated startup; 70 % before binding (weights,
  KV pool, graph captures), 30 % warmup after binding.
- ``SGLSIM_WARMUP_SECONDS`` (float): overrides the warmup part (the part before binding stays 70 % of
  the total). ``--skip-server-warmup`` makes the server ready at once after binding.
- ``SGLSIM_GPU_MEM_GIB`` (float, default 80): the declared card size, for the memory arithmetic.
- ``SGLSIM_TOKEN_SECONDS`` (float, default 0): time to generate one token.
- ``SGLSIM_RECORD`` (path): append one JSON line per event (``start``, ``ready``, ``exit``), each with a
  single ``O_APPEND`` write.
- ``SGLSIM_FAULT``: comma-separated faults (a bad value exits 2 naming the variable):

  - ``crash_oom``: CUDA OOM in the prefill-graph capture (forced even when the prefill graph is disabled,
    so that it works with the budget flags), then the secondary ``num_active_captures_`` assert, then
    ``Received sigquit ...``, then SIGKILL of itself (returncode -9).
  - ``kv_oom``: the 0.5.23 "Loaded weights leave no GPU memory for the KV cache" failure, exit 1.
  - ``exit=N``: a scheduler traceback after the weights load, exit N.
  - ``hang``: binds, then never becomes ready. ``hang_before_bind``: never binds.
  A port that is already in use is not a fault but the real behaviour: the bind error is logged and the
  process stays alive (as sglang 0.5.23 does) until it is signalled.
  - ``flood=MB``: MB MiB of log lines to stdout and as many to stderr while the weights load.
  - ``ignore_sigterm``: SIGTERM is ignored (SIGINT and SIGKILL still work).
  - ``escape_child``: spawns a child in its own session (``SGLSIM_ESCAPED=1`` in its environment, the rest
    inherited), logged as ``spawned scheduler pid=N``; it outlives a kill of the sim's process group and
    exits by itself only after 600 s.
  - ``die_after=N``: SIGKILL of itself right after answering the N-th inference request (``/generate``,
    ``/v1/chat/completions``, ``/v1/completions``; health and info probes do not count).
  - ``slow_health=SECONDS``: every ``/health`` and ``/health_generate`` answer is delayed.

Also like the real engine: ``--api-key`` is checked on everything but ``/health*``, ``/ready*`` and
``/metrics*``; SIGTERM/SIGINT drain in-flight requests (``/health`` answers 503 meanwhile) and exit 0; a
``CUDA_VISIBLE_DEVICES`` with fewer devices than ``--base-gpu-id + --tp-size`` fails the startup (exit 1).

Memory arithmetic (deterministic, after sglang's ``memory_hook``; all per GPU, GB = GiB):

- ``avail_before = SGLSIM_GPU_MEM_GIB * 0.98125`` (80 -> 78.50), ``weights = model weights / tp``,
  ``avail_after = avail_before - weights``.
- fraction: ``--mem-fraction-static`` or automatic: ``reserved_mib = 512 + max(chunked, 2048) * 1.5 +
  tp / 8 * 1024 + decode_max_bs * 2 (decode graph on) + 58 * 8 (prefill graph on)``, at least 10240 on a
  card over 60 GiB; ``fraction = round((mem_mib - reserved_mib) / mem_mib, 3)`` (80 GiB -> 0.83).
- ``rest = avail_after - avail_before * (1 - fraction)``; ``rest <= 0`` fails like 0.5.23 ("Loaded
  weights leave no GPU memory for the KV cache"); ``#tokens = rest * 2**30 // kv_bytes_per_token``
  rounded down to ``--page-size``, capped by ``--max-total-tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

from .sglang_facts import (
    MODEL_DIMS,
    PARSER_PROG,
    READY_LINE,
    WARMUP_PROMPT,
    ModelDims,
    activation_reserve_mib,
    activation_tokens,
    automatic_fraction,
    card_defaults,
    decode_capture_sizes,
    flag_table,
    graph_reserve_mib,
    human_readable_int,
    kv_pool_tokens,
    prefill_capture_sizes,
    total_reserve_mib,
)

VERSION = "0.5.23-sim"

ENV_STARTUP = "SGLSIM_STARTUP_SECONDS"
ENV_WARMUP = "SGLSIM_WARMUP_SECONDS"
ENV_GPU_MEM = "SGLSIM_GPU_MEM_GIB"
ENV_TOKEN = "SGLSIM_TOKEN_SECONDS"
ENV_RECORD = "SGLSIM_RECORD"
ENV_FAULT = "SGLSIM_FAULT"
#: Set in the environment of the child that ``escape_child`` leaves behind.
ENV_ESCAPED = "SGLSIM_ESCAPED"

#: How many words the simulated model says before its end-of-sequence token.
NATURAL_TOKENS = 16
#: The warmup request of the real server.
#: Seconds after which an ``escape_child`` child exits by itself, so that no test leaves it forever.
ESCAPED_CHILD_LIFETIME = 600.0

_OOM_BUCKET = 26
_SITE = "/usr/local/lib/python3.12/dist-packages"
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_PHRASES = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    503: "Service Unavailable",
}


# ---------------------------------------------------------------------------------------------- models


def model_facts(model_path: str) -> ModelDims:
    """The dims of a known model (matched on its name), else those of Qwen3-0.6B."""
    name = model_path.rstrip("/").lower()
    for dims in MODEL_DIMS.values():
        if dims.name.lower().split("/")[-1] in name:
            return dims
    return MODEL_DIMS["Qwen/Qwen3-0.6B"]


# ---------------------------------------------------------------------------------------------- CLI


def _human_readable_int(value: str) -> int:
    try:
        return human_readable_int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _graph_backend(raw: str) -> str:
    if raw == "tc_piecewise":
        raise argparse.ArgumentTypeError("tc_piecewise was removed; select breakable, full, or disabled")
    return raw


#: sglang's own flag types, by name (the table stores the type's ``__name__``); any other type is a string.
_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "human_readable_int": _human_readable_int,
    "parse_cuda_graph_backend_arg": _graph_backend,
}


def build_parser() -> argparse.ArgumentParser:
    """sglang 0.5.23's ``ServerArgs.add_cli_args``, rebuilt from the flag table of :mod:`sglang_facts`: every
    flag the real parser accepts (abbreviations too), with its choices and defaults, so that the simulated
    engine accepts and rejects exactly what the real one does."""
    p = argparse.ArgumentParser(prog=PARSER_PROG, allow_abbrev=True)
    for flag in flag_table().flags:
        longs = [o for o in flag.options if not o.startswith("--no-")]
        if not flag.takes_value:
            if len(longs) < len(flag.options):  # --x / --no-x
                p.add_argument(*longs, dest=flag.dest, action=argparse.BooleanOptionalAction, default=flag.default)
            else:
                p.add_argument(*longs, dest=flag.dest, action="store_true")
            continue
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": flag.default, "required": flag.required,
                                  "type": _TYPES.get(flag.type or "", str)}
        if flag.nargs is not None:
            kwargs["nargs"] = flag.nargs
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        p.add_argument(*longs, **kwargs)
    return p


# ---------------------------------------------------------------------------------------------- faults


class FaultError(ValueError):
    """``SGLSIM_FAULT`` (or another ``SGLSIM_*`` variable) cannot be parsed."""


@dataclass
class Faults:
    crash_oom: bool = False
    kv_oom: bool = False
    exit_code: int | None = None
    hang: bool = False
    hang_before_bind: bool = False
    flood_mb: float = 0.0
    ignore_sigterm: bool = False
    escape_child: bool = False
    die_after: int | None = None
    slow_health: float = 0.0


_FLAG_FAULTS = ("crash_oom", "kv_oom", "hang", "hang_before_bind", "ignore_sigterm", "escape_child")
_VALUE_FAULTS = ("exit", "flood", "die_after", "slow_health")


def parse_faults(spec: str) -> Faults:
    """Parse ``SGLSIM_FAULT`` (``"crash_oom"``, ``"die_after=3,slow_health=0.5"``, ...)."""
    faults = Faults()
    known = ", ".join([*_FLAG_FAULTS, *(f"{name}=..." for name in _VALUE_FAULTS)])
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, has_value, value = (s.strip() for s in item.partition("="))
        if name in _FLAG_FAULTS:
            if has_value:
                raise FaultError(f"{ENV_FAULT}: fault {name!r} takes no value (got {item!r})")
            setattr(faults, name, True)
            continue
        if name not in _VALUE_FAULTS:
            raise FaultError(f"{ENV_FAULT}: unknown fault {name!r} in {spec!r} (known: {known})")
        if not has_value or not value:
            raise FaultError(f"{ENV_FAULT}: fault {name!r} needs a value, e.g. {name}=1 (got {item!r})")
        try:
            if name == "exit":
                faults.exit_code = int(value)
                if not 0 <= faults.exit_code <= 255:
                    raise ValueError
            elif name == "die_after":
                faults.die_after = int(value)
                if faults.die_after < 1:
                    raise ValueError
            elif name == "flood":
                faults.flood_mb = float(value)
                if faults.flood_mb < 0:
                    raise ValueError
            else:
                faults.slow_health = float(value)
                if faults.slow_health < 0:
                    raise ValueError
        except ValueError:
            kind = {"exit": "an exit code 0..255", "die_after": "a positive integer"}.get(name, "a non-negative number")
            raise FaultError(f"{ENV_FAULT}: fault {name!r} needs {kind}, got {value!r}") from None
    return faults


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise FaultError(f"{name}: expected a number of seconds/GiB, got {raw!r}") from None
    if value < 0:
        raise FaultError(f"{name}: expected a non-negative number, got {raw!r}")
    return value


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Plan:
    """The resolved configuration and the memory arithmetic of one simulated server."""

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


def make_plan(ns: argparse.Namespace, total_gib: float) -> Plan:
    """Resolve defaults and do the engine's memory arithmetic (see the module docstring)."""
    args = dict(vars(ns))
    facts = model_facts(ns.model_path)
    tp = max(int(ns.tp_size), 1)
    mode = ns.disaggregation_mode or "null"
    on_cpu = (ns.device or "cuda") == "cpu"
    decode_backend = ns.cuda_graph_backend_decode or "full"
    prefill_backend = ns.cuda_graph_backend_prefill or "breakable"
    if ns.disable_cuda_graph or on_cpu:
        decode_backend = prefill_backend = "disabled"
    mem_mib = total_gib * 1024
    default_chunked, decode_max_bs = card_defaults(mem_mib, tp)
    if ns.cuda_graph_max_bs_decode is not None:
        decode_max_bs = ns.cuda_graph_max_bs_decode
    elif ns.max_running_requests is not None:
        decode_max_bs = min(decode_max_bs, ns.max_running_requests)
    chunked = ns.chunked_prefill_size if ns.chunked_prefill_size is not None else default_chunked
    prefill_max_bs = ns.cuda_graph_max_bs_prefill or (chunked if chunked > 0 else ns.max_prefill_tokens)
    if ns.cuda_graph_max_bs_prefill is None and ns.max_total_tokens is not None:
        prefill_max_bs = min(prefill_max_bs, ns.max_total_tokens)
    buckets = prefill_capture_sizes(prefill_max_bs)
    if ns.mem_fraction_static is not None:
        fraction = float(ns.mem_fraction_static)
    else:
        activation = activation_reserve_mib(activation_tokens(
            mode=mode, chunked_prefill_size=chunked, max_prefill_tokens=ns.max_prefill_tokens,
            max_running_requests=ns.max_running_requests, decode_max_bs=decode_max_bs,
            speculative_num_draft_tokens=ns.speculative_num_draft_tokens), tp, ns.pp_size or 1)
        graphs = graph_reserve_mib(mode=mode, decode_backend=decode_backend, decode_max_bs=decode_max_bs,
                                   prefill_backend=prefill_backend, prefill_buckets=len(buckets))
        fraction = automatic_fraction(mem_mib, total_reserve_mib(mem_mib, activation, graphs))
    avail_before = round(total_gib * 0.98125, 2)
    weights = round(facts.weights_mib(tp) / 1024, 2)
    avail_after = round(avail_before - weights, 2)
    rest = avail_after - avail_before * (1 - fraction)
    kv_bytes = facts.kv_bytes_per_token(tp)
    page_size = max(ns.page_size or 1, 1)
    profiled, tokens = kv_pool_tokens(avail_before * 1024, avail_after * 1024, fraction, kv_bytes,
                                      page_size=page_size, max_total_tokens=ns.max_total_tokens)
    context_len = ns.context_length or facts.context_len
    max_running = ns.max_running_requests or max(min(4096, tokens // 2), 1)
    served = ns.served_model_name or ns.model_path
    args.update(
        tokenizer_path=ns.tokenizer_path or ns.model_path,
        served_model_name=served,
        mem_fraction_static=fraction,
        chunked_prefill_size=chunked,
        page_size=page_size,
        max_running_requests=max_running,
        context_length=context_len,
        cuda_graph_backend_decode=decode_backend,
        cuda_graph_backend_prefill=prefill_backend,
        device=ns.device or "cuda",
        log_level_http=ns.log_level_http or ns.log_level,
        hicache_ratio=ns.hicache_ratio if ns.hicache_ratio is not None else 2.0,
        random_seed=ns.random_seed if ns.random_seed is not None else 42,
    )
    return Plan(
        args=args,
        facts=facts,
        served_model_name=served,
        total_gib=total_gib,
        avail_before=avail_before,
        weights=weights,
        avail_after=avail_after,
        fraction=fraction,
        rest=rest,
        kv_bytes_per_token=kv_bytes,
        page_size=page_size,
        max_total_tokens=tokens,
        profiled_tokens=profiled,
        chunked_prefill_size=chunked,
        decode_max_bs=decode_max_bs,
        prefill_buckets=tuple(buckets),
        decode_backend=decode_backend,
        prefill_backend=prefill_backend,
        context_len=context_len,
        max_running_requests=max_running,
    )


# ---------------------------------------------------------------------------------------------- output


class Log:
    """sglang-like log lines on stdout (``[2026-12-02 10:00:00 TP0] ...``), each flushed at once."""

    def __init__(self, level: str, http_level: str) -> None:
        self.level = _LEVELS.get(level.lower(), 20)
        self.http_level = _LEVELS.get(http_level.lower(), 20)
        self._lock = threading.Lock()

    def write(self, text: str, stream: Any = None) -> None:
        out = stream if stream is not None else sys.stdout
        with self._lock:
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):  # the reader went away: keep serving
                pass

    def log(self, message: str, *, level: int = 20, tp: bool = False) -> None:
        if level < self.level:
            return
        prefix = " TP0" if tp else ""
        self.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}{prefix}] {message}\n")

    def info(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=20, tp=tp)

    def warning(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=30, tp=tp)

    def error(self, message: str, *, tp: bool = False) -> None:
        self.log(message, level=40, tp=tp)

    def uvicorn(self, level: str, message: str) -> None:
        if _LEVELS[level.lower()] < self.http_level:
            return
        self.write(f"{level.upper() + ':':<10}{message}\n")


class Recorder:
    """One JSON line per event, appended with a single ``os.write`` on an ``O_APPEND`` descriptor."""

    def __init__(self, path: str | None, plan: Plan) -> None:
        self.path = path
        self.plan = plan
        self.started = time.time()

    def record(self, event: str, **extra: Any) -> None:
        if not self.path:
            return
        args = self.plan.args
        entry: dict[str, Any] = {
            "event": event,
            "pid": os.getpid(),
            "host": args["host"],
            "port": args["port"],
            "nccl_port": args["nccl_port"],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "base_gpu_id": args["base_gpu_id"],
            "tp_size": args["tp_size"],
            "mem_fraction_static": self.plan.fraction,
            "model": args["model_path"],
            "time": time.time(),
        }
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


# ---------------------------------------------------------------------------------------------- generation


@dataclass
class Generation:
    words: list[str]
    output_ids: list[int]
    finish: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def completion_tokens(self) -> int:
        return len(self.words)

    def openai_finish(self) -> tuple[str, Any]:
        """(finish_reason, matched_stop) as the OpenAI endpoints spell them."""
        if self.finish["type"] == "length":
            return "length", None
        return "stop", self.finish.get("matched")


class BadRequest(Exception):
    """A request the real server would refuse with 400."""


def _as_stop_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise BadRequest("stop must be a string or a list of strings")


def _as_max_tokens(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- state


class _Shutdown(BaseException):
    """Raised in the main thread by the SIGTERM/SIGINT handler."""


class Sim:
    """The state of one simulated server, shared by the main thread and the HTTP threads."""

    def __init__(self, plan: Plan, faults: Faults, log: Log, recorder: Recorder, token_seconds: float) -> None:
        self.plan = plan
        self.faults = faults
        self.log = log
        self.recorder = recorder
        self.token_seconds = token_seconds
        self.lock = threading.Lock()
        self.ready = False
        self.shutting_down = False
        self.bound = False
        self.running = 0
        self.inference_served = 0
        self.num_requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.rid_counter = 0
        self.cache: deque[tuple[str, ...]] = deque(maxlen=256)
        self.startup_time = time.time()
        self.server: SimHTTPServer | None = None

    def new_id(self) -> str:
        with self.lock:
            self.rid_counter += 1
            return f"{os.getpid():x}{self.rid_counter:08x}{int(time.time() * 1000) & 0xFFFFFF:06x}"

    def generate(self, prompt: list[str], max_new_tokens: int | None, stop: list[str], ignore_eos: bool) -> Generation:
        """Deterministic output: the prompt's words, cycled, until EOS (16 words), max tokens or a stop."""
        facts = self.plan.facts
        limit = NATURAL_TOKENS if max_new_tokens is None else max_new_tokens
        natural = limit if ignore_eos else NATURAL_TOKENS
        source = prompt or ["sim"]
        words: list[str] = []
        finish: dict[str, Any] | None = None
        while finish is None:
            if len(words) >= limit:
                finish = {"type": "length", "length": limit}
                break
            if len(words) >= natural:
                finish = {"type": "stop", "matched": facts.eos_token_id}
                break
            words.append(source[len(words) % len(source)])
            text = " ".join(words)
            for s in stop:
                at = text.find(s)
                if at >= 0:
                    words = text[:at].split()
                    finish = {"type": "stop", "matched": s}
                    break
        output_ids = [zlib.crc32(w.encode()) % (facts.vocab_size or 32_000) for w in words]
        key = tuple(prompt)
        with self.lock:
            best = 0
            for seen in self.cache:
                n = 0
                for a, b in zip(seen, key, strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            cached = min(best, max(len(key) - 1, 0)) // self.plan.page_size * self.plan.page_size
            self.cache.append(key + tuple(words))
            self.num_requests_total += 1
            self.prompt_tokens_total += len(key)
            self.generation_tokens_total += len(words)
            self.cached_tokens_total += cached
        self.log.info(
            f"Prefill batch. #new-seq: 1, #new-token: {len(key) - cached}, #cached-token: {cached}, "
            f"token usage: 0.00, #running-req: {self.running}, #queue-req: 0",
            tp=True,
        )
        return Generation(words, output_ids, finish, len(key), cached)

    def flush_cache(self) -> None:
        with self.lock:
            self.cache.clear()
        self.log.info("Cache flushed successfully!", tp=True)

    def metrics(self) -> str:
        labels = f'engine_type="unified",model_name="{self.plan.served_model_name}",pp_rank="0",tp_rank="0"'
        with self.lock:
            prompt = self.prompt_tokens_total
            hit = self.cached_tokens_total / prompt if prompt else 0.0
            gauges = [
                ("num_running_reqs", "The number of running requests.", self.running),
                ("num_queue_reqs", "The number of requests in the waiting queue.", 0),
                ("num_used_tokens", "The number of used tokens.", 0),
                ("token_usage", "The token usage.", 0.0),
                ("cache_hit_rate", "The prefix cache hit rate.", hit),
                ("gen_throughput", "The generation throughput (token/s).", 0.0),
                (
                    "max_total_num_tokens",
                    "Maximum total number of tokens in the KV cache pool.",
                    self.plan.max_total_tokens,
                ),
            ]
            counters = [
                ("prompt_tokens", "Number of prefill tokens processed.", prompt),
                ("generation_tokens", "Number of generation tokens processed.", self.generation_tokens_total),
                ("cached_tokens", "Number of cached prompt tokens.", self.cached_tokens_total),
                ("num_requests", "Number of requests processed.", self.num_requests_total),
            ]
        lines: list[str] = []
        for name, doc, value in gauges:
            lines += [
                f"# HELP sglang:{name} {doc}",
                f"# TYPE sglang:{name} gauge",
                f"sglang:{name}{{{labels}}} {float(value)}",
            ]
        for name, doc, value in counters:
            lines += [
                f"# HELP sglang:{name}_total {doc}",
                f"# TYPE sglang:{name}_total counter",
                f"sglang:{name}_total{{{labels}}} {float(value)}",
            ]
        return "\n".join(lines) + "\n"

    def count_inference(self) -> bool:
        """Count a served inference request; True when ``die_after`` says this one was the last."""
        with self.lock:
            self.inference_served += 1
            return self.faults.die_after is not None and self.inference_served >= self.faults.die_after

    def die(self) -> NoReturn:
        n = self.faults.die_after
        self.log.error(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            f'  File "{_SITE}/sglang/srt/managers/scheduler.py", line 6360, in run_scheduler_process\n'
            "    scheduler.event_loop_overlap()\n"
            f'  File "{_SITE}/sglang/srt/managers/scheduler.py", line 1502, in event_loop_overlap\n'
            "    batch_result = self.run_batch(batch)\n"
            f"RuntimeError: simulated death after {n} requests ({ENV_FAULT}=die_after={n})",
            tp=True,
        )
        self.log.error("SIGQUIT received. signum=3, frame=None. It usually means one child failed.")
        _kill_self()


def _kill_self() -> NoReturn:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - SIGKILL is not deliverable late
        time.sleep(1)


# ---------------------------------------------------------------------------------------------- HTTP


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # an idle keep-alive connection must not hold up the shutdown
    request_queue_size = 2048

    def __init__(self, address: tuple[str, int], sim: Sim) -> None:
        self.sim = sim
        super().__init__(address, Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(host), a reverse DNS lookup: skip it.
        import socketserver

        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class SimHTTPServer6(SimHTTPServer):
    address_family = socket.AF_INET6


_INFERENCE_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


class Handler(BaseHTTPRequestHandler):
    # Headers and body go out as separate writes: without TCP_NODELAY each response with a body stalls
    # ~40 ms on loopback (Nagle + delayed ACK), as uvicorn does not.
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""

    # ------------------------------------------------------------------ plumbing

    @property
    def sim(self) -> Sim:
        server = self.server
        assert isinstance(server, SimHTTPServer)
        return server.sim

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = int(code) if str(code).isdigit() else 0
        phrase = _PHRASES.get(status) or self.responses.get(status, ("",))[0]
        host, port = self.client_address[:2]
        self.sim.log.uvicorn("INFO", f'{host}:{port} - "{self.requestline}" {code} {phrase}')

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size_line = self.rfile.readline(65537)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _openai_error(self, status: int, message: str) -> None:
        self._json(
            status, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
        )

    def _stream(self, events: Iterator[Any]) -> None:
        """Server-sent events, chunked: ``data: {json}\\n\\n`` per event, then ``data: [DONE]\\n\\n``."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        for event in events:
            chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _authorized(self, path: str) -> bool:
        key = self.sim.plan.args["api_key"]
        if not key or self.command == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and token == key

    # ------------------------------------------------------------------ dispatch

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def _routes(self) -> dict[str, tuple[tuple[str, ...], Callable[[bytes], None]]]:
        routes: dict[str, tuple[tuple[str, ...], Callable[[bytes], None]]] = {
            "/health": (("GET",), self._health),
            "/health_generate": (("GET",), self._health),
            "/ready": (("GET",), self._ready),
            "/ping": (("GET",), self._ping),
            "/model_info": (("GET",), self._model_info),
            "/get_model_info": (("GET",), self._model_info),
            "/server_info": (("GET",), self._server_info),
            "/get_server_info": (("GET",), self._server_info),
            "/v1/models": (("GET",), self._models),
            "/generate": (("POST", "PUT"), self._generate),
            "/v1/chat/completions": (("POST",), self._chat),
            "/v1/completions": (("POST",), self._completions),
            "/flush_cache": (("GET", "POST"), self._flush_cache),
        }
        if self.sim.plan.args["enable_metrics"]:
            routes["/metrics"] = (("GET",), self._metrics)
        return routes

    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            self._json(400, {"detail": "Invalid request body"})
            return
        if not self._authorized(path):
            self._json(401, {"error": "Unauthorized"})
            return
        routes = self._routes()
        route = routes.get(path)
        if route is None and path.startswith("/v1/models/") and self.command == "GET":
            route = (("GET",), self._model_card)
        if route is None:
            self._json(404, {"detail": "Not Found"})
            return
        methods, handler = route
        if self.command not in methods:
            self._json(405, {"detail": "Method Not Allowed"})
            return
        inference = path in _INFERENCE_PATHS
        if inference:
            with self.sim.lock:
                self.sim.running += 1
        try:
            handler(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        finally:
            if inference:
                with self.sim.lock:
                    self.sim.running -= 1
        if inference and self.sim.count_inference():
            self.sim.die()

    # ------------------------------------------------------------------ health and info

    def _health(self, body: bytes) -> None:
        if self.sim.faults.slow_health:
            time.sleep(self.sim.faults.slow_health)
        if self.sim.shutting_down:
            self.sim.log.info("Health check request received during shutdown. Returning 503.")
        ok = self.sim.ready and not self.sim.shutting_down
        self._send(200 if ok else 503, b"")

    def _ready(self, body: bytes) -> None:
        self._send(200 if self.sim.ready and not self.sim.shutting_down else 503, b"")

    def _ping(self, body: bytes) -> None:
        self._send(200, b"")

    def _deprecated(self, old: str, new: str) -> None:
        self.sim.log.warning(
            f"Endpoint '{old}' is deprecated and will be removed in a future version. Please use '{new}' instead."
        )

    def _model_info(self, body: bytes) -> None:
        if self.path.startswith("/get_"):
            self._deprecated("/get_model_info", "/model_info")
        plan = self.sim.plan
        self._json(
            200,
            {
                "model_path": plan.args["model_path"],
                "served_model_name": plan.served_model_name,
                "tokenizer_path": plan.args["tokenizer_path"],
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": plan.facts.model_type,
                "architectures": [plan.facts.architecture],
            },
        )

    def _server_info(self, body: bytes) -> None:
        if self.path.startswith("/get_"):
            self._deprecated("/get_server_info", "/server_info")
        sim = self.sim
        info = dict(sim.plan.args)
        info.update(
            max_total_num_tokens=sim.plan.max_total_tokens,
            startup_time=sim.startup_time,
            internal_states=[
                {
                    "last_gen_throughput": 0.0,
                    "max_total_num_tokens": sim.plan.max_total_tokens,
                    "num_running_reqs": sim.running,
                }
            ],
            version=VERSION,
            frontend="python",
        )
        self._json(200, info)

    def _model_card(self, body: bytes) -> None:
        name = self.path.split("?", 1)[0][len("/v1/models/") :]
        plan = self.sim.plan
        if name != plan.served_model_name:
            self._json(
                404,
                {
                    "error": {
                        "message": f"The model '{name}' does not exist",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
            )
            return
        self._json(200, self._card())

    def _card(self) -> dict[str, Any]:
        plan = self.sim.plan
        return {
            "id": plan.served_model_name,
            "object": "model",
            "created": int(self.sim.startup_time),
            "owned_by": "sglang",
            "root": plan.served_model_name,
            "parent": None,
            "max_model_len": plan.context_len,
        }

    def _models(self, body: bytes) -> None:
        self._json(200, {"object": "list", "data": [self._card()]})

    def _flush_cache(self, body: bytes) -> None:
        self.sim.flush_cache()
        self._send(
            200,
            b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            b"waiting requests, the operation will not be performed.)\n",
            "text/plain; charset=utf-8",
        )

    def _metrics(self, body: bytes) -> None:
        self._send(200, self.sim.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ inference

    def _parse_json(self, body: bytes, *, require_json_type: bool) -> dict[str, Any]:
        if require_json_type:
            media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise BadRequest("Unsupported Media Type: Only 'application/json' is allowed")
        try:
            obj = json.loads(body or b"null")
        except ValueError as exc:
            raise BadRequest(f"JSON decode error: {exc}") from None
        if not isinstance(obj, dict):
            raise BadRequest("the request body must be a JSON object")
        return obj

    def _pace(self, tokens: int) -> None:
        if self.sim.token_seconds and tokens:
            time.sleep(self.sim.token_seconds * tokens)

    def _generate(self, body: bytes) -> None:
        try:
            req = self._parse_json(body, require_json_type=False)
            prompts = self._generate_prompts(req)
            params = req.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise BadRequest("sampling_params must be an object")
            max_new = _as_max_tokens(params.get("max_new_tokens", 128), "max_new_tokens")
            stop = _as_stop_list(params.get("stop"))
            ignore_eos = bool(params.get("ignore_eos", False))
        except BadRequest as exc:
            self._json(400, {"error": {"message": str(exc)}})
            return
        items, batch = prompts
        started = time.perf_counter()
        if req.get("stream"):
            self._stream(self._generate_events(items, max_new, stop, ignore_eos, batch, started))
            return
        outs = []
        for prompt in items:
            gen = self.sim.generate(prompt, max_new, stop, ignore_eos)
            self._pace(gen.completion_tokens)
            outs.append(self._generate_out(gen, gen.words, started, final=True))
        self._json(200, outs if batch else outs[0])

    def _generate_prompts(self, req: dict[str, Any]) -> tuple[list[list[str]], bool]:
        """The prompts as word lists, and whether the request is a batch."""
        text, ids = req.get("text"), req.get("input_ids")
        if text is not None:
            if isinstance(text, str):
                return [text.split()], False
            if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                return [t.split() for t in text], True
            raise BadRequest("text must be a string or a non-empty list of strings")
        if ids is not None:
            if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
                return [[f"tok{i}" for i in ids]], False
            if (
                isinstance(ids, list)
                and ids
                and all(isinstance(row, list) and all(isinstance(i, int) for i in row) for row in ids)
            ):
                return [[f"tok{i}" for i in row] for row in ids], True
            raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")

    def _generate_out(self, gen: Generation, words: list[str], started: float, *, final: bool) -> dict[str, Any]:
        return {
            "text": " ".join(words),
            "output_ids": gen.output_ids[: len(words)],
            "meta_info": {
                "id": self.sim.new_id(),
                "finish_reason": gen.finish if final else None,
                "prompt_tokens": gen.prompt_tokens,
                "weight_version": "default",
                "total_retractions": 0,
                "completion_tokens": len(words),
                "cached_tokens": gen.cached_tokens,
                "e2e_latency": round(time.perf_counter() - started, 6),
            },
        }

    def _generate_events(
        self,
        items: list[list[str]],
        max_new: int | None,
        stop: list[str],
        ignore_eos: bool,
        batch: bool,
        started: float,
    ) -> Iterator[dict[str, Any]]:
        for index, prompt in enumerate(items):
            gen = self.sim.generate(prompt, max_new, stop, ignore_eos)
            n = gen.completion_tokens
            for k in range(1, n + 1):
                self._pace(1)
                out = self._generate_out(gen, gen.words[:k], started, final=k == n)
                if batch:
                    out["index"] = index
                yield out
            if n == 0:
                out = self._generate_out(gen, [], started, final=True)
                if batch:
                    out["index"] = index
                yield out

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        }

    def _openai_common(self, req: dict[str, Any]) -> tuple[int | None, list[str], bool, int]:
        max_tokens = _as_max_tokens(req.get("max_completion_tokens"), "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _as_max_tokens(req.get("max_tokens"), "max_tokens")
        n = req.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequest(f"n must be a positive integer, got {n!r}")
        return max_tokens, _as_stop_list(req.get("stop")), bool(req.get("ignore_eos", False)), n

    def _chat(self, body: bytes) -> None:
        try:
            req = self._parse_json(body, require_json_type=True)
            messages = req.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            prompt: list[str] = []
            for message in messages:
                if not isinstance(message, dict) or "role" not in message:
                    raise BadRequest("each message must be an object with a role")
                content = message.get("content")
                if isinstance(content, str):
                    prompt += content.split()
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            prompt += part["text"].split()
            max_tokens, stop, ignore_eos, n = self._openai_common(req)
        except BadRequest as exc:
            self._openai_error(400, str(exc))
            return
        model = self.sim.plan.served_model_name
        rid, created = f"chatcmpl-{self.sim.new_id()}", int(time.time())
        gens = [self.sim.generate(prompt, max_tokens, stop, ignore_eos) for _ in range(n)]
        usage = self._usage(gens[0].prompt_tokens, sum(g.completion_tokens for g in gens))
        if req.get("stream"):
            options = req.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            self._stream(self._chat_events(gens, rid, created, model, usage if include_usage else None))
            return
        self._pace(max(g.completion_tokens for g in gens))
        choices = []
        for index, gen in enumerate(gens):
            reason, matched = gen.openai_finish()
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": gen.text, "reasoning_content": None},
                    "logprobs": None,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
        self._json(
            200,
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage,
                "metadata": {"weight_version": "default"},
            },
        )

    def _chat_events(
        self, gens: list[Generation], rid: str, created: int, model: str, usage: dict[str, Any] | None
    ) -> Iterator[dict[str, Any]]:
        def chunk(index: int, delta: dict[str, Any], reason: str | None = None, matched: Any = None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
                ],
                "usage": None,
            }

        for index, gen in enumerate(gens):
            yield chunk(index, {"role": "assistant", "content": ""})
            for k, word in enumerate(gen.words):
                self._pace(1)
                yield chunk(index, {"content": word if k == 0 else " " + word})
            reason, matched = gen.openai_finish()
            yield chunk(index, {}, reason, matched)
        if usage is not None:
            yield {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }

    def _completions(self, body: bytes) -> None:
        try:
            req = self._parse_json(body, require_json_type=True)
            raw = req.get("prompt")
            prompts: list[tuple[str, list[str]]]
            if isinstance(raw, str):
                prompts = [(raw, raw.split())]
            elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
                prompts = [(p, p.split()) for p in raw]
            elif isinstance(raw, list) and raw and all(isinstance(i, int) for i in raw):
                prompts = [("", [f"tok{i}" for i in raw])]
            elif (
                isinstance(raw, list)
                and raw
                and all(isinstance(r, list) and all(isinstance(i, int) for i in r) for r in raw)
            ):
                prompts = [("", [f"tok{i}" for i in r]) for r in raw]
            else:
                raise BadRequest("prompt must be a string, a list of strings, or token ids")
            max_tokens, stop, ignore_eos, n = self._openai_common(req)
            if max_tokens is None:
                max_tokens = 16  # the OpenAI completions default
            echo = bool(req.get("echo", False))
        except BadRequest as exc:
            self._openai_error(400, str(exc))
            return
        model = self.sim.plan.served_model_name
        rid, created = f"cmpl-{self.sim.new_id()}", int(time.time())
        gens: list[tuple[str, Generation]] = []
        for text, words in prompts:
            for _ in range(n):
                gens.append((text, self.sim.generate(words, max_tokens, stop, ignore_eos)))
        usage = self._usage(sum(g.prompt_tokens for _, g in gens[::n]), sum(g.completion_tokens for _, g in gens))
        if req.get("stream"):
            options = req.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            self._stream(self._completion_events(gens, echo, rid, created, model, usage if include_usage else None))
            return
        self._pace(max(g.completion_tokens for _, g in gens))
        choices = []
        for index, (text, gen) in enumerate(gens):
            reason, matched = gen.openai_finish()
            out = (text + " " + gen.text if text and gen.text else text + gen.text) if echo else gen.text
            choices.append(
                {"index": index, "text": out, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
            )
        self._json(
            200,
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage,
            },
        )

    def _completion_events(
        self,
        gens: list[tuple[str, Generation]],
        echo: bool,
        rid: str,
        created: int,
        model: str,
        usage: dict[str, Any] | None,
    ) -> Iterator[dict[str, Any]]:
        def chunk(index: int, text: str, reason: str | None = None, matched: Any = None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": index, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
                ],
                "usage": None,
            }

        for index, (text, gen) in enumerate(gens):
            if echo and text:
                yield chunk(index, text)
            for k, word in enumerate(gen.words):
                self._pace(1)
                yield chunk(index, word if k == 0 and not (echo and text) else " " + word)
            reason, matched = gen.openai_finish()
            yield chunk(index, "", reason, matched)
        if usage is not None:
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }


# ---------------------------------------------------------------------------------------------- startup


def _server_args_line(plan: Plan) -> str:
    # 0.5.23 logs the resolved arguments as a dict (older versions: ServerArgs(...)).
    return f"server_args={plan.args!r}"


def _scheduler_traceback(frames: list[tuple[str, int, str, str]], last: str) -> str:
    lines = ["Traceback (most recent call last):"]
    lines += [f'  File "{_SITE}/{path}", line {line}, in {func}\n    {code}' for path, line, func, code in frames]
    lines.append(last)
    return "\n".join(lines)


_SCHEDULER_FRAME = ("sglang/srt/managers/scheduler.py", 6360, "run_scheduler_process", "scheduler = Scheduler(")


def _crash_oom(sim: Sim) -> NoReturn:
    plan, log = sim.plan, sim.log
    gpu = plan.args["base_gpu_id"]
    capacity = max(plan.total_gib - 0.81, 1.0)
    first = _scheduler_traceback(
        [
            _SCHEDULER_FRAME,
            ("sglang/srt/managers/scheduler.py", 1124, "__init__", "self.tp_worker.init_cuda_graphs()"),
            ("sglang/srt/managers/tp_worker.py", 435, "init_cuda_graphs", "self.model_runner.init_cuda_graphs("),
            ("sglang/srt/model_executor/model_runner.py", 1191, "init_cuda_graphs", "capture = capture_cuda_graphs("),
            (
                "sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py",
                691,
                "capture_prefill_graph",
                "prefill_runner = PrefillCudaGraphRunner(model_runner)",
            ),
            (
                "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py",
                318,
                "capture",
                f"self.capture_one_num_tokens(num_tokens={prefill_capture_sizes(8192)[_OOM_BUCKET - 1]})",
            ),
            ("torch/cuda/graphs.py", 256, "__exit__", "self.cuda_graph.capture_end()"),
            ("torch/cuda/graphs.py", 133, "capture_end", "super().capture_end()"),
        ],
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {gpu} has a total capacity "
        f"of {capacity:.2f} GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has "
        f"{capacity - 1.06:.2f} GiB memory in use. Of the allocated memory {capacity - 3.64:.2f} GiB is allocated "
        "by PyTorch, with 2.31 GiB allocated in private pools (e.g., CUDA Graphs), and 1.27 GiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n"
        "Fail when using backend: breakable for prefill runner.\n"
        "Possible suggestions:\n"
        "1. disable the prefill CUDA graph by --cuda-graph-backend-prefill=disabled\n"
        "2. if it is an OOM problem, set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7) or set "
        "--cuda-graph-max-bs-prefill to a smaller value (e.g., 2048)\n"
        "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose ",
    )
    second = _scheduler_traceback(
        [
            _SCHEDULER_FRAME,
            (
                "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py",
                318,
                "capture",
                "with torch.cuda.graph(graph, pool=self.graph_pool):",
            ),
            ("torch/cuda/graphs.py", 256, "__exit__", "self.cuda_graph.capture_end()"),
            ("torch/cuda/graphs.py", 133, "capture_end", "super().capture_end()"),
        ],
        'RuntimeError: num_active_captures_ > 0 INTERNAL ASSERT FAILED at "/pytorch/c10/cuda/'
        'CUDACachingAllocator.cpp":2969, please report a bug to PyTorch. markCaptureEnd called with no captures '
        "in progress",
    )
    log.error(
        f"Scheduler hit an exception: {first}\n\nDuring handling of the above exception, another exception "
        f"occurred:\n\n{second}\n",
        tp=True,
    )
    log.error("Received sigquit from a child process. It usually means the child failed.")
    _kill_self()


def _kv_oom(sim: Sim) -> int:
    plan = sim.plan
    minimum = 1 - plan.avail_after / plan.avail_before if plan.avail_before > 0 else 1.0
    suggested = max(minimum, plan.fraction) if plan.rest > 0 else minimum  # a forced fault keeps it readable
    sim.log.error(
        "Scheduler hit an exception: "
        + _scheduler_traceback(
            [
                _SCHEDULER_FRAME,
                ("sglang/srt/managers/scheduler.py", 1090, "__init__", "self.tp_worker.alloc_memory_pool("),
                ("sglang/srt/managers/tp_worker.py", 409, "alloc_memory_pool", "self.model_runner.alloc_memory_pool("),
                (
                    "sglang/srt/model_executor/model_runner.py",
                    992,
                    "alloc_memory_pool",
                    "self.init_kv_cache_configurator(draft_parallel_layout)",
                ),
                ("sglang/srt/mem_cache/kv_cache_configurator.py", 3050, "profile_available_bytes", "raise ValueError("),
            ],
            f"ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static="
            f"{plan.fraction}. Raise --mem-fraction-static above {int(suggested * 1000 + 0.999) / 1000:.3f} "
            f"(minimum viable = 1 - available/pre = {minimum:.4f}). If using speculative decoding, draft weights are "
            "now counted.",
        )
        + "\n",
        tp=True,
    )
    sim.log.error("Received sigquit from a child process. It usually means the child failed.")
    return 1


def _fail(sim: Sim, frames: list[tuple[str, int, str, str]], last: str, code: int) -> int:
    sim.log.error("Scheduler hit an exception: " + _scheduler_traceback(frames, last) + "\n", tp=True)
    sim.log.error("Received sigquit from a child process. It usually means the child failed.")
    sim.recorder.record("exit", returncode=code, reason="startup failure")
    return code


def _flood(log: Log, megabytes: float) -> None:
    line = (
        f"[{time.strftime('%Y-%m-%d %H:%M:%S')} TP0] Decode batch. #running-req: 1, #token: 1024, token usage: "
        "0.00, cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 0, (simulated flood)\n"
    )
    block = line * (2**20 // len(line) + 1)
    total = int(megabytes * 2**20)
    for stream in (sys.stdout, sys.stderr):
        left = total
        while left > 0:
            piece = block[:left]
            log.write(piece, stream)
            left -= len(piece)


def _spawn_escaped_child(sim: Sim) -> None:
    import subprocess

    code = (
        "# sglang::scheduler_TP0 (pytest-sglworker sim: escaped scheduler)\n"
        "import os, time\n"
        f"deadline = time.monotonic() + {ESCAPED_CHILD_LIFETIME}\n"
        "while time.monotonic() < deadline:\n"
        "    time.sleep(min(5.0, max(deadline - time.monotonic(), 0.0)))\n"
    )
    env = dict(os.environ)
    env[ENV_ESCAPED] = "1"
    env["SGLSIM_PARENT_PID"] = str(os.getpid())
    # start_new_session: the child calls setsid() before exec, so it has left our process group by the
    # time Popen returns (no window in which a group kill would still reach it).
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,
    )
    sim.log.info(f"spawned scheduler pid={child.pid}")


def _wait_forever() -> NoReturn:
    while True:
        time.sleep(3600)


def _cuda_ordinal_error(plan: Plan) -> str | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible or plan.args["device"] != "cuda":
        return None
    count = len([d for d in visible.split(",") if d.strip()])
    needed = plan.args["base_gpu_id"] + plan.args["tp_size"]
    if needed <= count:
        return None
    return (
        f"torch.AcceleratorError: CUDA error: invalid device ordinal (--base-gpu-id={plan.args['base_gpu_id']} "
        f"--tp-size={plan.args['tp_size']} needs {needed} GPUs, CUDA_VISIBLE_DEVICES={visible!r} has {count})"
    )


def _startup(sim: Sim, pre_bind: float, warmup: float) -> SimHTTPServer:
    """Everything from the server-args line to readiness; returns the running server."""
    plan, log, faults = sim.plan, sim.log, sim.faults
    args = plan.args
    log.info(_server_args_line(plan))
    if args["disable_cuda_graph"]:
        log.warning(
            "'--disable-cuda-graph' is deprecated and will be removed in a future release. Use "
            "'--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled' instead."
        )
    if faults.escape_child:
        _spawn_escaped_child(sim)
    decode_on = plan.decode_backend != "disabled"
    prefill_on = plan.prefill_backend != "disabled" or faults.crash_oom
    graphs = int(decode_on) + int(prefill_on)
    t_load = pre_bind * (0.5 + (0.35 if graphs == 0 else 0.0))
    t_kv = pre_bind * 0.15
    t_graph = pre_bind * 0.35 / graphs if graphs else 0.0

    ordinal = _cuda_ordinal_error(plan)
    if ordinal:
        raise _StartupExit(
            _fail(
                sim,
                [_SCHEDULER_FRAME, ("torch/cuda/__init__.py", 567, "set_device", "torch._C._cuda_setDevice(device)")],
                ordinal,
                1,
            )
        )
    tic = time.perf_counter()
    log.info(f"Load weight begin. avail mem={plan.avail_before:.2f} GB", tp=True)
    if faults.flood_mb:
        _flood(log, faults.flood_mb)
    time.sleep(t_load)
    log.info(
        f"Load weight end. elapsed={time.perf_counter() - tic:.2f} s, type={plan.facts.architecture}, "
        f"avail mem={plan.avail_after:.2f} GB, mem usage={plan.weights:.2f} GB.",
        tp=True,
    )
    if faults.exit_code is not None:
        n = faults.exit_code
        raise _StartupExit(
            _fail(
                sim,
                [
                    _SCHEDULER_FRAME,
                    ("sglang/srt/managers/scheduler.py", 1090, "__init__", "self.tp_worker.alloc_memory_pool("),
                ],
                f"RuntimeError: simulated scheduler failure ({ENV_FAULT}=exit={n})",
                n,
            )
        )
    if faults.kv_oom or plan.rest <= 0:
        code = _kv_oom(sim)
        sim.recorder.record("exit", returncode=code, reason="kv_oom")
        raise _StartupExit(code)
    if args["kv_events_config"]:
        try:
            json.loads(args["kv_events_config"])
        except ValueError as exc:
            raise _StartupExit(_fail(sim, [_SCHEDULER_FRAME], f"json.decoder.JSONDecodeError: {exc}", 1)) from None
    if args["max_total_tokens"] is not None and args["max_total_tokens"] > plan.profiled_tokens:
        log.warning(
            f"max_total_tokens={args['max_total_tokens']} is larger than the profiled value "
            f"{plan.profiled_tokens}. Use the profiled value instead.",
            tp=True,
        )
    time.sleep(t_kv)
    half = plan.max_total_tokens * plan.kv_bytes_per_token / 2 / 2**30
    log.info(
        f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {plan.max_total_tokens}, "
        f"K size: {half:.2f} GB, V size: {half:.2f} GB",
        tp=True,
    )
    avail = plan.avail_after - 2 * half
    if args["enable_hierarchical_cache"]:
        log.info(
            f"Allocating {2 * half * args['hicache_ratio']:.2f} GB host memory for hierarchical KV cache.", tp=True
        )
    if decode_on:
        bs = decode_capture_sizes(plan.decode_max_bs)
        log.info(
            f"Capture target decode CUDA graph begin. backend={plan.decode_backend}, num_tokens_per_req=1, "
            f"avail mem={avail:.2f} GB",
            tp=True,
        )
        tic = time.perf_counter()
        time.sleep(t_graph)
        log.info(
            f"Capture target decode CUDA graph end. bs={bs}, elapsed={time.perf_counter() - tic:.2f} s, "
            f"mem usage=0.45 GB, avail mem={avail - 0.45:.2f} GB.",
            tp=True,
        )
        avail -= 0.45
    if prefill_on:
        backend = plan.prefill_backend if plan.prefill_backend != "disabled" else "breakable"
        log.info(
            f"Capture target prefill CUDA graph begin. backend={backend}, num_tokens={list(plan.prefill_buckets)}, "
            f"avail mem={avail:.2f} GB",
            tp=True,
        )
        tic = time.perf_counter()
        time.sleep(t_graph)
        if faults.crash_oom:
            _crash_oom(sim)
        log.info(
            f"Capture target prefill CUDA graph end. elapsed={time.perf_counter() - tic:.2f} s, "
            f"mem usage=1.12 GB, avail mem={avail - 1.12:.2f} GB.",
            tp=True,
        )
        avail -= 1.12
    log.info(
        f"max_total_num_tokens={plan.max_total_tokens}, chunked_prefill_size={plan.chunked_prefill_size}, "
        f"max_prefill_tokens={args['max_prefill_tokens']}, max_running_requests={plan.max_running_requests}, "
        f"context_len={plan.context_len}, available_gpu_mem={avail:.2f} GB",
        tp=True,
    )
    if faults.hang_before_bind:
        _wait_forever()

    host, port = args["host"], args["port"]
    server_cls = SimHTTPServer6 if ":" in host else SimHTTPServer
    try:
        server = server_cls((host, port), sim)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        log.uvicorn(
            "ERROR", f"[Errno {exc.errno}] error while attempting to bind on address {(host, port)!r}: {reason}"
        )
        # Like sglang 0.5.23: a failed uvicorn bind does not end the process; it waits for a shutdown
        # that never comes (seen with the real engine on the CPU) until it is signalled.
        log.uvicorn("INFO", "Waiting for application shutdown.")
        _wait_forever()
    sim.bound = True
    sim.server = server
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="sim-http", daemon=True).start()
    log.uvicorn("INFO", f"Started server process [{os.getpid()}]")
    log.uvicorn("INFO", "Waiting for application startup.")
    log.uvicorn("INFO", "Application startup complete.")
    shown = f"[{host}]" if ":" in host else host
    log.uvicorn("INFO", f"Uvicorn running on http://{shown}:{port} (Press CTRL+C to quit)")
    if faults.hang:
        _wait_forever()
    if not args["skip_server_warmup"]:
        time.sleep(warmup)
        sim.generate(WARMUP_PROMPT.split(), 8, [], False)
        sim.log.uvicorn("INFO", f'127.0.0.1:{40000 + os.getpid() % 20000} - "POST /generate HTTP/1.1" 200 OK')
    sim.ready = True
    log.info(READY_LINE)
    sim.recorder.record("ready", startup_seconds=round(time.time() - sim.recorder.started, 6))
    return server


class _StartupExit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _shutdown(sim: Sim, signum: int) -> int:
    sim.shutting_down = True
    server = sim.server
    log = sim.log
    log.warning(f"SIGTERM received. signum={signum} frame=None. Draining requests and shutting down...")
    deadline = time.monotonic() + 5.0
    while sim.running > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    log.info(f"Gracefully exiting... Remaining number of requests {sim.running}. Remaining requests remaining_rids=[].")
    if server is not None:
        log.uvicorn("INFO", "Shutting down")
        server.shutdown()
        server.server_close()
        log.uvicorn("INFO", "Waiting for application shutdown.")
        log.uvicorn("INFO", "Application shutdown complete.")
        log.uvicorn("INFO", f"Finished server process [{os.getpid()}]")
    sim.recorder.record("exit", returncode=0, reason=signal.Signals(signum).name)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the simulated server; returns the exit code (never returns on the SIGKILL faults)."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        faults = parse_faults(os.environ.get(ENV_FAULT, ""))
        startup = _env_float(ENV_STARTUP, 0.3) or 0.0
        warmup_env = _env_float(ENV_WARMUP, None)
        total_gib = _env_float(ENV_GPU_MEM, 80.0) or 80.0
        token_seconds = _env_float(ENV_TOKEN, 0.0) or 0.0
    except FaultError as exc:
        sys.stderr.write(f"sglang serve (sim): error: {exc}\n")
        return 2
    plan = make_plan(ns, total_gib)
    log = Log(ns.log_level, plan.args["log_level_http"])
    recorder = Recorder(os.environ.get(ENV_RECORD) or None, plan)
    sim = Sim(plan, faults, log, recorder, token_seconds)
    pre_bind = startup * 0.7
    warmup = warmup_env if warmup_env is not None else startup * 0.3

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous: dict[signal.Signals, Any] = {}
    if in_main_thread:

        def on_signal(signum: int, frame: object) -> None:
            if sim.shutting_down:
                return
            sim.shutting_down = True
            raise _Shutdown(signum)

        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, signal.SIG_IGN if faults.ignore_sigterm else on_signal)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_signal)

    recorder.record("start")
    try:
        try:
            _startup(sim, pre_bind, warmup)
            _wait_forever()
        except _StartupExit as exc:
            return exc.code
    except _Shutdown as stop:
        return _shutdown(sim, int(stop.args[0]) if stop.args else int(signal.SIGTERM))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
