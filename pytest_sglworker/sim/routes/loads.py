"""The simulated engine's load endpoints: ``/v1/loads`` (sglang 0.5.23's) and the legacy ``/get_load``.

Part of :mod:`pytest_sglworker.sim`; stdlib only. The figures are the requests in flight right now
(:mod:`pytest_sglworker.sim.load`), so that a busy worker looks busy to a load-aware router.

- ``GET /v1/loads`` is 0.5.23's ``srt/entrypoints/v1_loads.py``: ``{"timestamp", "version", "accelerator",
  "num_accelerators", "loads": [one LoadSnapshot per DP rank]}``; ``?dp_rank=N`` keeps one rank (none when out
  of range), ``?include=core,memory,...`` the named sections (an unknown one raises inside the handler:
  uvicorn's 500 ``Internal Server Error``, connection closed), ``?format=prometheus`` the gauges as text.
- ``GET /get_load`` is *not* served by 0.5.23 (its answer is 404): it is the shape sglang served before
  ``/v1/loads`` replaced it, and its last deprecated shim projected from ``/v1/loads``: one object per DP rank,
  ``{"dp_rank", "num_reqs" (running + waiting), "num_waiting_reqs", "num_tokens" (num_total_tokens),
  "num_pending_tokens", "ts_tic"}``. The sim serves it because the routers that poll only it for their
  load-aware policies (sglang-router 0.3.2's power-of-two and cache-aware: the sum of ``num_tokens``) would
  otherwise see no load at all. Each answer logs the shim's deprecation warning.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..load import VALID_SECTIONS, iso_now, prometheus, select, snapshot
from ..state import VERSION, Sim
from .common import BadRequest, Request, Route


def rank_loads(sim: Sim) -> list[dict[str, Any]]:
    """Every DP rank's ``LoadSnapshot`` (every section)."""
    plan = sim.plan
    with sim.lock:
        prompt, cached = sim.prompt_tokens_total, sim.cached_tokens_total
    kv_gb = plan.max_total_tokens * plan.kv_bytes_per_token / 2**30
    return [snapshot(sim.loads, rank, weights_gb=plan.weights, kv_cache_gb=kv_gb,
                     cache_hit_rate=cached / prompt if prompt else 0.0, prefill_uncached_total=prompt - cached)
            for rank in sim.loads.ranks()]


def _query(ctx: Request) -> dict[str, str]:
    return {key: values[-1] for key, values in parse_qs(urlsplit(ctx.path).query).items()}


def _dp_rank(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"1 validation error:\n  {{'type': 'int_parsing', 'loc': ('query', 'dp_rank'), 'msg': "
                         f"'Input should be a valid integer, unable to parse string as an integer', 'input': "
                         f"{raw!r}}}\n\n    GET /v1/loads", validation=True) from None


def v1_loads(ctx: Request) -> None:
    sim = ctx.sim
    query = _query(ctx)
    try:
        dp_rank = _dp_rank(query.get("dp_rank"))
    except BadRequest as exc:
        ctx.bad(exc, openai=True)
        return
    include = {s.strip() for s in query["include"].split(",")} if query.get("include") else None
    if include is not None and not include <= VALID_SECTIONS:
        # LoadSnapshot.to_dict raises ValueError outside the handler's try: an unhandled exception
        sim.log.error(f"Exception in ASGI application\nValueError: Invalid include sections: "
                      f"{include - VALID_SECTIONS}. Valid options: {sorted(VALID_SECTIONS)}")
        ctx.close()
        ctx.send(500, b"Internal Server Error", "text/plain; charset=utf-8")
        return
    loads = rank_loads(sim)
    if dp_rank is not None:
        loads = [load for load in loads if load["dp_rank"] == dp_rank]
    loads = [select(load, include) for load in loads]
    if query.get("format") == "prometheus":
        ctx.send(200, prometheus(loads).encode(), "text/plain; version=0.0.4; charset=utf-8")
        return
    args = sim.plan.args
    accelerators = int(args.get("tp_size") or 1) * int(args.get("pp_size") or 1)
    if args.get("enable_dp_attention"):
        accelerators //= max(int(args.get("dp_size") or 1), 1)
    ctx.json(200, {"timestamp": iso_now(), "version": VERSION, "accelerator": None,
                   "num_accelerators": accelerators, "loads": loads})


def get_load(ctx: Request) -> None:
    sim = ctx.sim
    sim.log.warning("Endpoint '/get_load' is deprecated and will be removed in a future version. Please use "
                    "'/v1/loads' instead.")
    ts = time.perf_counter()
    ctx.json(200, [{"dp_rank": load["dp_rank"], "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                    "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_total_tokens"],
                    "num_pending_tokens": load["num_total_tokens"] - load["num_used_tokens"], "ts_tic": ts}
                   for load in rank_loads(sim)])


ROUTES: tuple[Route, ...] = (
    Route(("GET",), "/v1/loads", v1_loads),
    Route(("GET",), "/get_load", get_load),
)
