"""The state of one running simulated server (:class:`Sim`), shared by the main thread, the HTTP threads and
the gRPC servicer: its plan, faults, log and recorder, readiness, counters, prefix cache and metrics.

Part of :mod:`pytest_sglworker.sim`; stdlib only.
"""

from __future__ import annotations

import os
import signal
import socketserver
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any, NoReturn

from . import pd as sim_pd
from .core import ENV_FAULT, Log, Recorder
from .faults import Faults, FaultState
from .load import Loads
from .plan import Plan
from .tokens import NO_SAMPLING, Generation, Sampling, Vocab, constrained, generate

#: The version ``/server_info`` and the gRPC servicer report.
VERSION = "0.5.23-sim"
#: Where the real engine's files are, in the tracebacks the sim prints.
SITE = "/usr/local/lib/python3.12/dist-packages"


class Sim:
    """The state of one simulated server, shared by the main thread and the HTTP threads."""

    def __init__(self, plan: Plan, faults: Faults, state: FaultState, log: Log, recorder: Recorder,
                 token_seconds: float, pd_wait: float = 15.0) -> None:
        self.plan = plan
        self.faults = faults
        self.state = state
        self.log = log
        self.recorder = recorder
        self.token_seconds = token_seconds
        self.pd_wait = pd_wait
        self.vocab: Vocab = plan.model.vocab
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
        self.cache: deque[tuple[int, ...]] = deque(maxlen=256)
        #: the generations in flight by request id, each with its abort flag (``/abort_request``)
        self.live: dict[str, threading.Event] = {}
        #: the open sessions (``/open_session``), see :mod:`.routes.sessions`
        self.sessions: dict[str, Any] = {}
        self.startup_time = time.time()
        self.startup_timings: dict[str, Any] = {}
        #: the HTTP server once bound (a :class:`.server.SimHTTPServer`)
        self.server: socketserver.BaseServer | None = None
        self.worker_id = f"{plan.args['port']}/{os.getpid()}"
        self.bootstrap: sim_pd.BootstrapState | None = None
        self.prefill_infos = sim_pd.PrefillInfoCache()
        #: the gRPC server and its HTTP sidecar in ``--grpc-mode`` (a :class:`.grpc_server.GrpcSim`)
        self.grpc: Any = None
        #: the requests in flight and their tokens, by DP rank (``/v1/loads``)
        self.loads = Loads(dp_size=plan.args.get("dp_size") or 1, max_running=plan.max_running_requests,
                           max_total_tokens=plan.max_total_tokens, mode=plan.mode)

    @property
    def mode(self) -> str:
        return self.plan.mode

    def new_id(self) -> str:
        return uuid.uuid4().hex

    def generate(self, prompt_ids: list[int], source_ids: list[int] | None, max_new_tokens: int | None,
                 stop: list[str], ignore_eos: bool, stop_token_ids: list[int] | None = None,
                 constraint: str | None = None, stop_regex: list[str] | None = None,
                 sampling: Sampling = NO_SAMPLING) -> Generation:
        """One generation of a prompt (``constraint``: the output a regex or JSON schema allows, see
        :mod:`.constrained`), counted in the metrics, the prefix cache and the loads, and logged as sglang logs
        a prefill batch. ``sampling``: the knobs that change the tokens (:class:`.tokens.Sampling`)."""
        if constraint is not None:
            gen = constrained(self.vocab, prompt_ids, constraint, max_new_tokens, stop, stop_token_ids or (),
                              ignore_eos)
        else:
            gen = generate(self.vocab, prompt_ids, prompt_ids if source_ids is None else source_ids, max_new_tokens,
                           stop, ignore_eos, stop_token_ids or (), stop_regex or (), sampling)
        key = tuple(prompt_ids)
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
            if self.plan.args.get("disable_radix_cache"):
                cached = 0  # no prefix cache: every prompt is computed in full
            self.cache.append(key + tuple(gen.output_ids))
            self.num_requests_total += 1
            self.prompt_tokens_total += len(key)
            self.generation_tokens_total += gen.completion_tokens
            self.cached_tokens_total += cached
            running = self.running
        gen.cached_tokens = cached
        self.loads.admit(len(key), cached, gen.completion_tokens)
        self.log.rank0(
            f"Prefill batch, #new-seq: 1, #new-token: {len(key) - cached}, #cached-token: {cached}, "
            f"token usage: 0.00, #running-req: {max(running - 1, 0)}, #queue-req: 0, #pending-token: 0, "
            f"cuda graph: {self.plan.decode_backend != 'disabled'}, input throughput (token/s): 0.00"
        )
        return gen

    def flush_cache(self) -> None:
        with self.lock:
            self.cache.clear()
        self.log.info("Cache flushed successfully!")

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
                ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                 self.plan.max_total_tokens),
            ]
            counters = [
                ("prompt_tokens", "Number of prefill tokens processed.", prompt),
                ("generation_tokens", "Number of generation tokens processed.", self.generation_tokens_total),
                ("cached_tokens", "Number of cached prompt tokens.", self.cached_tokens_total),
                ("num_requests", "Number of requests processed.", self.num_requests_total),
            ]
        lines: list[str] = []
        for name, doc, value in gauges:
            lines += [f"# HELP sglang:{name} {doc}", f"# TYPE sglang:{name} gauge",
                      f"sglang:{name}{{{labels}}} {float(value)}"]
        for name, doc, value in counters:
            lines += [f"# HELP sglang:{name}_total {doc}", f"# TYPE sglang:{name}_total counter",
                      f"sglang:{name}_total{{{labels}}} {float(value)}"]
        return "\n".join(lines) + "\n"

    def count_inference(self) -> bool:
        """Count a served inference request; True when ``die_after`` says this one was the last."""
        die_after = self.state.snapshot().die_after
        with self.lock:
            self.inference_served += 1
            return die_after is not None and self.inference_served >= die_after

    def die(self, arrived: int | None = None) -> NoReturn:
        """The scheduler's exception record, then SIGKILL of itself: ``die_after`` (after answering its last
        request), or ``die_on_request`` (``arrived``: the request that just arrived, never answered)."""
        if arrived is None:
            n = self.state.snapshot().die_after
            what = f"death after {n} requests ({ENV_FAULT}=die_after={n})"
        else:
            what = f"death on request {arrived} ({ENV_FAULT}=die_on_request={arrived})"
        self.log.error(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            f'  File "{SITE}/sglang/srt/managers/scheduler.py", line 6368, in run_scheduler_process\n'
            "    scheduler.run_event_loop()\n"
            f'  File "{SITE}/sglang/srt/managers/scheduler.py", line 2109, in event_loop_overlap\n'
            "    batch_result = self.run_batch(batch)\n"
            f"RuntimeError: simulated {what}\n",
        )
        self.log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        kill_self()


def kill_self() -> NoReturn:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - SIGKILL is not deliverable late
        time.sleep(1)
