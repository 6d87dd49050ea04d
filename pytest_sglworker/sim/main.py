"""The simulated engine as a program (``python -m pytest_sglworker.sim <sglang argv>``, see
:mod:`pytest_sglworker.sim`): :func:`main` parses the command line and the ``SGLSIM_*`` environment, builds the
plan and the server's state, installs the SIGTERM/SIGINT handlers, runs the startup (:mod:`.startup`), then
serves until it is signalled: it drains in-flight requests (``/health`` answers 503 meanwhile) and exits 0.

Part of :mod:`pytest_sglworker.sim`. The parser is :mod:`.cli`'s and the plan :mod:`.plan`'s; ``build_parser``,
``make_plan`` and ``model_facts`` are importable from here too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

from .cli import build_parser, config_error, env_float, env_mib, faults_help
from .core import (
    ENV_FAULT,
    ENV_GPU_FREE,
    ENV_GPU_MEM,
    ENV_PD_WAIT,
    ENV_RECORD,
    ENV_STARTUP,
    ENV_TOKEN,
    ENV_WARMUP,
    Log,
    Recorder,
    signals_wake_main_thread,
    wait_forever,
)
from .faults import FaultError, FaultState, parse_fault_spec
from .plan import make_plan, model_facts
from .startup import StartupExit, run_startup
from .state import Sim

__all__ = ["build_parser", "main", "make_plan", "model_facts"]


class _Shutdown(BaseException):
    """Raised in the main thread by the SIGTERM/SIGINT handler."""


def _shutdown(sim: Sim, signum: int) -> int:
    sim.shutting_down = True
    server = sim.server
    log = sim.log
    log.warning(f"SIGTERM received. signum={signum} frame=None. Draining requests and shutting down...")
    deadline = time.monotonic() + 5.0
    while sim.running > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    log.info(f"Gracefully exiting... Remaining number of requests {sim.running}. Remaining requests remaining_rids=[].")
    if sim.faults.shutdown_seconds:  # the scheduler and detokenizer stopping, as sglang's do
        time.sleep(sim.faults.shutdown_seconds)
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


def _longer_context_error(asked: int | None, derived: int | None) -> str:
    """sglang's ``ModelConfig._derive_context_length``: a ``--context-length`` above the model's own is refused
    before anything starts (the launcher's traceback, exit 1) unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``
    (or ``SGLANG_IS_IN_CI``) is true; then it is used as given."""
    if not asked or not derived or asked <= derived:
        return ""
    if any(os.environ.get(name, "").lower() in ("true", "1", "yes", "y")
           for name in ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "SGLANG_IS_IN_CI")):
        return ""
    return ("Traceback (most recent call last):\n"
            '  File "sglang/launch_server.py", line 29, in run_server\n'
            "    server_args.resolve_once()\n"
            '  File "sglang/srt/configs/model_config.py", line 1314, in _derive_context_length\n'
            "    raise ValueError(\n"
            f"ValueError: Warning: User-specified context_length ({asked}) is greater than the derived "
            f"context_length ({derived}). This may lead to incorrect model outputs or CUDA errors. Note that the "
            "derived context_length may differ from max_position_embeddings in the model's config. To allow "
            "overriding this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1\n")


def process_age() -> float:
    """Seconds since this process was started (its interpreter's start and imports), from ``/proc``; 0 where that
    cannot be read (not Linux)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat, open("/proc/uptime", encoding="ascii") as uptime:
            fields = stat.read().rsplit(")", 1)[1].split()
            since_boot = float(uptime.read().split()[0])
        return max(0.0, since_boot - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str] | None = None, *, since_exec: float = 0.0) -> int:
    """Run the simulated server; returns the exit code (never returns on the SIGKILL faults). ``since_exec``: the
    seconds the process has run already (the program's entry passes :func:`process_age`): the simulated startup
    counts from the process's start, as a real server's does (its interpreter and imports are part of it)."""
    began = time.monotonic() - since_exec
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help-faults" in argv:  # the sim's own flag, kept out of sglang's parser (and of its abbreviations)
        sys.stdout.write(faults_help())
        return 0
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        faults, request_faults = parse_fault_spec(os.environ.get(ENV_FAULT, ""))
        startup = env_float(ENV_STARTUP, 0.3) or 0.0
        warmup_env = env_float(ENV_WARMUP, None)
        total_gib = env_float(ENV_GPU_MEM, 80.0) or 80.0
        free_mib = env_mib(ENV_GPU_FREE)
        token_seconds = env_float(ENV_TOKEN, 0.0) or 0.0
        pd_wait = env_float(ENV_PD_WAIT, 15.0)
    except FaultError as exc:
        return config_error(str(exc))
    if ns.grpc_mode or ns.smg_grpc_mode:
        from .grpc_server import missing_reason

        missing = missing_reason()
        if missing:
            return config_error(missing)
    plan = make_plan(ns, total_gib, free_mib=free_mib, argv=argv)
    longer = _longer_context_error(ns.context_length, plan.model.context_len or plan.facts.context_len)
    if longer:
        sys.stderr.write(longer)
        sys.stderr.flush()
        return 1
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
    pre_bind = max(0.0, startup * 0.7 - (time.monotonic() - began))
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
    waking = signals_wake_main_thread() if in_main_thread else contextlib.nullcontext()
    try:
        try:
            with waking:
                run_startup(sim, pre_bind, warmup)
                wait_forever()
        except StartupExit as exc:
            return exc.code
    except _Shutdown as stop:
        return _shutdown(sim, int(stop.args[0]) if stop.args else int(signal.SIGTERM))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
