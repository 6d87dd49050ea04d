"""The run's plan, chosen where every configuration is known (issue 43): before the first test, the xdist controller
plays the whole run through in a model of xdist with each order in which configurations may start
(:data:`.planner.ORDERS`), and keeps the one whose run ends soonest.

The model is the planner's own (:class:`.planner.Planner`, the same rules) over the tests' and startups' seconds that
earlier runs measured (:mod:`.durations`) or the specs declare; an xdist worker runs a test only once it knows the
next one (or is told to stop), pays a startup for a configuration it did not launch, and what is left of one it (or
the node that handed it over) launched ahead. No xdist, no pytest, no processes: a few milliseconds a suite of a
hundred tests. Without the tests' seconds (a first run) nothing is played: the default order stands.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .planner import ORDERS, Actions, Planner, Unit

__all__ = ["MAX_TESTS", "choose_order", "predict"]

#: the largest collection the plan is played for (beyond, the default order: the model's cost grows with it, about
#: a second for every order at this size on one core)
MAX_TESTS = 1000


def predict(units: Sequence[Unit | None], tests: Sequence[float], startups: Mapping[str, float], *, nodes: int,
            gpus: int | None, steal_min: int | None, order: str, declared: Mapping[str, float] | None = None,
            history: tuple[Sequence[float | None], Mapping[str, float]] | None = None) -> float:
    """The seconds a run of ``units`` on ``nodes`` xdist workers and ``gpus`` GPUs takes in the model, each test
    ``tests[i]`` seconds and each launch of a configuration ``startups[key]`` (0 where not given); the planner is
    given ``history`` and ``declared`` as the real one is."""
    clock = 0.0
    planner = Planner(units, gpus_total=gpus, steal_min=steal_min, workers=nodes, history=history,
                      clock=lambda: clock, declared=declared, order=order)
    queue: dict[Any, list[int]] = {}  # the nodes are numbered 0 .. nodes - 1
    down: set[Any] = set()
    launched: dict[Any, set[str]] = {}
    ready_at: dict[Any, dict[str, float]] = {}  # node -> its launches ahead -> when each is ready
    busy: set[Any] = set()
    events: list[tuple[float, int, int, float]] = []

    def apply(actions: Actions) -> None:
        for node, indices in actions.sends:
            queue[node].extend(indices)
        down.update(actions.shutdowns)
        for giver, taker, key in actions.handovers:
            launched[taker].add(key)
            if key in ready_at[giver]:
                ready_at[taker][key] = ready_at[giver].pop(key)
        for node, keys in actions.hints:
            for key in keys:
                if key not in launched[node]:
                    launched[node].add(key)
                    ready_at[node][key] = clock + startups.get(key, 0.0)

    for node in range(nodes):
        queue[node], launched[node], ready_at[node] = [], set(), {}
        planner.add_node(node)
    apply(planner.fill_all())
    while True:
        for node, pending in queue.items():
            if node in busy or not pending or (len(pending) < 2 and node not in down):
                continue
            index = pending[0]
            unit = units[index]
            cost = tests[index]
            if unit is not None and unit.key not in launched[node]:
                launched[node].add(unit.key)
                cost += startups.get(unit.key, 0.0)
            elif unit is not None and unit.key in ready_at[node]:
                cost += max(0.0, ready_at[node].pop(unit.key) - clock)
            busy.add(node)
            heapq.heappush(events, (clock + cost, node, index, cost))
        if not events:
            return clock
        clock, number, index, cost = heapq.heappop(events)
        busy.discard(number)
        queue[number].pop(0)
        apply(planner.complete(number, index, cost))
        if not queue[number] and number in down:
            del queue[number]
            apply(planner.remove_node(number)[1])


def choose_order(units: Sequence[Unit | None], history: tuple[Sequence[float | None], Mapping[str, float]] | None,
                 *, nodes: int, gpus: int | None, steal_min: int | None,
                 declared: Mapping[str, float] | None = None) -> tuple[str, dict[str, float]]:
    """The order (a key of :data:`.planner.ORDERS`) whose run the model ends soonest, and each order's seconds
    (empty: nothing was played: no earlier run measured a test, too many tests, or no GPU count; the default order).
    A test no earlier run measured counts as its configuration's median (else all tests'); a startup, as history,
    else the spec's declaration, else the median of the known ones."""
    default = next(iter(ORDERS))
    if history is None or gpus is None or len(units) > MAX_TESTS or nodes < 1:
        return default, {}
    measured, known = history
    own: dict[str, list[float]] = {}
    for unit, seconds in zip(units, measured, strict=True):
        if unit is not None and seconds is not None:
            own.setdefault(unit.key, []).append(seconds)
    every = [s for s in measured if s is not None]
    if not every:
        return default, {}
    fill = statistics.median(every)
    tests = [seconds if seconds is not None else
             statistics.median(own[unit.key]) if unit is not None and unit.key in own else fill
             for unit, seconds in zip(units, measured, strict=True)]
    keys = {unit.key for unit in units if unit is not None}
    startups = {k: v for k, v in {**(declared or {}), **known}.items() if k in keys}
    typical = statistics.median(startups.values()) if startups else 0.0
    startups = {k: startups.get(k, typical) for k in keys}
    walls = {order: predict(units, tests, startups, nodes=nodes, gpus=gpus, steal_min=steal_min, order=order,
                            declared=declared, history=history) for order in ORDERS}
    return min(walls, key=lambda order: (walls[order], list(ORDERS).index(order))), walls
