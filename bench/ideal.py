#!/usr/bin/env python
"""The shortest schedule of a GPU-box suite that a search finds in an ideal model (issue 43): how close a run comes
to what a scheduler that knew every time in advance could do, which the lower bound's ratio cannot say.

    .venv/bin/python bench/ideal.py 5 4          # suite 5 of bench/boxgen.py at -n 4: reference, bound, order

**The model.** 8 GPUs and ``n`` xdist workers; each configuration is launched once. Configurations start in a
*start order*: whenever GPUs are free, every configuration not yet started that fits starts, in that order (one
that does not fit lets a later one that does start: list scheduling), and its startup needs no xdist worker (the
run owns the startups). A configuration is ready after its startup; it then runs all its tests back to back on one
xdist worker as soon as one is free (the ready ones in the order they became ready) and gives its GPUs back when
its last test ends. Every time is known, nothing else costs anything (no process start, no pytest, no hand-over),
and a configuration's tests never run on two workers (no copies).

**The reference** of a suite at ``-n n`` is the shortest wall of that model over start orders: every order for up to
:data:`EXHAUSTIVE` configurations, else the best of a few ordering rules improved by a seeded local search
(:data:`MOVES` swaps and moves, a move kept when the wall does not grow). It is **not a lower bound**: an order the
search did not try, GPUs left idle on purpose or a copy of a configuration may do better. It is a schedule, made
with knowledge no run has: a wall within a few percent of it is near the best a scheduler could do, and
``reference / bound`` says how far the lower bound (bench/box_suites.py) is from any schedule the search finds.
The same suite and ``n`` always give the same reference (no clock, no global random state).

**The reference with declared startups** (:func:`declared_reference`) is what the same search makes of less: it
sees the startups the specs declare (bench/boxgen.py: off by up to 30 %, what a cold run knows) and every test's
true seconds (more than a cold run knows), and the orders it finds are played with the true startups. The search
often finds many orders equally short with the declared startups (thousands, in a suite of 8 configurations), which
it cannot tell apart, while the true startups can part them by a tenth of the wall: the reference is the median of
their true walls (the first one found would be an arbitrary pick among them). The distance between the two
references is what not knowing the startups costs even a scheduler that searches.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from bound import GPUS, KIND_GPUS  # bench/bound.py, a sibling: the box and what each kind of configuration leases

#: configurations up to which every start order is tried (8! = 40,320 plays)
EXHAUSTIVE = 8
#: local-search steps beyond that
MOVES = 3000
#: walls closer than this are equally short (the model's sums of rounded seconds differ in the last bits)
TIE = 1e-9

#: a configuration of the model: (GPUs, startup seconds, seconds of its tests back to back)
Job = tuple[int, float, float]

def jobs_of(configs: Sequence[dict[str, Any]]) -> list[Job]:
    """bench/boxgen.py's configurations as the model's jobs."""
    return [(KIND_GPUS[c["kind"]], float(c["startup"]), float(sum(c["tests"]))) for c in configs]


def play(jobs: Sequence[Job], order: Sequence[int], n: int, gpus: int = GPUS) -> float:
    """The wall of the model (see the module docstring) with start order ``order`` (indices into ``jobs``)."""
    if any(g > gpus for g, _, _ in jobs):
        raise ValueError(f"a configuration needs more than the {gpus} GPUs")
    waiting = list(order)
    free, idle = gpus, n
    ready: list[tuple[float, int]] = []  # (ready since, job): started, waiting for an xdist worker
    events: list[tuple[float, int, int]] = []  # (time, 0 = ready / 1 = done, job)
    now = end = 0.0
    while True:
        still = []
        for j in waiting:  # list scheduling: whatever fits starts, in order
            if jobs[j][0] <= free:
                free -= jobs[j][0]
                heapq.heappush(events, (now + jobs[j][1], 0, j))
            else:
                still.append(j)
        waiting = still
        while idle and ready:
            _, j = heapq.heappop(ready)
            idle -= 1
            heapq.heappush(events, (now + jobs[j][2], 1, j))
        if not events:
            if waiting:
                raise AssertionError("configurations left that never fit")  # excluded above
            return end
        now, kind, j = heapq.heappop(events)
        if kind == 0:
            heapq.heappush(ready, (now, j))
        else:
            free += jobs[j][0]
            idle += 1
            end = max(end, now)


def _rules(jobs: Sequence[Job]) -> list[list[int]]:
    """Start orders by a few rules: the longest (startup and tests) first, the most GPU-seconds, the most GPUs, the
    longest startup, the longest tests."""
    idx = range(len(jobs))
    keys = [lambda j: -(jobs[j][1] + jobs[j][2]), lambda j: -(jobs[j][1] + jobs[j][2]) * jobs[j][0],
            lambda j: (-jobs[j][0], -(jobs[j][1] + jobs[j][2])), lambda j: -jobs[j][1], lambda j: -jobs[j][2]]
    return [sorted(idx, key=key) for key in keys]


def _search(jobs: Sequence[Job], n: int, gpus: int, seed: int) -> tuple[float, list[list[int]]]:
    """The shortest wall the search finds and every order it found that short (the first is the one it keeps)."""
    if len(jobs) <= EXHAUSTIVE:
        walls = [(play(jobs, order, n, gpus), list(order)) for order in itertools.permutations(range(len(jobs)))]
        shortest, first = min(walls, key=lambda pair: pair[0])
        return shortest, [first, *(order for wall, order in walls if wall <= shortest + TIE and order != first)]
    best_wall, best = min(((play(jobs, order, n, gpus), order) for order in _rules(jobs)), key=lambda pair: pair[0])
    ties = [best]
    rng = random.Random(f"bench/ideal.py {seed}")
    for _ in range(MOVES):
        order = list(best)
        a, b = rng.randrange(len(order)), rng.randrange(len(order))
        if rng.random() < 0.5:
            order[a], order[b] = order[b], order[a]
        else:
            order.insert(b, order.pop(a))
        wall = play(jobs, order, n, gpus)
        if wall <= best_wall:  # a move kept when the wall does not grow
            if wall < best_wall - TIE:
                ties = []
            best_wall, best = wall, order
            ties.append(order)
    seen = dict.fromkeys(tuple(order) for order in ties)  # a move can give back an order already kept
    seen.pop(tuple(best), None)
    return best_wall, [best, *(list(order) for order in seen)]


def reference(jobs: Sequence[Job], n: int, gpus: int = GPUS, *, seed: int = 0) -> tuple[float, list[int]]:
    """The shortest wall the search finds and its start order (see the module docstring)."""
    wall, orders = _search(jobs, n, gpus, seed)
    return wall, orders[0]


def declared_reference(configs: Sequence[dict[str, Any]], n: int, gpus: int = GPUS) -> float:
    """The median wall of the true suite over the start orders the search finds shortest for its declared startups
    (see the module docstring)."""
    seen = [(g, float(c["declared"]), p) for (g, _, p), c in zip(jobs_of(configs), configs, strict=True)]
    true = jobs_of(configs)
    return statistics.median(play(true, order, n, gpus) for order in _search(seen, n, gpus, 0)[1])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: bench/ideal.py SEED N", file=sys.stderr)
        return 2
    from bound import bound_at
    from boxgen import generate

    configs = generate(int(args[0]))
    n = int(args[1])
    wall, order = reference(jobs_of(configs), n)
    lower = bound_at(configs, n)["bound"]
    print(json.dumps({"reference": round(wall, 3), "declared_reference": round(declared_reference(configs, n), 3),
                      "bound": round(lower, 3), "ratio": round(wall / lower, 3),
                      "order": [configs[j]["name"] for j in order]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
