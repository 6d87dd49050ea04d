"""The simulated engine's load: the requests in flight, their tokens, and the per-DP-rank snapshots that
``/v1/loads`` (and the legacy ``/get_load``) answer, as sglang 0.5.23's scheduler reports them.

Part of :mod:`pytest_sglworker.sim`; stdlib only. What the real engine does (``srt/managers/load_snapshot.py``:
``LoadSnapshot``, ``srt/managers/scheduler_components/load_inquirer.py``: ``get_loads``) and what the sim keeps:

- every scheduler (one per DP rank) publishes a ``LoadSnapshot``: running and waiting requests, the KV tokens
  they use (``num_used_tokens``, ``token_usage`` of ``max_total_num_tokens``), the tokens still waiting
  (``num_total_tokens`` = used + the waiting requests' lengths), the memory, PD and queue sections;
- here a request is *admitted* when the server generates for it (:meth:`Loads.admit`, inside a request's
  scope: :meth:`Loads.scope`), grows by one token per generated token (:meth:`Loads.advance`, as the sim paces
  them) and leaves when its HTTP (or gRPC) request ends. Requests go to the DP ranks in turn (sglang's
  round-robin default); on a rank, the first ``--max-running-requests`` run, the others wait; a PD request
  waits while its side waits for its peer (the prefill side's bootstrap queue, the decode side's
  pre-allocation queue).

The sim serves every request at once, whatever ``--max-running-requests`` says: only the report queues them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

#: The sections ``/v1/loads?include=`` accepts (``LoadSnapshot.VALID_SECTIONS``).
VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
#: ``include`` names of the sections the sim reports, and their keys in a load.
_SECTIONS = (("memory", "memory"), ("disagg", "disaggregation"), ("queues", "queues"))


@dataclass
class Seq:
    """One request the scheduler holds: its rank, its prompt and the tokens generated so far."""

    rank: int
    prompt: int
    cached: int = 0
    #: the tokens it will generate (``generated`` stops there)
    limit: int = 0
    generated: int = 0
    #: in a PD queue: waiting for the peer (prefill: bootstrap; decode: pre-allocation / transfer)
    pd_waiting: bool = False

    @property
    def seqlen(self) -> int:
        return self.prompt + self.generated


@dataclass
class _Scope:
    """The sequences one request admitted (and their keys in :attr:`Loads.seqs`)."""

    seqs: list[Seq] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)


class Loads:
    """The requests in flight, by DP rank, behind one lock; a thread's own requests are those of its scope."""

    def __init__(self, *, dp_size: int, max_running: int, max_total_tokens: int, mode: str) -> None:
        self.dp_size = max(int(dp_size), 1)
        self.max_running = max(int(max_running), 1)
        self.max_total_tokens = max(int(max_total_tokens), 1)
        self.mode = mode
        self.lock = threading.Lock()
        self.seqs: dict[int, Seq] = {}
        self._ids = itertools.count()
        self._turn = itertools.count()
        self._local = threading.local()
        #: the scheduler's decode step-time moment sums: steps, sum b, sum t (us), sum b^2, sum b*t, tokens
        self.moments = [0.0] * 6

    def _scope(self) -> _Scope | None:
        scope = getattr(self._local, "scope", None)
        return scope if isinstance(scope, _Scope) else None

    @contextmanager
    def scope(self) -> Iterator[None]:
        """One inference request: what it admits leaves when it ends (answered, failed or broken off)."""
        scope = _Scope()
        self._local.scope = scope
        try:
            yield
        finally:
            self._local.scope = None
            with self.lock:
                for key in scope.keys:
                    self.seqs.pop(key, None)

    def admit(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        """The scheduler takes one sequence of the current request (none outside a request: the warmup)."""
        scope = self._scope()
        if scope is None:
            return
        with self.lock:
            seq = Seq(rank=next(self._turn) % self.dp_size, prompt=prompt_tokens, cached=cached_tokens,
                      limit=completion_tokens)
            key = next(self._ids)
            self.seqs[key] = seq
        scope.seqs.append(seq)
        scope.keys.append(key)

    @contextmanager
    def queued(self, prompt_tokens: int) -> Iterator[None]:
        """The current request waits in the scheduler's queue before it runs (the ``latency`` fault): it counts as
        one more request of ``prompt_tokens`` until it leaves the queue, so that a slow worker looks busy to a
        load-aware router, as a real one's backlog does."""
        if self._scope() is None:
            yield
            return
        with self.lock:
            key = next(self._ids)
            self.seqs[key] = Seq(rank=next(self._turn) % self.dp_size, prompt=max(prompt_tokens, 1))
        try:
            yield
        finally:
            with self.lock:
                self.seqs.pop(key, None)

    def advance(self, tokens: int = 1, step_us: int = 1) -> None:
        """The current request's sequences have generated ``tokens`` more tokens, in decode steps of ``step_us``
        microseconds each (sglang's ``decode_moments``: one step per token, the request's sequences a batch)."""
        scope = self._scope()
        if scope is None or not scope.seqs or tokens <= 0:
            return
        batch, step = float(len(scope.seqs)), float(max(step_us, 1))
        with self.lock:
            for seq in scope.seqs:
                seq.generated = min(seq.generated + tokens, seq.limit)
            for i, add in enumerate((1.0, batch, step, batch * batch, batch * step, batch)):
                self.moments[i] += add * tokens

    def pd_wait(self, waiting: bool) -> None:
        """The current request's sequences enter (or leave) their PD queue."""
        scope = self._scope()
        if scope is None:
            return
        with self.lock:
            for seq in scope.seqs:
                seq.pd_waiting = waiting

    # ------------------------------------------------------------------ reports

    def decode_moments(self) -> list[float] | None:
        """``LoadSnapshot.decode_moments``: the sums, or None before the first decode step."""
        with self.lock:
            return list(self.moments) if self.moments[0] > 0 else None

    def ranks(self) -> list[dict[str, Any]]:
        """Per DP rank: the figures ``LoadSnapshot`` computes from its queues (see the module docstring)."""
        with self.lock:
            seqs = list(self.seqs.values())
        out = []
        for rank in range(self.dp_size):
            mine = [s for s in seqs if s.rank == rank]
            queued = [s for s in mine if not s.pd_waiting]
            running, waiting = queued[:self.max_running], queued[self.max_running:]
            pd = [s for s in mine if s.pd_waiting]
            used = sum(s.seqlen for s in running)
            if self.mode == "decode":  # its pre-allocated requests already hold their KV slots
                used += sum(s.seqlen for s in pd)
            pending = sum(s.seqlen for s in waiting) + (sum(s.seqlen for s in pd) if self.mode == "prefill" else 0)
            uncached = 0 if self.mode == "decode" else sum(max(s.prompt - s.cached, 0) for s in waiting)
            out.append({
                "dp_rank": rank, "running": len(running), "waiting": len(waiting), "pd_waiting": len(pd),
                "used": used, "total": used + pending, "uncached": uncached,
                "awaiting_kv": sum(s.seqlen for s in pd) if self.mode == "decode" else 0,
            })
        return out


def snapshot(loads: Loads, rank: dict[str, Any], *, weights_gb: float, kv_cache_gb: float, cache_hit_rate: float,
             prefill_uncached_total: int) -> dict[str, Any]:
    """One rank's ``LoadSnapshot.to_dict()``: the core keys, then the memory, disaggregation and queues
    sections (no speculative or LoRA section: the sim has neither)."""
    mode = loads.mode
    core: dict[str, Any] = {
        "timestamp": time.time(), "dp_rank": rank["dp_rank"], "num_running_reqs": rank["running"],
        "num_waiting_reqs": rank["waiting"] + rank["pd_waiting"], "num_waiting_uncached_tokens": rank["uncached"],
        "num_used_tokens": rank["used"], "num_total_tokens": rank["total"],
        "num_active_tokens": max(0, rank["total"] - rank["awaiting_kv"]), "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": loads.max_total_tokens, "max_running_requests": loads.max_running,
        "token_usage": round(rank["used"] / loads.max_total_tokens, 4), "gen_throughput": 0.0,
        "cache_hit_rate": round(cache_hit_rate, 4), "utilization": -1 if mode == "prefill" else 0.0,
        "total_prefill_uncached_tokens": prefill_uncached_total, "total_prefill_busy_us": 0,
        "decode_moments": loads.decode_moments(),
    }
    pd = rank["pd_waiting"]
    core["memory"] = {"weight_gb": round(weights_gb, 3), "kv_cache_gb": round(kv_cache_gb, 3), "graph_gb": 0.0,
                      "token_capacity": loads.max_total_tokens}
    core["disaggregation"] = {
        "mode": mode, "prefill_bootstrap_queue_reqs": pd if mode == "prefill" else 0, "prefill_inflight_queue_reqs": 0,
        "decode_prealloc_queue_reqs": pd if mode == "decode" else 0, "decode_transfer_queue_reqs": 0,
        "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}
    core["queues"] = {"waiting": rank["waiting"], "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}
    return core


def select(load: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    """``LoadSnapshot.to_dict(include)``: every core key, and the sections ``include`` names (all without it)."""
    if include is None or "all" in include:
        return load
    out = {k: v for k, v in load.items() if not isinstance(v, dict)}
    for name, key in _SECTIONS:
        if name in include:
            out[key] = load[key]
    return out


def prometheus(loads: list[dict[str, Any]]) -> str:
    """``/v1/loads?format=prometheus``: one gauge per numeric field, sections prefixed (``disagg``, ...)."""
    prefixes = {"disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, Any]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                for sub, sub_value in value.items():
                    if isinstance(sub_value, (int, float)) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefixes.get(key, key)}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values]
    return "\n".join(lines) + "\n"


def iso_now() -> str:
    """``datetime.now(timezone.utc).isoformat()``, as ``/v1/loads`` stamps its answer."""
    return datetime.now(timezone.utc).isoformat()
