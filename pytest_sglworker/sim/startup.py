"""The simulated engine's startup, in the order sglang prints it: the server-args line, parallel init, the
weights, the KV pool, the CUDA-graph captures, the bind, the warmup, readiness; and the startup faults, each
interrupting that one sequence at its own step (``crash_oom`` in the prefill capture, ``kv_oom`` and ``exit=N``
after the weights, ``hang_before_bind``, ``hang``, ``flood``, ``escape_child``).

Part of :mod:`pytest_sglworker.sim`. The plan it prints comes from :mod:`.plan`; the failures print sglang 0.5.23's
scheduler tracebacks. ``--grpc-mode`` binds through :mod:`.grpc_server` (imported only then), the PD prefill side
starts its bootstrap server (:mod:`.pd`) before the weights load.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, NoReturn

from ..engine.sglang_facts import READY_LINE, WARMUP_PROMPT, decode_capture_sizes, prefill_capture_sizes
from .core import ENV_ESCAPED, ENV_FAULT, Log, wait_forever
from .plan import Plan
from .refusals import kill_tree_line as _kill_tree_line
from .refusals import scheduler_traceback as _scheduler_traceback
from .refusals import triton_driver_crash, triton_on_cpu
from .server import SimHTTPServer, SimHTTPServer6
from .state import Sim, kill_self
from .vocab import FALLBACK_RULE

#: Seconds after which an ``escape_child`` child exits by itself, so that no test leaves it forever.
ESCAPED_CHILD_LIFETIME = 600.0
#: The prefill capture goes from the largest bucket down; the seed failure ran out of memory at the 26th.
_OOM_BUCKET = 26


class StartupExit(Exception):
    """The startup ended the program with this exit code (its failure already logged and recorded)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _server_args_line(plan: Plan) -> str:
    # 0.5.23 logs the resolved arguments as a dict (older versions: ServerArgs(...)).
    shown = {k: v for k, v in plan.args.items() if not k.startswith("_argv")}
    return f"server_args={shown!r}"


_SCHEDULER_FRAME = ("sglang/srt/managers/scheduler.py", 6362, "run_scheduler_process",
                    "scheduler = Scheduler(server_args, port_args)")
_INIT_FRAME = ("sglang/srt/managers/scheduler.py", 568, "__init__", "self.init_model_worker()")
_SIGQUIT = "Received sigquit from a child process. It usually means the child failed."


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


def run_startup(sim: Sim, pre_bind: float, warmup: float) -> SimHTTPServer | None:
    """Everything from the server-args line to readiness; returns the running HTTP server (None in
    ``--grpc-mode``: the gRPC server is ``sim.grpc``)."""
    plan, log, faults = sim.plan, sim.log, sim.faults
    args = plan.args
    timings: dict[str, Any] = {}
    log.info(_server_args_line(plan))
    if plan.model.tokenizer_note:  # said once: token counts are the sim's, not the model's
        log.warning(f"(sim) counting tokens without the model's tokenizer: {plan.model.tokenizer_note}; the "
                    f"fallback counts {FALLBACK_RULE}")
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
        raise StartupExit(_fail(sim, [_SCHEDULER_FRAME, _INIT_FRAME,
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
        raise StartupExit(_fail(sim, [_SCHEDULER_FRAME, _INIT_FRAME,
                                      ("sglang/srt/managers/scheduler.py", 1090, "init_target_memory_pool",
                                       "self.tp_worker.alloc_memory_pool(")],
                                f"RuntimeError: simulated scheduler failure ({ENV_FAULT}=exit={n})", n))
    if faults.kv_oom or plan.rest <= 0:
        code = _kv_oom(sim)
        sim.recorder.record("exit", returncode=code, reason="kv_oom")
        raise StartupExit(code)
    if args["kv_events_config"]:
        try:
            json.loads(args["kv_events_config"])
        except ValueError as exc:
            raise StartupExit(_fail(sim, [_SCHEDULER_FRAME], f"json.decoder.JSONDecodeError: {exc}", 1)) from None
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
        wait_forever()
    if args["grpc_mode"] or args["smg_grpc_mode"]:
        from . import grpc_server as sim_grpc

        served = sim_grpc.serve(sim, warmup)
        if isinstance(served, int):
            raise StartupExit(served)
        log.info(READY_LINE)
        sim.recorder.record("ready", startup_seconds=round(time.time() - sim.recorder.started, 6))
        return None

    host, port = args["host"], args["port"]
    server_cls = SimHTTPServer6 if ":" in host else SimHTTPServer
    # uvicorn's order: its process and the application's startup first, then the bind (which may fail), so a health
    # probe answered once the socket listens is never logged above these lines
    log.uvicorn("INFO", f"Started server process [{os.getpid()}]")
    log.uvicorn("INFO", "Waiting for application startup.")
    log.uvicorn("INFO", "Application startup complete.")
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
        wait_forever()
    sim.bound = True
    sim.server = server
    shown = f"[{host}]" if ":" in host else host
    # before the first request is answered, as uvicorn's one event loop logs it: a probe that connected meanwhile
    # waits in the listen queue
    log.uvicorn("INFO", f"Uvicorn running on http://{shown}:{port} (Press CTRL+C to quit)")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="sim-http", daemon=True).start()
    if faults.hang:
        wait_forever()
    if not args["skip_server_warmup"]:
        time.sleep(warmup)
        if triton_on_cpu(plan) and not plan.is_embedding:
            triton_driver_crash(sim)
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
