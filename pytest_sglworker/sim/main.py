"""A simulated sglang engine: a CPU-only stand-in for ``python -m sglang.launch_server``.

Run as ``python -m pytest_sglworker.sim <sglang argv>``. It is a real subprocess serving real HTTP on
the given host and port, with sglang 0.5.23's flags, startup log lines, endpoints, request checks and
response shapes (the facts in :mod:`sglang_facts`; the shapes checked against the real engine by
``tests/sim/test_sim_differential.py``), deterministic text (the prompt's tokens echoed) and logprobs, and
injectable faults. Stdlib only at import (``tokenizers`` is used when it is importable and the model is a
directory with a ``tokenizer.json``), so that it starts in a few tens of milliseconds. The pieces:
:mod:`sim_core` (log), :mod:`sim_faults` (faults), :mod:`sim_tokens` (tokenizer, generations, logprobs, embeddings),
:mod:`sim_http` (endpoints), :mod:`sim_pd` (prefill/decode disaggregation).

Startup, as the real engine does it: the server-args line, ``Init parallel``, ``Memory baseline taken``,
``Load weight begin/end``, ``KV Cache is allocated``, ``Memory pool end``, the decode and prefill CUDA-graph
captures with their progress bars (unless their backend is ``disabled``), ``max_total_num_tokens=...``; only
then is the port bound (``Uvicorn running on ...``); ``/health`` answers 503 until the warmup is over (``The
server is fired up and ready to roll!``), 200 after. With ``--tp-size 1`` lines carry no rank; with tp > 1
the per-rank lines repeat as ``[ts TPk]``.

Environment:

- ``SGLSIM_STARTUP_SECONDS`` (float, default 0.3): total simulated startup; 70 % before binding (weights,
  KV pool, graph captures), 30 % warmup after binding.
- ``SGLSIM_WARMUP_SECONDS`` (float): overrides the warmup part (the part before binding stays 70 % of
  the total). ``--skip-server-warmup`` makes the server ready at once after binding.
- ``SGLSIM_GPU_MEM_GIB`` (float, default 80): the declared card size, for the memory arithmetic.
- ``SGLSIM_GPU_FREE_MIB`` (integer MiB, default 98.125 % of the card): the memory free when the weights
  load (sglang's ``pre_model_load_memory``, the ``Load weight begin. avail mem=`` figure). With it, the KV
  pool's ``#tokens`` is exactly :func:`pytest_sglworker.engine.ledger.predict_memory`'s ``kv_tokens`` for the same
  card, argv and ``gpu_free_mib``.
- ``SGLSIM_TOKEN_SECONDS`` (float, default 0): time to generate one token.
- ``SGLSIM_PD_WAIT_SECONDS`` (float, default 15): how long a PD side waits for its peer (sglang's decode
  side retries 15 times a second apart) before it aborts the request with sglang's 500.
- ``SGLSIM_RECORD`` (path): append one JSON line per event (``start``, ``ready``, ``exit``), each with a
  single ``O_APPEND`` write.
- ``SGLSIM_FAULT``: comma-separated faults (the records of :mod:`sim_faults`); ``python -m
  pytest_sglworker.sim --help`` lists them all. An
  unknown fault or a value out of range exits 2 with one line naming it and listing the known ones (on
  stderr and in the log). Startup faults: ``crash_oom``, ``kv_oom``, ``exit=N``, ``hang``,
  ``hang_before_bind``, ``flood=MB``, ``ignore_sigterm``, ``escape_child``. Request faults (also
  switchable at run time): ``die_after=N``, ``slow_health=S``, ``fail_first=N``, ``fail_rate=P``,
  ``fail_seed=N``, ``status=CODE``, ``latency=S``, ``hang_request=N``, ``hang_requests``,
  ``health_fail_after=S``, ``health_fail``, ``api_key=KEY``, ``max_payload=N``, ``trickle=S``.

  - ``crash_oom``: CUDA OOM in the prefill-graph capture (forced even when the prefill graph is disabled,
    so that it works with the budget flags): the capture bar stops at the failing bucket, the
    breakable-graph context's own error record (the ``num_active_captures_`` assertion, ``Fail when using
    backend: breakable for prefill runner.``), then the scheduler's chained traceback (OOM first), then
    ``Received sigquit ...`` and ``kill_process_tree called: ...``, then SIGKILL of itself (returncode -9).
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
    the OpenAI endpoints, ``/encode``, ``/v1/score``; health and info probes do not count).
  - ``slow_health=SECONDS``: every ``/health`` and ``/health_generate`` answer is delayed.

Control endpoint (exempt from the API key and from the faults themselves): ``GET /_sim/faults`` answers the
request faults in force, the counters since they were set and the worker's identity; ``POST /_sim/faults``
with ``{"fail_first": 2, "latency": 0.1}`` (``null`` clears one), ``{"spec": "fail_first=2,latency=0.1"}``
or ``{"reset": true, ...}`` (clear all first) changes them at once and restarts their counters; a bad body
answers 400 with the one-line error. Every response carries ``X-SGLSim-Worker: <port>/<pid>``.

Also like the real engine: ``--api-key`` is checked on everything but ``/health*``, ``/ready*`` and
``/metrics*``; SIGTERM/SIGINT drain in-flight requests (``/health`` answers 503 meanwhile) and exit 0; a
``CUDA_VISIBLE_DEVICES`` with fewer devices than ``--base-gpu-id + --tp-size`` fails the startup (exit 1);
the router's HTTP/2 probe (``PRI * HTTP/2.0``) gets uvicorn's 404 and 400; PD disaggregation
(``--disaggregation-mode prefill|decode``) serves sglang's bootstrap server and handshake (:mod:`sim_pd`).

Memory arithmetic: :func:`pytest_sglworker.engine.ledger.predict_memory` (sglang's ``memory_hook`` and KV
configurator: the automatic ``--mem-fraction-static``, ``rest = free_after_weights - free * (1 -
fraction)``, ``#tokens = rest // kv_bytes_per_token`` rounded down to ``--page-size``, capped by
``--max-total-tokens``; ``rest <= 0`` fails like 0.5.23, "Loaded weights leave no GPU memory for the KV
cache"), over the model's dims (the built-in table, or the ``config.json`` of a model directory).

Why one module of this size: it is the simulated engine's startup, in the order sglang prints it (parser, plan,
weights, KV pool, capture, bind, warmup, shutdown), and each fault interrupts that one sequence at its own step;
the request surface lives in :mod:`sim_http` and :mod:`sim_grpc`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ..engine.sglang_facts import (
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
from .core import (
    CONTROL_PATH,
    ENV_ESCAPED,
    ENV_FAULT,
    ENV_GPU_FREE,
    ENV_GPU_MEM,
    ENV_PD_WAIT,
    ENV_RECORD,
    ENV_STARTUP,
    ENV_TOKEN,
    ENV_WARMUP,
    WORKER_HEADER,
    Log,
    Plan,
    Recorder,
)
from .faults import (
    REQUEST_FAULTS,
    STARTUP_FAULTS,
    FaultError,
    Faults,
    FaultState,
    RequestFaults,
    fault_help,
    parse_fault_spec,
    parse_faults,
)
from .http_server import SITE, VERSION, Sim, SimHTTPServer, SimHTTPServer6, _Shutdown, kill_self
from .tokens import NATURAL_TOKENS, load_model_dir

__all__ = [
    "ENV_ESCAPED", "ENV_FAULT", "ENV_GPU_FREE", "ENV_GPU_MEM", "ENV_PD_WAIT", "ENV_RECORD", "ENV_STARTUP",
    "ENV_TOKEN", "ENV_WARMUP", "NATURAL_TOKENS", "REQUEST_FAULTS", "STARTUP_FAULTS", "VERSION", "FaultError",
    "Faults", "Plan", "RequestFaults",
    "build_parser", "load_model_dir", "main", "make_plan", "model_facts", "parse_fault_spec", "parse_faults",
]

#: Seconds after which an ``escape_child`` child exits by itself, so that no test leaves it forever.
ESCAPED_CHILD_LIFETIME = 600.0
#: The prefill capture goes from the largest bucket down; the seed failure ran out of memory at the 26th.
_OOM_BUCKET = 26


# ---------------------------------------------------------------------------------------------- models


def model_facts(model_path: str) -> ModelDims:
    """The dims of a model directory (its ``config.json``), of a known model (matched on its name), else
    those of Qwen3-0.6B."""
    if os.path.isfile(os.path.join(model_path, "config.json")):
        from ..engine.ledger import model_dims

        dims = model_dims(model_path)
        if dims is not None:
            return dims
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

_EPILOG = f"""\
pytest-sglworker's simulated sglang engine: sglang 0.5.23's flags (above), endpoints and log lines.

environment:
  {ENV_STARTUP}=S     total simulated startup (default 0.3; 70 % before binding)
  {ENV_WARMUP}=S      the warmup part after binding (default 30 % of the startup)
  {ENV_GPU_MEM}=GIB        the card size (default 80)
  {ENV_GPU_FREE}=MIB       memory free when the weights load (default 98.125 % of the card)
  {ENV_TOKEN}=S       time per generated token (default 0)
  {ENV_PD_WAIT}=S     how long a PD side waits for its peer (default 15)
  {ENV_RECORD}=PATH          append start/ready/exit events as JSON lines
  {ENV_FAULT}=F1,F2=V,...     faults, below

{{faults}}

control endpoint (exempt from the API key and the faults):
  GET  {CONTROL_PATH}   the request faults in force, counters since they were set, the worker
  POST {CONTROL_PATH}   {{"fail_first": 2, "latency": 0.1}}, {{"spec": "fail_first=2"}}, {{"reset": true}};
                      null clears one fault; a bad body answers 400 with the error
every response carries {WORKER_HEADER}: <port>/<pid>.
"""


def build_parser() -> argparse.ArgumentParser:
    """sglang 0.5.23's ``ServerArgs.add_cli_args``, rebuilt from the flag table of :mod:`sglang_facts`: every
    flag the real parser accepts (abbreviations too), with its choices and defaults, so that the simulated
    engine accepts and rejects exactly what the real one does. The epilog documents the sim's own knobs."""
    p = argparse.ArgumentParser(prog=PARSER_PROG, allow_abbrev=True, epilog=_EPILOG.replace("{faults}", fault_help()),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
            # the table keeps choices as text; a typed flag (--log-requests-level: int) compares converted values
            convert = kwargs["type"]
            try:
                kwargs["choices"] = [convert(c) for c in flag.choices] if flag.type in _TYPES else flag.choices
            except (ValueError, argparse.ArgumentTypeError):
                kwargs["choices"] = flag.choices
        p.add_argument(*longs, **kwargs)
    return p


# ---------------------------------------------------------------------------------------------- environment


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise FaultError(f"{name}: expected a number of seconds/GiB, got {raw!r}") from None
    if value < 0 or value != value:
        raise FaultError(f"{name}: expected a non-negative number, got {raw!r}")
    return value


def _env_mib(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise FaultError(f"{name}: expected a whole number of MiB, got {raw!r}") from None
    if value < 0:
        raise FaultError(f"{name}: expected a non-negative number of MiB, got {raw!r}")
    return value


# ---------------------------------------------------------------------------------------------- config


def _backends(ns: argparse.Namespace) -> tuple[str, str]:
    decode_backend = ns.cuda_graph_backend_decode or "full"
    prefill_backend = ns.cuda_graph_backend_prefill or "breakable"
    if getattr(ns, "disable_prefill_cuda_graph", False):
        prefill_backend = "disabled"
    if getattr(ns, "disable_decode_cuda_graph", False):
        decode_backend = "disabled"
    if ns.disable_cuda_graph or (ns.device or "cuda") == "cpu":
        decode_backend = prefill_backend = "disabled"
    return decode_backend, prefill_backend


def make_plan(ns: argparse.Namespace, total_gib: float, *, free_mib: int | None = None,
              argv: list[str] | None = None) -> Plan:
    """Resolve defaults and do the engine's memory arithmetic (see the module docstring). ``free_mib``: the
    memory free when the weights load (default 98.125 % of the card); ``argv``: the command line ``ns``
    came from (for the ledger; rebuilt from ``ns`` when not given)."""
    args = dict(vars(ns))
    facts = model_facts(ns.model_path)
    tp = max(int(ns.tp_size), 1)
    mode = ns.disaggregation_mode or "null"
    decode_backend, prefill_backend = _backends(ns)
    total_mib = round(total_gib * 1024)
    free = free_mib if free_mib is not None else int(total_mib * 0.98125)
    default_chunked, decode_max_bs = card_defaults(total_mib, tp)
    if ns.cuda_graph_max_bs_decode is not None:
        decode_max_bs = ns.cuda_graph_max_bs_decode
    elif ns.max_running_requests is not None:
        decode_max_bs = min(decode_max_bs, ns.max_running_requests)
    chunked = ns.chunked_prefill_size if ns.chunked_prefill_size is not None else default_chunked
    prefill_max_bs = ns.cuda_graph_max_bs_prefill or (chunked if chunked > 0 else ns.max_prefill_tokens)
    if ns.cuda_graph_max_bs_prefill is None and ns.max_total_tokens is not None:
        prefill_max_bs = min(prefill_max_bs, ns.max_total_tokens)
    buckets = prefill_capture_sizes(prefill_max_bs)
    page_size = max(ns.page_size or 1, 1)
    kv_bytes = facts.kv_bytes_per_token(tp)
    weights_mib = facts.weights_mib(tp)
    ledger = None
    if argv is not None:
        from ..engine.ledger import predict_memory

        try:
            ledger = predict_memory(facts, total_mib, gpu_free_mib=free, argv=argv, tp=tp)
        except ValueError:  # a value the engine would refuse some other way: the sim's own arithmetic
            ledger = None
    if ledger is not None:
        fraction = ledger.mem_fraction_static
        weights_mib = ledger.weights_mib
        kv_bytes = ledger.kv_bytes_per_token
        profiled, tokens = ledger.kv_tokens_profiled, ledger.kv_tokens
    else:
        if ns.mem_fraction_static is not None:
            fraction = float(ns.mem_fraction_static)
        else:
            activation = activation_reserve_mib(activation_tokens(
                mode=mode, chunked_prefill_size=chunked, max_prefill_tokens=ns.max_prefill_tokens,
                max_running_requests=ns.max_running_requests, decode_max_bs=decode_max_bs,
                speculative_num_draft_tokens=ns.speculative_num_draft_tokens), tp, ns.pp_size or 1)
            graphs = graph_reserve_mib(mode=mode, decode_backend=decode_backend, decode_max_bs=decode_max_bs,
                                       prefill_backend=prefill_backend, prefill_buckets=len(buckets))
            fraction = automatic_fraction(total_mib, total_reserve_mib(total_mib, activation, graphs))
        profiled, tokens = kv_pool_tokens(free, free - weights_mib, fraction, kv_bytes, page_size=page_size,
                                          max_total_tokens=ns.max_total_tokens)
    avail_before = free / 1024
    weights = weights_mib / 1024
    avail_after = avail_before - weights
    rest = avail_after - avail_before * (1 - fraction)
    model = load_model_dir(ns.model_path, vocab_size=facts.vocab_size or 32_000,
                           eos_token_id=facts.eos_token_id)
    context_len = ns.context_length or model.context_len or facts.context_len
    max_running = ns.max_running_requests or max(min(4096, tokens // 2), 1)
    served = ns.served_model_name or ns.model_path
    args.update(
        tokenizer_path=ns.tokenizer_path or ns.model_path,
        served_model_name=served,
        mem_fraction_static=fraction,
        chunked_prefill_size=chunked,
        page_size=page_size,
        cuda_graph_backend_decode=decode_backend,
        cuda_graph_backend_prefill=prefill_backend,
        device=ns.device or "cuda",
        hicache_ratio=ns.hicache_ratio if ns.hicache_ratio is not None else 2.0,
        random_seed=ns.random_seed if ns.random_seed is not None else 42,
        disaggregation_mode=mode,
        _argv=list(argv or []),
    )
    return Plan(
        args=args,
        facts=facts,
        served_model_name=served,
        total_gib=total_mib / 1024,
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
        model=model,
        mode=mode,
        free_mib=float(free),
        hidden_size=model.hidden_size or facts.hidden_size or 64,
        is_embedding=bool(ns.is_embedding),
    )


# ---------------------------------------------------------------------------------------------- startup logs


def _server_args_line(plan: Plan) -> str:
    # 0.5.23 logs the resolved arguments as a dict (older versions: ServerArgs(...)).
    shown = {k: v for k, v in plan.args.items() if not k.startswith("_argv")}
    return f"server_args={shown!r}"


def _scheduler_traceback(frames: list[tuple[str, int, str, str]], last: str) -> str:
    lines = ["Traceback (most recent call last):"]
    lines += [f'  File "{SITE}/{path}", line {line}, in {func}\n    {code}' for path, line, func, code in frames]
    lines.append(last)
    return "\n".join(lines)


_SCHEDULER_FRAME = ("sglang/srt/managers/scheduler.py", 6362, "run_scheduler_process",
                    "scheduler = Scheduler(server_args, port_args)")
_INIT_FRAME = ("sglang/srt/managers/scheduler.py", 568, "__init__", "self.init_model_worker()")
_SIGQUIT = "Received sigquit from a child process. It usually means the child failed."


def _kill_tree_line(log: Log) -> None:
    pid = os.getpid()
    log.info(f"kill_process_tree called: parent_pid={pid}, include_parent=True, pid={pid}")


def _bar(what: str, key: str, size: int, mem: float, done: int, total: int) -> str:
    pct = int(100 * done / total) if total else 100
    filled = "█" * (10 * done // total if total else 10)
    return (f"Capturing {what} ({key}={size} avail_mem={mem:.2f} GB): {pct:3d}%|{filled:<10}| {done}/{total} "
            f"[00:00<00:00, 2.01s/it]")


def _capture_bars(log: Log, what: str, key: str, sizes: list[int], mem: float, upto: int | None = None,
                  step: float = 0.01) -> float:
    """tqdm's bar over ``sizes`` (largest first), rank 0 only; stops *at* index ``upto`` when given (the
    bucket being captured when it failed). Returns the memory left."""
    total = len(sizes)
    parts = []
    for done, size in enumerate(sizes):
        parts.append(_bar(what, key, size, mem, done, total))
        if upto is not None and done == upto:
            log.write("\r".join(parts) + "\r")
            return mem
        mem -= step
    parts.append(_bar(what, key, sizes[-1] if sizes else 0, mem, total, total))
    log.write("\r".join(parts) + "\n")
    return mem


_PREFILL_FRAMES = [
    _SCHEDULER_FRAME,
    _INIT_FRAME,
    ("sglang/srt/managers/scheduler.py", 1146, "init_model_worker", "self.init_all_cuda_graphs()"),
    ("sglang/srt/managers/scheduler.py", 1124, "init_all_cuda_graphs", "self.tp_worker.init_cuda_graphs()"),
    ("sglang/srt/managers/tp_worker.py", 435, "init_cuda_graphs", "self.model_runner.init_cuda_graphs("),
    ("sglang/srt/model_executor/model_runner.py", 1192, "init_cuda_graphs", "capture = capture_cuda_graphs("),
    ("sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py", 424, "capture_cuda_graphs",
     "prefill = capture_prefill_graph("),
    ("sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py", 690, "capture_prefill_graph",
     "prefill_runner = PrefillCudaGraphRunner(model_runner)"),
    ("sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", 700, "__init__", "self.capture()"),
    ("sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", 1700, "capture", "self._capture_one_stream()"),
    ("sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", 1736, "_capture_one_stream",
     "self.capture_one_shape(num_tokens)"),
    ("sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", 1832, "capture_one_shape",
     "self.backend.capture_one("),
]
_BREAKABLE = "sglang/srt/model_executor/runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py"
_ASSERT = ('RuntimeError: num_active_captures_ > 0 INTERNAL ASSERT FAILED at "/pytorch/c10/cuda/'
           'CUDACachingAllocator.cpp":2969, please report a bug to PyTorch. markCaptureEnd called with no captures '
           "in progress")


def _crash_oom(sim: Sim, sizes: list[int], avail: float) -> NoReturn:
    """The seed failure of sglang 0.5.23 (tests/data/logs/seed_prefill_capture_oom.log)."""
    log = sim.log
    upto = min(_OOM_BUCKET - 1, len(sizes) - 1)
    _capture_bars(log, "prefill shape", "num_tokens", sizes, avail, upto=upto, step=avail / max(len(sizes), 1) / 2)
    log.error(
        f"{_ASSERT}\nFail when using backend: breakable for prefill runner.\nPossible suggestions:\n"
        "1. disable the prefill CUDA graph by --cuda-graph-backend-prefill=disabled\n"
        "2. if it is an OOM problem, set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7) or set "
        "--cuda-graph-max-bs-prefill to a smaller value (e.g., 2048)\n"
        "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose \n",
        tp=True,
    )
    first = _scheduler_traceback(
        [
            *_PREFILL_FRAMES,
            ("sglang/srt/model_executor/runner_backend/breakable_cuda_graph_backend.py", 164, "capture_one",
             "out = forward_fn()"),
            ("sglang/srt/layers/radix_attention.py", 172, "forward", "self._eager_attention("),
            (_BREAKABLE, 278, "wrapper", "capture._end_current_segment()"),
            (_BREAKABLE, 453, "_end_current_segment", "graph.capture_end()"),
            ("torch/cuda/graphs.py", 169, "capture_end", "super().capture_end()"),
        ],
        "torch.AcceleratorError: CUDA error: out of memory\n"
        "Search for `cudaErrorMemoryAllocation' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
        "group__cudart__types.html for more information.\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might "
        "be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    )
    second = _scheduler_traceback(
        [
            *_PREFILL_FRAMES,
            ("sglang/srt/model_executor/runner_backend/breakable_cuda_graph_backend.py", 142, "capture_one",
             "with ("),
            (_BREAKABLE, 401, "__exit__", "self._end_current_segment()"),
            (_BREAKABLE, 453, "_end_current_segment", "graph.capture_end()"),
            ("torch/cuda/graphs.py", 169, "capture_end", "super().capture_end()"),
        ],
        _ASSERT,
    )
    log.error(
        f"Scheduler hit an exception: {first}\n\nDuring handling of the above exception, another exception "
        f"occurred:\n\n{second}\n",
        tp=True,
    )
    log.error(_SIGQUIT)
    _kill_tree_line(log)
    kill_self()


def _kv_oom(sim: Sim) -> int:
    plan = sim.plan
    minimum = 1 - plan.avail_after / plan.avail_before if plan.avail_before > 0 else 1.0
    suggested = int(minimum * 1000 + 0.999999) / 1000
    sim.log.error(
        "Scheduler hit an exception: "
        + _scheduler_traceback(
            [
                _SCHEDULER_FRAME,
                _INIT_FRAME,
                ("sglang/srt/managers/scheduler.py", 1137, "init_model_worker", "self.init_memory_pools()"),
                ("sglang/srt/managers/scheduler.py", 1100, "init_memory_pools", "self.init_target_memory_pool()"),
                ("sglang/srt/managers/scheduler.py", 1090, "init_target_memory_pool",
                 "self.tp_worker.alloc_memory_pool("),
                ("sglang/srt/managers/tp_worker.py", 409, "alloc_memory_pool", "self.model_runner.alloc_memory_pool("),
                ("sglang/srt/model_executor/model_runner.py", 982, "alloc_memory_pool",
                 "result = self.kv_cache_configurator.configure("),
                ("sglang/srt/mem_cache/kv_cache_configurator.py", 476, "configure",
                 "config = self._resolve_memory_pool_config(pre_model_load_memory)"),
                ("sglang/srt/mem_cache/kv_cache_configurator.py", 3182, "_resolve_memory_pool_config",
                 "available_bytes = self._profile_available_bytes(pre_model_load_memory)"),
                ("sglang/srt/mem_cache/kv_cache_configurator.py", 3050, "_profile_available_bytes",
                 "raise ValueError("),
            ],
            f"ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static="
            f"{plan.fraction}. Raise --mem-fraction-static above {suggested:.3f} "
            f"(minimum viable = 1 - available/pre = {minimum:.4f}). If using speculative decoding, draft weights are "
            "now counted.",
        )
        + "\n",
        tp=True,
    )
    sim.log.error(_SIGQUIT)
    _kill_tree_line(sim.log)
    return 1


def _fail(sim: Sim, frames: list[tuple[str, int, str, str]], last: str, code: int) -> int:
    sim.log.error("Scheduler hit an exception: " + _scheduler_traceback(frames, last) + "\n", tp=True)
    sim.log.error(_SIGQUIT)
    _kill_tree_line(sim.log)
    sim.recorder.record("exit", returncode=code, reason="startup failure")
    return code


def _flood(log: Log, megabytes: float) -> None:
    line = (
        f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Decode batch. #running-req: 1, #token: 1024, token usage: "
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


def _start_bootstrap(sim: Sim) -> None:
    """The prefill side's KV bootstrap server (started before the weights load, as sglang does)."""
    from . import pd as sim_pd

    plan = sim.plan
    args = plan.args
    tp = max(int(args["tp_size"]), 1)
    info = {
        "attn_tp_size": tp, "attn_cp_size": 1, "dp_size": max(int(args.get("dp_size") or 1), 1),
        "pp_size": max(int(args.get("pp_size") or 1), 1), "page_size": plan.page_size,
        "kv_cache_dtype": "bfloat16" if (args.get("kv_cache_dtype") or "auto") == "auto" else args["kv_cache_dtype"],
        "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
        "prefill_http_port": args["port"], "decode_allocation_policy": "early",
    }
    state = sim_pd.BootstrapState(info, expected=tp * info["dp_size"] * info["pp_size"])
    sim.bootstrap = state
    port = int(args.get("disaggregation_bootstrap_port") or 8998)
    sim_pd.start_bootstrap(args["host"], port, state, sim.log)


def _register_ranks(sim: Sim) -> None:
    """Each prefill rank registers with the bootstrap server once its KV pool exists (``PUT /route``)."""
    if sim.bootstrap is None:
        return
    host = sim.plan.args["host"]
    for rank in range(max(int(sim.plan.args["tp_size"]), 1)):
        sim.bootstrap.register({"attn_tp_rank": rank, "attn_cp_rank": 0, "attn_dp_rank": 0, "system_dp_rank": 0,
                                "pp_rank": 0, "rank_ip": host, "rank_port": 17000 + os.getpid() % 20000 + rank})


def _startup(sim: Sim, pre_bind: float, warmup: float) -> SimHTTPServer | None:
    """Everything from the server-args line to readiness; returns the running HTTP server (None in
    ``--grpc-mode``: the gRPC server is ``sim.grpc``)."""
    plan, log, faults = sim.plan, sim.log, sim.faults
    args = plan.args
    timings: dict[str, Any] = {}
    log.info(_server_args_line(plan))
    if args["disable_cuda_graph"]:
        log.warning(
            "'--disable-cuda-graph' is deprecated and will be removed in a future release. Use "
            "'--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled' instead."
        )
    if faults.escape_child:
        _spawn_escaped_child(sim)
    if plan.mode == "prefill":
        _start_bootstrap(sim)
    decode_on = plan.decode_backend != "disabled" and plan.mode != "prefill"
    prefill_on = (plan.prefill_backend != "disabled" and plan.mode != "decode") or faults.crash_oom
    graphs = int(decode_on) + int(prefill_on)
    t_load = pre_bind * (0.5 + (0.35 if graphs == 0 else 0.0))
    t_kv = pre_bind * 0.15
    t_graph = pre_bind * 0.35 / graphs if graphs else 0.0

    log.info("Init parallel begin.", tp=True)
    ordinal = _cuda_ordinal_error(plan)
    if ordinal:
        raise _StartupExit(_fail(sim, [_SCHEDULER_FRAME, _INIT_FRAME,
                                       ("torch/cuda/__init__.py", 567, "set_device",
                                        "torch._C._cuda_setDevice(device)")], ordinal, 1))
    log.info("Init parallel ends. elapsed=0.03 s", tp=True)
    log.info(f"Memory baseline taken. mem usage={(plan.total_gib * 1024 - plan.free_mib) / 1024:.2f} GB", tp=True)
    tic = time.perf_counter()
    log.info(f"Load weight begin. avail mem={plan.avail_before:.2f} GB", tp=True)
    if faults.flood_mb:
        _flood(log, faults.flood_mb)
    time.sleep(t_load)
    timings["load_weight"] = round(time.perf_counter() - tic, 6)
    log.info(
        f"Load weight end. elapsed={time.perf_counter() - tic:.2f} s, type={plan.model.architecture or plan.facts.architecture}, "  # noqa: E501
        f"avail mem={plan.avail_after:.2f} GB, mem usage={plan.weights:.2f} GB.",
        tp=True,
    )
    if faults.exit_code is not None:
        n = faults.exit_code
        raise _StartupExit(_fail(sim, [_SCHEDULER_FRAME, _INIT_FRAME,
                                       ("sglang/srt/managers/scheduler.py", 1090, "init_target_memory_pool",
                                        "self.tp_worker.alloc_memory_pool(")],
                                 f"RuntimeError: simulated scheduler failure ({ENV_FAULT}=exit={n})", n))
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
    tic = time.perf_counter()
    time.sleep(t_kv)
    half = plan.max_total_tokens * plan.kv_bytes_per_token / 2 / 2**30
    log.info(
        f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {plan.max_total_tokens}, "
        f"K size: {half:.2f} GB, V size: {half:.2f} GB",
        tp=True,
    )
    avail = plan.avail_after - 2 * half
    log.info(f"Memory pool end. avail mem={avail:.2f} GB", tp=True)
    timings["kv_cache_allocation"] = round(time.perf_counter() - tic, 6)
    _register_ranks(sim)
    if args["enable_hierarchical_cache"]:
        log.info(
            f"Allocating {2 * half * args['hicache_ratio']:.2f} GB host memory for hierarchical KV cache.", tp=True
        )
    graph_times = {"prefill": 0.0, "decode": 0.0, "target_verify": 0.0, "draft_prefill": 0.0, "draft_decode": 0.0,
                   "draft_extend": 0.0}
    if decode_on:
        bs = decode_capture_sizes(plan.decode_max_bs)
        log.info(
            f"Capture target decode CUDA graph begin. backend={plan.decode_backend}, num_tokens_per_req=1, "
            f"avail mem={avail:.2f} GB",
            tp=True,
        )
        tic = time.perf_counter()
        _capture_bars(log, "batches", "bs", sorted(bs, reverse=True), avail - 0.02)
        time.sleep(t_graph)
        graph_times["decode"] = round(time.perf_counter() - tic, 6)
        log.info(
            f"Capture target decode CUDA graph end. bs={bs}, elapsed={time.perf_counter() - tic:.2f} s, "
            f"mem usage=0.45 GB, avail mem={avail - 0.45:.2f} GB.",
            tp=True,
        )
        avail -= 0.45
    elif plan.mode != "prefill":
        log.rank0("Disable decode CUDA graph because cuda_graph_config resolved decode.backend='disabled' (e.g. via "
                  "--cuda-graph-backend-decode=disabled or auto-disable rules).")
    if prefill_on:
        backend = plan.prefill_backend if plan.prefill_backend != "disabled" else "breakable"
        buckets = list(plan.prefill_buckets) or prefill_capture_sizes(8192)
        log.info(
            f"Capture target prefill CUDA graph begin. backend={backend}, num_tokens={buckets}, "
            f"avail mem={avail:.2f} GB",
            tp=True,
        )
        tic = time.perf_counter()
        sizes = sorted(buckets, reverse=True)
        if faults.crash_oom:
            time.sleep(t_graph)
            _crash_oom(sim, sizes, avail - 0.14)
        _capture_bars(log, "prefill shape", "num_tokens", sizes, avail - 0.14)
        time.sleep(t_graph)
        graph_times["prefill"] = round(time.perf_counter() - tic, 6)
        log.info(
            f"Capture target prefill CUDA graph end. elapsed={time.perf_counter() - tic:.2f} s, "
            f"mem usage=1.12 GB, avail mem={avail - 1.12:.2f} GB.",
            tp=True,
        )
        avail -= 1.12
    elif plan.mode != "decode":
        log.rank0("Disable prefill CUDA graph because cuda_graph_config resolved prefill.backend='disabled' (e.g. "
                  "via --cuda-graph-backend-prefill=disabled or auto-disable rules).")
    log.rank0(
        f"max_total_num_tokens={plan.max_total_tokens}, chunked_prefill_size={plan.chunked_prefill_size}, "
        f"max_prefill_tokens={args['max_prefill_tokens']}, max_running_requests={plan.max_running_requests}, "
        f"context_len={plan.context_len}, available_gpu_mem={avail:.2f} GB"
    )
    timings["scheduler_e2e"] = round(time.time() - sim.recorder.started, 6)
    timings["cuda_graph"] = graph_times
    timings["tokenizer_e2e"] = timings["scheduler_e2e"]
    sim.startup_timings = timings
    log.info("Engine startup timings (s): " + ", ".join(
        f"{k}={v:.2f}" if not isinstance(v, dict) else f"{k}={{" + ", ".join(f"{a}={b:.2f}" for a, b in v.items())
        + "}" for k, v in timings.items()))
    if faults.hang_before_bind:
        _wait_forever()
    if args["grpc_mode"] or args["smg_grpc_mode"]:
        from . import grpc_server as sim_grpc

        served = sim_grpc.serve(sim, warmup)
        if isinstance(served, int):
            raise _StartupExit(served)
        log.info(READY_LINE)
        sim.recorder.record("ready", startup_seconds=round(time.time() - sim.recorder.started, 6))
        return None

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
        if plan.is_embedding:
            sim.vocab.encode(WARMUP_PROMPT)
            route = "/encode"
        else:
            sim.generate(sim.vocab.encode(WARMUP_PROMPT), None, 8, [], False)
            route = "/generate"
        sim.log.uvicorn("INFO", f'127.0.0.1:{40000 + os.getpid() % 20000} - "POST {route} HTTP/1.1" 200 OK')
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
    if sim.grpc is not None:
        log.info("Received shutdown signal")
        sim.grpc.stop()
    if server is not None:
        log.uvicorn("INFO", "Shutting down")
        server.shutdown()
        server.server_close()
        log.uvicorn("INFO", "Waiting for application shutdown.")
        log.uvicorn("INFO", "Application shutdown complete.")
        log.uvicorn("INFO", f"Finished server process [{os.getpid()}]")
    sim.recorder.record("exit", returncode=0, reason=signal.Signals(signum).name)
    return 0


def _config_error(message: str) -> int:
    """A bad ``SGLSIM_*`` value: one line on stderr (argparse-like) and the same as a log record."""
    sys.stderr.write(f"sglang serve (sim): error: {message}\n")
    sys.stderr.flush()
    try:
        sys.stdout.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] sglang serve (sim): error: {message}\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the simulated server; returns the exit code (never returns on the SIGKILL faults)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        faults, request_faults = parse_fault_spec(os.environ.get(ENV_FAULT, ""))
        startup = _env_float(ENV_STARTUP, 0.3) or 0.0
        warmup_env = _env_float(ENV_WARMUP, None)
        total_gib = _env_float(ENV_GPU_MEM, 80.0) or 80.0
        free_mib = _env_mib(ENV_GPU_FREE)
        token_seconds = _env_float(ENV_TOKEN, 0.0) or 0.0
        pd_wait = _env_float(ENV_PD_WAIT, 15.0)
    except FaultError as exc:
        return _config_error(str(exc))
    if ns.grpc_mode or ns.smg_grpc_mode:
        from .grpc_server import missing_reason

        missing = missing_reason()
        if missing:
            return _config_error(missing)
    plan = make_plan(ns, total_gib, free_mib=free_mib, argv=argv)
    log = Log(ns.log_level, ns.log_level_http or ns.log_level, plan.args["tp_size"])
    args = plan.args
    recorder = Recorder(os.environ.get(ENV_RECORD) or None, {
        "host": args["host"], "port": args["port"], "nccl_port": args["nccl_port"],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "base_gpu_id": args["base_gpu_id"],
        "tp_size": args["tp_size"], "mem_fraction_static": plan.fraction, "model": args["model_path"],
        "disaggregation_mode": plan.mode,
    })
    sim = Sim(plan, faults, FaultState(request_faults, args["api_key"]), log, recorder, token_seconds,
              15.0 if pd_wait is None else pd_wait)
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
