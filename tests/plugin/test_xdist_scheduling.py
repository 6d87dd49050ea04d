"""The xdist scheduler that knows worker configurations (issue #16, ``--sgl-dist``).

Two tiers: the planner (plain logic) in a discrete-event model of xdist workers, which checks the bounds over
many shapes in milliseconds; then real pytest sessions under ``-n 4`` against the simulated engine, which check
that xdist, the plugin's workers and the scheduler agree: launches, stealing, GPU exclusivity (every
simulated worker's ``CUDA_VISIBLE_DEVICES`` from ``SGLSIM_RECORD``), every test once, a crashed xdist worker,
and the switch (auto, an explicit ``--dist``, ``off``, ``-n 0``, ``-p no:xdist``).
"""

from __future__ import annotations

import heapq
import json
import re
import shutil
import statistics
import types
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.plugin.options import parse_dist_option
from pytest_sglworker.plugin.planner import Planner, Unit
from pytest_sglworker.plugin.xdist_scheduling import (
    MAP_SCHEMA,
    explicit_dist,
    read_collection_map,
    unit_from_suffix,
)

SIM = ("-p", "no:cacheprovider", "--sgl-engine", "sim")

# --------------------------------------------------------------------------------------------------------
# The option and the explicit --dist
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ("auto", ("auto", 4)), ("on", ("on", 4)), ("OFF", ("off", 4)), ("on,steal=8", ("on", 8)),
    ("auto, steal=off", ("auto", None)), ("auto,steal=1", ("auto", 1)),
])
def test_parse_dist_option(value: str, expected: tuple[str, int | None]) -> None:
    assert parse_dist_option(value) == expected


@pytest.mark.parametrize(("value", "fragment"), [
    ("sideways", "is not 'auto', 'on' or 'off'"), ("on,steal=0", "must be 1 or more"),
    ("on,steal=x", "is not an integer or 'off'"), ("on,window=3", "unknown setting 'window=3'"),
    ("on,steal", "unknown setting"),
])
def test_parse_dist_option_refuses(value: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        parse_dist_option(value)


def _config(args: Sequence[str], addopts: Sequence[str] = ()) -> Any:
    return types.SimpleNamespace(invocation_params=types.SimpleNamespace(args=tuple(args)),
                                 getini=lambda name: list(addopts) if name == "addopts" else None)


@pytest.mark.parametrize(("args", "addopts", "env", "expected"), [
    (["-n", "4"], [], "", None),
    (["-n", "4", "--dist", "load"], [], "", "load"),
    (["-n", "4", "--dist=loadgroup"], [], "", "loadgroup"),
    (["-n", "4", "-d"], [], "", "load"),
    (["-n", "4"], ["--dist", "loadscope"], "", "loadscope"),
    (["-n", "4"], [], "--dist worksteal", "worksteal"),
    (["-n", "4", "--dist", "load"], ["--dist", "loadscope"], "", "load"),  # the command line comes last
    (["-n", "4", "--", "--dist"], [], "", None),
    (["-k", "dist", "tests/"], [], "", None),
])
def test_explicit_dist(monkeypatch: pytest.MonkeyPatch, args: list[str], addopts: list[str], env: str,
                       expected: str | None) -> None:
    monkeypatch.setenv("PYTEST_ADDOPTS", env)
    assert explicit_dist(_config(args, addopts)) == expected


def test_units_from_the_loadgroup_suffix_and_the_map(tmp_path: Path) -> None:
    assert unit_from_suffix("t.py::test[a]@sgl-a-1234") == Unit("a-1234", 1)
    assert unit_from_suffix("t.py::test[x@y]") is None  # an '@' inside a parameter id is not a group
    assert unit_from_suffix("t.py::test@mine") == Unit("xdist_group:mine", 0, stealable=False)
    path = tmp_path / "gw0.json"
    path.write_text(json.dumps({"schema": MAP_SCHEMA, "gpus": 4, "tests": {
        "t.py::a": ["a", 2, True], "t.py::bad": ["a", "2", True], "t.py::g": ["xdist_group:g", 0, False]},
        "startups": {"a": 30, "b": -1, "c": "5", "d": True}}))
    found = read_collection_map(path)
    assert found is not None and found.gpus == 4
    assert found.tests == {"t.py::a": Unit("a", 2), "t.py::g": Unit("xdist_group:g", 0, False)}
    assert found.startups == {"a": 30.0}  # the declared startups: anything but positive seconds is not one
    for bad in ("not json", json.dumps({"schema": "other", "tests": {}}), json.dumps([1])):
        path.write_text(bad)
        assert read_collection_map(path) is None
    assert read_collection_map(tmp_path / "missing.json") is None


# --------------------------------------------------------------------------------------------------------
# The planner in a model of xdist: a node runs its first pending test only once it knows the next one (or
# has been told to shut down); a test of a configuration the node has not launched yet costs a startup.
# --------------------------------------------------------------------------------------------------------


@dataclass
class Model:
    launches: int = 0
    wall: float = 0.0
    ran: list[int] = field(default_factory=list)
    crashed: list[int] = field(default_factory=list)
    spans: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # (node, key) -> [start, end]
    max_pending: int = 0
    #: groups launched ahead by one node, handed over to the node that ran their tests: (giver, taker, key)
    handed: list[tuple[int, int, str]] = field(default_factory=list)

    def max_copies(self, key: str | None = None) -> int:
        """The most nodes that ran ``key`` (any configuration: None) at once."""
        edges = sorted(e for (_, k), (a, b) in self.spans.items() if key in (None, k) for e in ((b, -1), (a, 1)))
        live = peak = 0
        for _, delta in edges:
            live += delta
            peak = max(peak, live)
        return peak


def simulate(units: Sequence[Unit | None], *, nodes: int = 4, gpus: int | None = 4,
             startup: float | Mapping[str, float] = 1.0, test: float | Sequence[float] = 0.1,
             steal_min: int | None = 4, crash_at: int | None = None, replace: bool = True,
             history: tuple[Sequence[float | None], Mapping[str, float]] | None = None, hints: bool = True,
             declared: Mapping[str, float] | None = None, order: str = "work") -> Model:
    planner = Planner(units, gpus_total=gpus, steal_min=steal_min, workers=nodes, history=history,
                      clock=lambda: clock, hints=hints, declared=declared, order=order)
    durations = [test] * len(units) if isinstance(test, (int, float)) else list(test)
    model = Model()
    queue: dict[int, list[int]] = {}
    down: set[int] = set()
    launched: dict[int, set[str]] = {}
    ahead: dict[int, dict[str, float]] = {}  # node -> configuration launched ahead -> when it is ready
    busy: set[int] = set()
    events: list[tuple[float, int, int, float]] = []
    clock = 0.0
    next_id = 0

    def add() -> None:
        nonlocal next_id
        queue[next_id], launched[next_id], ahead[next_id] = [], set(), {}
        planner.add_node(next_id)
        next_id += 1

    def apply(actions: Any) -> None:
        for node, indices in actions.sends:
            assert node not in down, "tests sent to a node after its shutdown"
            queue[node].extend(indices)
        down.update(actions.shutdowns)
        for giver, taker, key in actions.handovers:  # the taker adopts the giver's group, ready when it would be
            model.handed.append((giver, taker, key))
            launched[taker].add(key)
            if key in ahead[giver]:
                ahead[taker][key] = ahead[giver].pop(key)
        for node, keys in actions.hints:  # the xdist worker's pool starts the new ones now, in the background
            for key in keys:
                if key in launched[node]:
                    continue  # launched ahead already (a list shrinks as the node takes its launches ahead)
                launched[node].add(key)
                model.launches += 1
                ahead[node][key] = clock + (startup if isinstance(startup, (int, float)) else startup[key])

    for _ in range(nodes):
        add()
    apply(planner.fill_all())
    while True:
        for node, pending in queue.items():
            if node in busy or not pending or (len(pending) < 2 and node not in down):
                continue
            index = pending[0]
            unit = units[index]
            cost = durations[index]
            if unit is not None and unit.key not in launched[node]:
                launched[node].add(unit.key)
                model.launches += 1
                cost += startup if isinstance(startup, (int, float)) else startup[unit.key]
            elif unit is not None and unit.key in ahead[node]:  # what is left of its launch ahead
                cost += max(0.0, ahead[node].pop(unit.key) - clock)
            if unit is not None:
                span = model.spans.setdefault((node, unit.key), [clock, clock])
                span[1] = clock + cost
            busy.add(node)
            heapq.heappush(events, (clock + cost, node, index, cost))
        model.max_pending = max([model.max_pending, *(len(p) for p in queue.values())])
        if not events:
            break
        clock, node, index, cost = heapq.heappop(events)
        busy.discard(node)
        if index == crash_at:
            crash_at = None
            model.crashed.append(index)
            del queue[node]
            crashed, actions = planner.remove_node(node)
            assert crashed == index
            apply(actions)
            if replace:
                add()
                apply(planner.fill_all())
            continue
        assert queue[node][0] == index
        queue[node].pop(0)
        model.ran.append(index)
        apply(planner.complete(node, index, cost))
        if not queue[node] and node in down:
            del queue[node]
            apply(planner.remove_node(node)[1])
    model.wall = clock
    assert planner.left() == 0, f"{planner.left()} tests never handed out"
    return model


def suite(*sizes: int, gpus: int = 1) -> list[Unit | None]:
    return [Unit(f"c{i}", gpus) for i, size in enumerate(sizes) for _ in range(size)]


def loadgroup_wall(sizes: Sequence[int], nodes: int, startup: float, test: float) -> float:
    """xdist's loadgroup: one node per configuration, largest first, the next one to the first node free."""
    free = [0.0] * nodes
    for size in sorted(sizes, reverse=True):
        free.sort()
        free[0] += startup + size * test
    return max(free)


def test_model_affinity_six_configurations_launch_each_once() -> None:
    units = suite(10, 10, 10, 10, 10, 10)
    model = simulate(units, startup=1.0, test=0.02)
    assert sorted(model.ran) == list(range(60))
    assert model.launches == 6  # fast tests never outweigh a startup: no copies
    assert model.wall <= loadgroup_wall([10] * 6, 4, 1.0, 0.02) + 0.2


def test_model_two_large_configurations_are_stolen_within_the_bounds() -> None:
    units = suite(30, 30)
    model = simulate(units, startup=1.0, test=0.2)
    assert sorted(model.ran) == list(range(60))
    assert model.max_copies("c0") == model.max_copies("c1") == 2
    assert model.launches <= 2 + 4 - 1
    assert model.wall < 0.7 * loadgroup_wall([30, 30], 4, 1.0, 0.2)


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_model_copies_never_exceed_the_gpus(gpus: int) -> None:
    units = suite(30, 30)
    model = simulate(units, gpus=gpus, startup=1.0, test=0.2)
    assert sorted(model.ran) == list(range(60))
    assert model.max_copies() <= gpus  # all configurations together
    assert model.launches <= 2 + 4 - 1


def test_model_tp2_configurations_count_their_gpus() -> None:
    units = suite(30, 30, gpus=2)
    model = simulate(units, gpus=4, startup=1.0, test=0.2)
    assert model.max_copies("c0") == model.max_copies("c1") == 1  # 2 x tp2 fill the 4 GPUs
    assert model.launches == 2


def test_model_history_starts_the_longest_work_first() -> None:
    # four configurations of 4 tests x 0.5 s that start in 1 s, and one of 2 tests that starts in 8 s: by test
    # count the long startup begins last and runs alone at the end (15 s on 2 nodes); by the durations an earlier
    # run measured it begins first (longest processing time first: 12 s)
    units = suite(4, 4, 4, 4, 2)
    startups = {"c0": 1.0, "c1": 1.0, "c2": 1.0, "c3": 1.0, "c4": 8.0}
    run = dict(nodes=2, gpus=2, startup=startups, test=0.5, steal_min=None)
    by_count = simulate(units, **run)  # type: ignore[arg-type]
    assert by_count.wall == pytest.approx(15.0)
    partial = [0.5 if unit is not None and unit.key != "c2" else None for unit in units]  # c2 unknown: median
    by_history = simulate(units, **run, history=(partial, startups))  # type: ignore[arg-type]
    assert by_history.wall == pytest.approx(12.0)
    assert by_history.spans[(0, "c4")][0] == 0.0
    assert sorted(by_history.ran) == list(range(len(units))) and by_history.launches == 5


def test_model_the_bound_holds_over_many_shapes() -> None:
    shapes = [(1,), (3, 40), (50,), (5, 5, 60), (100, 2, 2, 2), (7,) * 9, (30, 30, 30), (200, 1)]
    for sizes in shapes:
        for nodes in (2, 4, 8):
            for test in (0.01, 0.3):
                units = suite(*sizes)
                model = simulate(units, nodes=nodes, gpus=nodes, startup=1.0, test=test)
                assert sorted(model.ran) == list(range(len(units))), (sizes, nodes, test)
                assert model.launches <= len(sizes) + nodes - 1, (sizes, nodes, test, model.launches)
                assert model.max_pending <= 3


def test_model_measured_startup_stops_late_copies() -> None:
    # 200 fast tests: the K rule alone would copy it at once, the measurements (startup 5 s against 10 ms a
    # test) say that the copy never pays back once the first test has told them
    units = suite(200, 1)
    planner = Planner(units, gpus_total=4, steal_min=4, workers=4, hints=False)  # c1 stays for "late"
    planner.add_node("a")
    planner.fill_all()
    planner.complete("a", 0, 5.01)
    for index in (1, 2, 3):
        planner.complete("a", index, 0.01)
    planner.add_node("late")
    actions = planner.fill_all()
    assert planner.startup_seconds("c0") == pytest.approx(5.0)
    assert not planner.worth_a_copy("c0")
    assert [(n, i) for n, i in actions.sends if n == "late"] == [("late", [200])]  # only c1, no copy of c0


def test_model_fewer_xdist_workers_than_gpus_launch_the_next_configurations_ahead() -> None:
    # 16 configurations of 4 tests x 0.5 s that start in 4 s, 8 GPUs, 4 xdist workers: a worker that starts its
    # next configuration only at its first test leaves half the GPUs idle while it waits for each startup; told
    # to launch it ahead on the free GPUs, its startups overlap its tests. Each configuration is launched once,
    # and the GPUs the pools hold never exceed the inventory.
    units = suite(*[4] * 16)
    run = dict(nodes=4, gpus=8, startup=4.0, test=0.5, steal_min=None)
    late = simulate(units, **run, hints=False)  # type: ignore[arg-type]
    ahead = simulate(units, **run)  # type: ignore[arg-type]
    for model in (late, ahead):
        assert sorted(model.ran) == list(range(len(units))) and model.launches == 16
    assert late.wall == pytest.approx(4 * (4.0 + 2.0))  # four configurations a worker, one after the other
    bound = 16 * (4.0 + 2.0) / 8
    assert ahead.wall <= 1.3 * bound < 0.7 * late.wall, (ahead.wall, late.wall)


def test_model_two_xdist_workers_keep_eight_gpus_starting() -> None:
    # 12 configurations of 2 tests x 0.5 s that start in 4 s, 8 GPUs, 2 xdist workers (issue 43): one launch ahead
    # per worker, and a configuration whose first test came behind another's started only at that test, so each
    # worker ran its startups one after the other (30 s). Every free GPU now starts one, several per worker, and
    # a worker's look-ahead into its next configuration launches it at once: near the bound, each launched once.
    units = suite(*[2] * 12)
    model = simulate(units, nodes=2, gpus=8, startup=4.0, test=0.5, steal_min=None)
    assert sorted(model.ran) == list(range(len(units))) and model.launches == 12
    bound = max(12 * (4.0 + 1.0) / 8, 12 * 1.0 / 2, 4.0 + 1.0)
    assert model.wall <= 1.5 * bound, model.wall


def test_model_declared_startups_start_idle_workers_on_the_launch_ready_soonest() -> None:
    # 2 xdist workers, 8 GPUs; four configurations start in 8 s, four in 1 s, each 4 tests of 1 s, the slow ones
    # first in the collection. Nothing declared, the workers' first launches are the slow ones (collection order)
    # and they wait 8 s each; with the startups declared (off by 30 %), each starts on a launch ready in about
    # 1 s while the slow ones start ahead on the free GPUs and are ready by the time a worker reaches them
    units = suite(*[4] * 8)
    startups = {f"c{i}": 8.0 if i < 4 else 1.0 for i in range(8)}
    declared = {k: v * (1.3 if i % 2 else 0.7) for i, (k, v) in enumerate(startups.items())}
    run = dict(nodes=2, gpus=8, startup=startups, test=1.0, steal_min=None)
    blind = simulate(units, **run)  # type: ignore[arg-type]
    told = simulate(units, **run, declared=declared)  # type: ignore[arg-type]
    for model in (blind, told):
        assert sorted(model.ran) == list(range(len(units))) and model.launches == 8
    first = {node: min(((a, key) for (n, key), (a, _) in told.spans.items() if n == node))[1] for node in (0, 1)}
    assert all(startups[key] == 1.0 for key in first.values()), first
    assert told.wall <= 1.1 * (1.0 + 32 / 2) < blind.wall, (told.wall, blind.wall)


def test_planner_of_its_launches_ahead_a_worker_takes_the_one_ready_soonest() -> None:
    # c2 (9 s) and then c3 (1 s) were launched ahead at 0 s: at 1.5 s c3 is ready and c2 is not, so c3 comes first
    # (plan order would have the worker wait 7.5 s); where a startup is not known, plan order stands; a
    # configuration not launched ahead (a resident that ran before) is ready now
    now = [1.5]
    units = [Unit("c2"), Unit("c3"), Unit("c4"), Unit("c5")]
    planner = Planner(units, gpus_total=8, steal_min=None, workers=2, clock=lambda: now[0],
                      declared={"c2": 9.0, "c3": 1.0, "c5": 2.0})
    planner._ahead_at.update({"c2": 0.0, "c3": 0.0, "c4": 0.0, "c5": 1.0})
    assert planner._ready_in("c2") == pytest.approx(7.5) and planner._ready_in("c3") == 0.0
    assert planner._soonest(["c2", "c3"]) == "c3"
    assert planner._soonest(["c5", "c2"]) == "c5"  # ready at 3 s, before c2 at 9 s
    assert planner._ready_in("c1") == 0.0  # not launched ahead
    blind = Planner(units, gpus_total=8, steal_min=None, workers=2, clock=lambda: now[0])
    blind._ahead_at.update({"c2": 0.0, "c3": 0.0})
    assert blind._ready_in("c2") is None and blind._soonest(["c2", "c3"]) == "c2"


def test_planner_without_history_starts_the_most_gpu_tests_first() -> None:
    # no durations known: a 2-GPU configuration of 3 tests (6 GPU-tests) starts before a 1-GPU one of 4, which
    # starts before one of 2; by test count alone, the 2-GPU one came second and, on a full box, often last
    units = [*suite(4), *[Unit("c1", 2)] * 3, *[Unit("c2")] * 2]
    planner = Planner(units, gpus_total=8, steal_min=None, workers=1, hints=False)
    assert planner._most_work_first(["c0", "c1", "c2"]) == ["c1", "c0", "c2"]
    planner.add_node("a")
    planner.fill_all()
    assert planner.nodes["a"].current == "c1"


def test_planner_a_look_ahead_launches_at_once_not_at_its_first_test() -> None:
    # 2 GPUs, one xdist worker: c0 (1 GPU, 2 tests), then c1 and c2 (1 GPU, 1 test each). Its window holds c0's two
    # tests and c1's first: with a GPU free, c1 is launched ahead at once (its startup overlaps c0's tests), not at
    # that test. Once c0's first test has run, no GPU is free by the planner's count: c2 is not sent behind the two
    # tests it holds (it would wait there), only once c0's last test has run; c0 is let go then, and c2 launched
    units = [*suite(2), Unit("c1"), Unit("c2")]
    planner = Planner(units, gpus_total=2, steal_min=None, workers=1)
    planner.add_node("a")
    actions = planner.fill_all()
    assert planner.nodes["a"].pending == [0, 1, 2] and planner.nodes["a"].probes == {0}
    assert actions.hints == [("a", ("c1",))]
    actions = planner.complete("a", 0, 0.5)
    assert planner.nodes["a"].pending == [1, 2] and not actions.sends and not actions.hints
    actions = planner.complete("a", 1, 0.5)
    assert ("a", "c0") in actions.drops
    assert planner.nodes["a"].pending == [2, 3] and actions.sends == [("a", [3])]


def test_model_a_launch_that_cannot_start_ahead_goes_to_the_worker_free_first() -> None:
    # 2 GPUs, 2 xdist workers: a runs c0 (2 tests of 5 s), b c1 (1 test of 0.5 s); every launch takes 1 s. c2 would
    # have come third in a's window, behind c0's 10 s, where it could not launch ahead (both GPUs held): it goes to
    # b, free first, and the run ends with c0
    units = [*suite(2), Unit("c1"), Unit("c2")]
    model = simulate(units, nodes=2, gpus=2, startup=1.0, test=[5.0, 5.0, 0.5, 0.5], steal_min=None)
    assert sorted(model.ran) == [0, 1, 2, 3] and model.launches == 3
    assert (1, "c2") in model.spans and (0, "c2") not in model.spans, model.spans
    assert model.wall == pytest.approx(11.0)


def test_planner_hints_use_only_gpus_no_pool_holds_and_never_twice() -> None:
    units = suite(4, 4, 4, 4, 4, gpus=2)
    planner = Planner(units, gpus_total=6, steal_min=None, workers=2)
    planner.add_node("a")
    planner.add_node("b")
    first = planner.fill_all()
    assert {n for n, _ in first.sends} == {"a", "b"} and first.hints == [("a", ("c2",))]  # 2 + 2 held, 2 free
    assert planner.fill_all().hints == []  # the inventory is full, and a hint is given once
    drops, hints = [], []
    for index in range(4):  # a's configuration is done: it takes the one it launched ahead, not another
        actions = planner.complete("a", index, 0.5)
        drops += actions.drops
        hints += actions.hints
    assert planner.nodes["a"].current == "c2"
    # c0's last test has run: a's pool lets it go (told while a test of c0 was still to run, it would have
    # stopped c0's workers between two of their tests), and its GPUs take the next launch ahead
    assert drops == [("a", "c0")] and planner.nodes["a"].residents == ["c3", "c2"]
    # c2 stays in a's word while it takes c2's tests, until one has run (a pool that had not read the word yet still
    # launches it ahead, not at its first test)
    assert hints == [("a", ("c2",)), ("a", ("c2", "c3"))] and planner.hints == {"a": ["c3"]}
    assert planner.complete("a", planner.nodes["a"].pending[0], 0.5).hints[-1] == ("a", ("c3",))


def _drops_over(planner: Planner, node: str, durations: float = 0.1) -> list[tuple[str, list[str]]]:
    """Run ``node``'s tests one by one: after each, the test's configuration and the drops told then."""
    out: list[tuple[str, list[str]]] = []
    while planner.nodes[node].pending:
        index = planner.nodes[node].pending[0]
        actions = planner.complete(node, index, durations)
        out.append((planner.units[index].key, [k for n, k in actions.drops if n == node]))  # type: ignore[union-attr]
    return out


def test_planner_lets_go_what_it_reckoned_evicted_once_its_tests_are_done() -> None:
    # one xdist worker on 2 GPUs: c0, then c1 (1 GPU each), then c2 (2 GPUs), handed out while c1's tests were
    # still to run. The planner reckons the pool evicted c0 and c1 for c2 (it counts their GPUs no more), but a
    # pool evicts only when its lease must wait: each is let go by word once its last test has run
    units = [*suite(5, 5), Unit("c2", 2), Unit("c2", 2)]  # c2's 4 GPU-tests fewer than c0's and c1's 5
    planner = Planner(units, gpus_total=2, steal_min=None, workers=1)
    planner.add_node("a")
    planner.fill_all()
    ran = _drops_over(planner, "a")
    told = [(key, drops) for key, drops in ran if drops]
    assert told == [("c0", ["c0"]), ("c1", ["c1"])], ran  # each after its own last test, none twice
    assert [key for key, _ in ran].index("c1") < [key for key, _ in ran].index("c2")


@pytest.mark.parametrize(("workers", "test_s", "leaves"), [(2, 1.0, False), (4, 1.0, True), (2, 100.0, True)],
                         ids=["fewer-than-gpus", "as-many", "a-wait-past-half-the-lease-timeout"])
def test_planner_a_worker_holding_its_last_test_takes_a_configuration_that_waits_for_gpus(
        workers: int, test_s: float, leaves: bool) -> None:
    # 4 GPUs: a runs c0 (2 GPUs), b runs c1 (1 GPU); c2 needs 3. Once b holds only its last test of c1 it must be
    # sent a test or leave (xdist runs a test once it knows the next). With fewer xdist workers than GPUs, one
    # that leaves is missed for the rest of the run: b takes c2, and its pool waits for the lease; unless a's
    # tests (history: test_s each) keep c0's GPUs past half the lease timeout (120 s), which the wait would hit
    units = [*[Unit("c0", 2)] * 4, *[Unit("c1")] * 2, *[Unit("c2", 3)] * 2]
    history = ([test_s] * 4 + [0.1] * 2 + [1.0] * 2, {"c0": 1.0, "c1": 1.0, "c2": 1.0})
    planner = Planner(units, gpus_total=4, steal_min=None, workers=workers, history=history, lease_timeout=120.0)
    planner.add_node("a")
    planner.add_node("b")
    planner.fill_all()
    assert planner.nodes["a"].current == "c0" and planner.nodes["b"].current == "c1"
    actions = planner.complete("b", planner.nodes["b"].pending[0], 0.1)
    if leaves:
        assert actions.shutdowns == ["b"] and not [n for n, _ in actions.sends if n == "b"]
    else:
        sent = [(n, {units[i].key for i in s}) for n, s in actions.sends]  # type: ignore[union-attr]
        assert actions.shutdowns == [] and sent == [("b", {"c2"})]


def test_planner_a_worker_waiting_for_two_gpus_is_not_starved_by_one_gpu_configurations() -> None:
    # 2 GPUs, 3 xdist workers: a and b take c0 and c1 (1 GPU each), c waits for c2's 2 GPUs. When a's and b's
    # GPUs come free one at a time, each would start a 1-GPU configuration on it, and c2 would wait to the end;
    # the first worker that waits has the GPUs it waits for kept for it (it may take what fits first itself)
    units = [*suite(3, 3), Unit("c2", 2), Unit("c3"), Unit("c4")]  # c2's 2 GPU-tests fewer than c0's and c1's 3
    planner = Planner(units, gpus_total=2, steal_min=None, workers=3)
    for node in "abc":
        planner.add_node(node)
    planner.fill_all()
    assert not planner.nodes["c"].pending
    sent: list[tuple[str, str]] = []
    for node in "ab":  # each runs its tests, then leaves (told to: nothing it may start is left)
        while planner.nodes[node].pending:
            actions = planner.complete(node, planner.nodes[node].pending[0], 0.1)
            sent += [(n, units[i].key) for n, s in actions.sends for i in s]  # type: ignore[union-attr]
        assert planner.nodes[node].down
        actions = planner.remove_node(node)[1]
        sent += [(n, units[i].key) for n, s in actions.sends for i in s]  # type: ignore[union-attr]
    while planner.nodes["c"].pending:
        actions = planner.complete("c", planner.nodes["c"].pending[0], 0.1)
        sent += [(n, units[i].key) for n, s in actions.sends for i in s]  # type: ignore[union-attr]
    assert {n for n, _ in sent} == {"c"}, sent  # neither a nor b started c3 or c4 on a GPU c waited for
    assert sorted(key for _, key in sent) == ["c2", "c3", "c4"]


def test_planner_a_launch_queued_behind_a_test_starts_once_gpus_come_free() -> None:
    # 2 GPUs: a runs c0 (2 tests), b c1 (1 test) and then c2, which it had to be sent behind c1's test while no GPU
    # was free (a test of its own launch: it would start only at that test). Once a is gone, its GPU is free: c2 is
    # launched ahead now, its startup overlapping c1's test (issue 43: such launches queued one behind another)
    units = [*suite(2), Unit("c1"), Unit("c2")]
    planner = Planner(units, gpus_total=2, steal_min=None, workers=2)
    planner.add_node("a")
    planner.add_node("b")
    planner.fill_all()
    assert planner.nodes["b"].pending == [2, 3] and planner.nodes["b"].probes == {2, 3}
    for index in (0, 1):
        assert not planner.complete("a", index, 0.5).hints  # a's c0 still holds its GPU
    assert planner.remove_node("a")[1].hints == [("b", ("c2",))]
    assert planner.nodes["b"].probes == {2} and planner.hints == {"b": ["c2"]}
    assert not planner.complete("b", 2, 0.5).hints
    assert planner.complete("b", 3, 0.5).hints == [("b", ())]  # c2's test ran: no longer a launch ahead


def test_planner_an_idle_worker_takes_over_the_next_launch_of_a_busy_one() -> None:
    # a runs c0's two tests of 5 s and launched cX (2 s) ahead, its next; b comes with nothing to do: a is busy
    # for 10 s yet and cX is ready in 1.5 s, so b takes cX's tests over and adopts a's group (before, a
    # worker's next launch ahead was its own, and b left)
    now = [0.0]
    units = [*suite(2), Unit("cX"), Unit("cX")]
    planner = Planner(units, gpus_total=8, steal_min=None, workers=2, window=2, clock=lambda: now[0],
                      history=([5.0, 5.0, 0.5, 0.5], {"c0": 1.0, "cX": 2.0}))
    planner.add_node("a")
    assert planner.fill_all().hints == [("a", ("cX",))]
    now[0] = 0.5
    planner.add_node("b")
    actions = planner.fill_all()
    assert actions.handovers == [("a", "b", "cX")] and ("b", [2]) in actions.sends
    assert planner.nodes["b"].current == "cX" and planner.hints == {"a": []}


def test_planner_a_free_worker_takes_over_a_launch_ahead_ready_sooner_than_a_launch_of_its_own() -> None:
    # 3 GPUs: a runs c0 and launched cX (ready in 2 s) ahead, b runs c1. b's first test ends far sooner than its
    # history said, and b looks past its last one: cY (startup 6 s) would fit. b takes over cX, ready in 1 s, rather
    # than start cY and wait for it while cX waits for a (issue 43: a ready group waited for a busy worker while
    # another launched a slow one)
    now = [0.0]
    units = [*suite(3), Unit("c1"), Unit("c1"), Unit("cX"), Unit("cX"), Unit("cY")]
    tests: list[float | None] = [2.0, 2.0, 2.0, 4.0, 4.0, 3.0, 3.0, 1.0]
    planner = Planner(units, gpus_total=3, steal_min=None, workers=2, window=2, clock=lambda: now[0],
                      history=(tests, {"c0": 1.0, "c1": 1.5, "cX": 2.0, "cY": 6.0}))
    planner.add_node("a")
    planner.add_node("b")
    assert planner.fill_all().hints == [("a", ("cX",))]
    now[0] = 1.0
    actions = planner.complete("b", 3, 0.5)  # b looks past its last test of c1
    assert actions.handovers == [("a", "b", "cX")]
    assert [units[i].key for n, sent in actions.sends if n == "b" for i in sent] == ["cX"]
    assert list(planner.queues["cY"]) == [7] and not planner.copies("cY")


def test_planner_launches_ahead_on_the_worker_done_soonest_by_seconds() -> None:
    # with history: a's c0 has 2 tests of 5 s left, b's c1 3 of 0.1 s; cX, the configuration left, is launched
    # ahead by b, which is done with its own long before a (by test count a would look sooner done)
    units = [*suite(5), *[Unit("c1")] * 6, Unit("cX"), Unit("cX")]
    tests: list[float | None] = [5.0] * 5 + [0.1] * 6 + [1.0, 1.0]
    planner = Planner(units, gpus_total=8, steal_min=None, workers=2,
                      history=(tests, {"c0": 1.0, "c1": 10.0, "cX": 20.0}))
    planner.add_node("a")
    planner.add_node("b")
    actions = planner.fill_all()
    assert planner.nodes["a"].current == "c0" and planner.nodes["b"].current == "c1"
    assert (len(planner.queues["c0"]), len(planner.queues["c1"])) == (2, 3)
    assert actions.hints == [("b", ("cX",))]


def test_planner_launches_ahead_on_the_worker_free_soonest_counting_its_own_launches() -> None:
    # a holds c0's two tests and then the first test of c2: with GPUs free, c2 is launched ahead now (its startup
    # overlaps c0's), not at its first test; b runs c1 (a and b each start with a launch ready soonest). c3 is
    # launched ahead by b: a is free of c0 in 4 + 2 s, but of its launch ahead c2 only at 12 + 1 s; b of c1 at
    # 5 + 6 s. By c0 alone, a would look sooner done
    units = [*suite(2), *[Unit("c1")] * 6, Unit("c2"), Unit("c3")]
    tests: list[float | None] = [1.0] * 10
    planner = Planner(units, gpus_total=8, steal_min=None, workers=2,
                      history=(tests, {"c0": 4.0, "c1": 5.0, "c2": 12.0, "c3": 10.0}))
    planner.add_node("a")
    planner.add_node("b")
    actions = planner.fill_all()
    assert [units[i].key for i in planner.nodes["a"].pending] == ["c0", "c0", "c2"]
    assert planner.nodes["b"].current == "c1"
    assert actions.hints == [("a", ("c2",)), ("b", ("c3",))]
    assert not planner.nodes["a"].probes & {8}  # c2's first test waits for no launch of its own


def test_launch_hints_round_trip_and_anything_else_reads_as_none(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pytest_sglworker.plugin.keys import MAP_INPUT
    from pytest_sglworker.plugin.launch_hints import read_launch_hint, write_launch_hint

    config: Any = SimpleNamespace(workerinput={MAP_INPUT: str(tmp_path), "workerid": "gw1"})
    assert read_launch_hint(config) == ((), frozenset())  # nothing written yet
    write_launch_hint(tmp_path, "gw1", ["c2", "c3"], ["c0"])
    assert read_launch_hint(config) == (("c2", "c3"), frozenset({"c0"}))  # in the order it takes them
    assert (tmp_path / "ahead-gw1.json").stat().st_mode & 0o077 == 0
    write_launch_hint(tmp_path, "gw1", ["c0", "c4"], ["c0", "c1"])  # one it is to let go is never launched
    assert read_launch_hint(config) == (("c4",), frozenset({"c0", "c1"}))
    for text in ("{", "[]", '{"schema": "other", "configurations": ["c2"]}',
                 '{"schema": "pytest-sglworker/xdist-launch-ahead/v1", "configuration": "c2", "drop": []}',
                 '{"schema": "pytest-sglworker/xdist-launch-ahead/v2", "configurations": ["c2"], "drop": []}',
                 '{"schema": "pytest-sglworker/xdist-launch-ahead/v3", "configurations": ["c2"], "drop": []}',
                 '{"schema": "pytest-sglworker/xdist-launch-ahead/v4", "configurations": "c2", "drop": "c0"}'):
        (tmp_path / "ahead-gw1.json").write_text(text)
        assert read_launch_hint(config) == ((), frozenset()), text
    assert read_launch_hint(SimpleNamespace()) == ((), frozenset())  # not an xdist worker


def test_launch_hints_name_each_configurations_last_test_here(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pytest_sglworker.plugin.keys import MAP_INPUT
    from pytest_sglworker.plugin.launch_hints import last_tests, write_launch_hint

    config: Any = SimpleNamespace(workerinput={MAP_INPUT: str(tmp_path), "workerid": "gw1"})
    assert last_tests(config) == {}  # nothing written yet
    write_launch_hint(tmp_path, "gw1", ["c2"], [], last={"c0": "t.py::test_a[c0-1]"})
    assert last_tests(config) == {"c0": "t.py::test_a[c0-1]"}
    write_launch_hint(tmp_path, "gw0", [], [], last={"c1": "t.py::test_b"})  # another worker's word
    assert last_tests(config) == {"c0": "t.py::test_a[c0-1]"}
    schema = json.loads((tmp_path / "ahead-gw1.json").read_text())["schema"]
    for last in ('"t.py::x"', '["c0"]', '{"c0": 1, "c1": "t.py::y"}'):
        (tmp_path / "ahead-gw1.json").write_text(f'{{"schema": "{schema}", "configurations": [], "last": {last}}}')
        assert last_tests(config) == ({"c1": "t.py::y"} if "c1" in last else {}), last  # a claim: what is not a
    assert last_tests(SimpleNamespace()) == {}  # test's node id by key is dropped; not an xdist worker: nothing


def test_planner_names_a_nodes_last_test_of_a_configuration_once_its_queue_is_empty() -> None:
    # one xdist worker on 2 GPUs, c0 (3 tests) then c1 (2): c0's last test is named when it is sent, with the two
    # before it still to run; c1's when its last is sent; none without hints (no launch ahead, no word)
    units = suite(3, 2)
    planner = Planner(units, gpus_total=2, steal_min=None, workers=1)
    planner.add_node("a")
    told = list(planner.fill_all().lasts)
    assert told == [("a", "c0", 2)], told  # window 3: c0's three tests, its queue empty
    while planner.nodes["a"].pending:
        told += planner.complete("a", planner.nodes["a"].pending[0], 1.0).lasts
    assert told == [("a", "c0", 2), ("a", "c1", 4)], told
    quiet = Planner(units, gpus_total=2, steal_min=None, workers=1, hints=False)
    quiet.add_node("a")
    assert quiet.fill_all().lasts == []


def test_launch_hints_name_the_groups_to_adopt_and_the_givers_answer_them(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pytest_sglworker.plugin.keys import MAP_INPUT
    from pytest_sglworker.plugin.launch_hints import RunHandOver, write_launch_hint

    giver = RunHandOver(SimpleNamespace(workerinput={MAP_INPUT: str(tmp_path), "workerid": "gw0"}))
    taker = RunHandOver(SimpleNamespace(workerinput={MAP_INPUT: str(tmp_path), "workerid": "gw1"}))
    assert not taker.expects("c2") and taker.awaited("c2") is None
    write_launch_hint(tmp_path, "gw0", [], [], ["c2", "c3"])
    assert giver.to_hand_over() == ("c2", "c3") and taker.to_hand_over() == ()
    write_launch_hint(tmp_path, "gw1", [], [], [], {"c2": "gw0", "c3": "gw0"})
    assert taker.expects("c2") and taker.awaited("c2") is None  # told, no answer yet: it waits
    giver.answer("c2", True)
    giver.answer("c3", False)
    assert taker.awaited("c2") is True and taker.awaited("c3") is False
    assert not giver.expects("c2") and giver.awaited("c2") is None  # the word is the taker's
    write_launch_hint(tmp_path, "gw1", [], [], [], {})  # the controller says the giver is gone: nothing to wait for
    assert not taker.expects("c3") and taker.awaited("c3") is None
    assert not RunHandOver(SimpleNamespace()).expects("c2")  # not an xdist worker
    RunHandOver(SimpleNamespace()).answer("c2", True)


def test_model_an_idle_worker_takes_over_a_configuration_another_launched_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 xdist workers, 8 GPUs, six configurations of 3 tests; c0's take 1.5 s, the others' 0.2 s. Without history the
    # launches ahead are told by test counts, two to each worker: the one that runs c0 is still at it when the other
    # has run its own, which takes over one of the first one's launches ahead (its group, handed over: no launch)
    units = suite(3, 3, 3, 3, 3, 3)
    durations = [1.5 if u is not None and u.key == "c0" else 0.2 for u in units]
    model = simulate(units, nodes=2, gpus=8, startup=1.5, test=durations, steal_min=None)
    assert model.handed and all(giver != taker for giver, taker, _ in model.handed), model.handed
    assert model.launches == 6
    monkeypatch.setattr(Planner, "_to_take_over", lambda self, node: None)
    without = simulate(units, nodes=2, gpus=8, startup=1.5, test=durations, steal_min=None)
    assert not without.handed and without.launches == 6
    assert model.wall < without.wall


def skew_suite() -> tuple[list[Unit | None], list[float], dict[str, float]]:
    """bench/bound.py's skew suite: one configuration of 24 tests of 0.8 s that starts in 6 s, 15 of 2 tests of
    0.1 s that start in 1 s (their tests and startups, as history holds them)."""
    units: list[Unit | None] = [*suite(24), *(Unit(f"s{i}") for i in range(15) for _ in range(2))]
    startups = {"c0": 6.0, **{f"s{i}": 1.0 for i in range(15)}}
    return units, [0.8] * 24 + [0.1] * 30, startups


def test_planner_durations_of_a_configuration_that_still_starts_come_from_history() -> None:
    # the run has measured the small configurations (1 s startups, 0.1 s tests) but nothing of c0 yet: its own
    # history (6 s, 0.8 s) is a better guess than the others' figures, and the run's own measurements win later
    units, tests, startups = skew_suite()
    planner = Planner(units, gpus_total=8, steal_min=4, workers=8, history=(tests, startups))
    planner.add_node("a")
    planner.add_node("b")
    planner.fill_all()
    b = planner.nodes["b"].pending
    assert [units[i].key for i in b if units[i]] == ["s0", "s0", "s1"]
    planner.complete("b", b[0], 1.1)
    planner.complete("b", b[0], 0.1)
    assert planner.test_seconds("s0") == pytest.approx(0.1) and planner.startup_seconds("s0") == pytest.approx(1.0)
    assert planner.test_seconds("c0") == pytest.approx(0.8)
    assert planner.startup_seconds("c0") == pytest.approx(6.0)
    assert planner.queued_seconds("c0") == pytest.approx(0.8 * 21)
    a = planner.nodes["a"].pending
    planner.complete("a", a[0], 9.0)
    planner.complete("a", a[0], 1.0)
    assert planner.test_seconds("c0") == pytest.approx(1.0) and planner.startup_seconds("c0") == pytest.approx(8.0)
    unknown = Planner(units, gpus_total=8, steal_min=4, workers=8)  # no history: the others' figures, or nothing
    assert unknown.test_seconds("c0") is None and unknown.startup_seconds("c0") is None


def test_planner_a_copy_that_still_starts_is_busy_for_what_is_left_of_its_startup() -> None:
    # 18 tests of 0.8 s that start in 6 s: a and b launch copies at once and hold 3 tests each; 12 tests (9.6 s)
    # are queued. Had a and b started long ago, a third copy would end the queue only 0.4 s sooner (less than its
    # startup's share of the 8 GPUs, 0.75 s): none. One second in, both still start for 5 s: a copy started now
    # ends the queue 2 s sooner
    now = 0.0
    planner = Planner(suite(18), gpus_total=8, steal_min=2, workers=8, history=([0.8] * 18, {"c0": 6.0}),
                      clock=lambda: now)
    planner.add_node("a")
    planner.add_node("b")
    planner.fill_all()
    assert planner.copies("c0") == 2 and len(planner.queues["c0"]) == 12
    now = 100.0
    assert not planner.worth_a_copy("c0")
    now = 1.0
    assert planner.worth_a_copy("c0")
    planner.add_node("c")
    planner.fill_all()
    assert planner.copies("c0") == 3 and planner.steals == 2


def test_planner_a_node_does_not_wait_for_the_gpus_of_a_copy() -> None:
    # 3 GPUs: a runs "big", b runs s1, s2 and then a copy of "big" (its pool keeps s2's idle worker): no GPU is
    # left for c's copy. c leaves rather than waits: an xdist worker that waits keeps its own idle workers' GPUs
    units = [*[Unit("big")] * 40, Unit("s1"), Unit("s2")]
    planner = Planner(units, gpus_total=3, steal_min=4, workers=3, hints=False)  # with hints b lets s2 go
    planner.add_node("a")
    planner.add_node("b")
    planner.fill_all()
    assert planner.nodes["b"].residents == ["big", "s2"] and planner.copies("big") == 2
    planner.add_node("c")
    actions = planner.fill_all()
    assert actions.shutdowns == ["c"] and not [n for n, _ in actions.sends if n == "c"]


@pytest.mark.parametrize("history", [True, False], ids=["history", "cold"])
def test_model_idle_workers_copy_a_huge_configuration_that_still_starts(history: bool) -> None:
    # bench/bound.py's skew suite under -n 8: once the small configurations are done, the huge one has started
    # on one worker for a couple of seconds of its 6; the idle workers start copies of it (K=4 bounds them: 24
    # tests make 5 copies at most), which finish its 19 s of tests long before one copy would
    units, tests, startups = skew_suite()
    model = simulate(units, nodes=8, gpus=8, startup=startups, test=tests,
                     history=(tests, startups) if history else None)
    assert sorted(model.ran) == list(range(len(units)))
    assert model.max_copies("c0") >= 4
    assert model.launches <= 16 + 8 - 1
    assert model.wall < 0.6 * (6.0 + 24 * 0.8)


def test_model_stealing_off_and_unkeyed_tests() -> None:
    units: list[Unit | None] = [*suite(20), *([None] * 10)]
    model = simulate(units, steal_min=None, startup=1.0, test=0.2)
    assert model.launches == 1 and sorted(model.ran) == list(range(30))
    pinned = [Unit("xdist_group:g", 0, stealable=False)] * 20
    model = simulate(pinned, startup=0.0, test=0.2)
    assert len({n for (n, _) in model.spans}) == 1  # a user's own xdist_group stays on one node


def test_planner_sends_nothing_to_a_node_xdist_shut_down() -> None:
    planner = Planner(suite(10, 10), gpus_total=4, steal_min=4, workers=2)
    planner.add_node("a")
    planner.add_node("b")
    planner.fill_all()
    planner.mark_down("b")
    sent = [n for n, _ in planner.complete("b", planner.nodes["b"].pending[0]).sends]
    assert "b" not in sent


def test_model_crashed_node_pending_tests_run_elsewhere() -> None:
    units = suite(12, 12)
    model = simulate(units, startup=1.0, test=0.2, crash_at=3)
    assert model.crashed == [3]
    assert sorted([*model.ran, *model.crashed]) == list(range(24))
    model = simulate(units, startup=1.0, test=0.2, crash_at=3, replace=False)
    assert sorted([*model.ran, *model.crashed]) == list(range(24))


# --------------------------------------------------------------------------------------------------------
# Real sessions under xdist
# --------------------------------------------------------------------------------------------------------

def _six_config_files(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
        import pytest
        from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

        def pytest_sglworker_register_specs(registry):
            for name in ("a", "b"):
                registry.add(ModelSpec(name, f"org/{name}", 4, worker_args=CI_WORKER_ARGS))
    """)
    body = ["import pytest", ""]
    for n, args in enumerate(([], ["--max-total-tokens", "4096"],
                              ["--mem-fraction-static", "0.5", "--max-running-requests", "8"])):
        body += [f"@pytest.mark.sgl_worker(args={args!r})", "@pytest.mark.parametrize('i', range(3))",
                 f"def test_set{n}(sgl_worker, i):", "    assert sgl_worker.client.get('/health').status_code == 200",
                 ""]
    pytester.makepyfile(test_six="\n".join(body))


@dataclass
class Life:
    start: float
    end: float | None
    gpus: tuple[str, ...]


def lives(record: Path) -> list[Life]:
    found: dict[int, Life] = {}
    out: list[Life] = []
    if not record.exists():
        return out
    for line in record.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "start":
            devices = tuple(d for d in (event["cuda_visible_devices"] or "").split(",") if d)
            found[event["pid"]] = life = Life(event["time"], None, devices)
            out.append(life)
        elif event["event"] == "exit" and event["pid"] in found:
            found.pop(event["pid"]).end = event["time"]
    return out


def assert_no_overcommit(record: Path, gpus: int) -> list[Life]:
    found = lives(record)
    assert found, "no simulated worker recorded"
    for life in found:
        assert life.end is not None and life.gpus, life
        assert all(int(g) < gpus for g in life.gpus), life
    for i, a in enumerate(found):
        for b in found[i + 1:]:
            assert a.end is not None and b.end is not None
            if a.start < b.end and b.start < a.end:
                assert not set(a.gpus) & set(b.gpus), f"two live workers on GPU(s) {set(a.gpus) & set(b.gpus)}"
    return found


def peak(found: Sequence[Life]) -> int:
    edges = sorted(e for life in found for e in ((life.start, 1), (life.end or 0.0, -1)))
    live = best = 0
    for _, delta in edges:
        live += delta
        best = max(best, live)
    return best


def launches(report: Path) -> dict[str, int]:
    return {k: w["launches"] for k, w in json.loads(report.read_text())["workers"].items()}


def launched(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's launch records of the groups launched, each with the tests it served: a group launched ahead is
    handed over to the run and its tests are on the record of the xdist worker that adopted it (the same pid)."""
    adopted = [r for r in data["launches"] if r["outcome"] == "adopted"]
    out = []
    for record in data["launches"]:
        if record["outcome"] != "adopted":
            out.append({**record, "tests": [*record["tests"], *(t for r in adopted if r["pid"] == record["pid"]
                                                              for t in r["tests"])]})
    return out


def ran_once(result: pytest.RunResult, count: int) -> None:
    """Every test ran exactly once (xdist's -v lines: ``[gwN] [ NN%] PASSED <node id>``)."""
    ids = re.findall(r"\[gw\d+\] \[\s*\d+%\] (?:PASSED|FAILED|ERROR|SKIPPED) (\S+)", result.stdout.str())
    counts = Counter(i.split("@", 1)[0] for i in ids)
    assert len(counts) == count and set(counts.values()) == {1}, counts


@pytest.fixture
def record(sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "sim-record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(path))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    return path


def test_fewer_xdist_workers_than_gpus_launch_their_next_configuration_ahead(
        pytester: pytest.Pytester, record: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 xdist workers, 6 GPUs, 4 configurations of 3 tests (0.3 s each) that start in 1.5 s: each worker's first
    # configuration holds 1 GPU; the controller tells each to launch its next one on the free GPUs at once, so the
    # second configuration of each worker is asked for before that worker's first test begins (not when its first
    # test comes, after the three of the first configuration), its idle workers are let go once its tests are
    # done, and no GPU ever runs two workers
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.5")
    body = ["import time", "import pytest", ""]
    for n in range(4):
        body += [f"@pytest.mark.sgl_worker(args=['--max-total-tokens', '{4096 + n}'])",
                 "@pytest.mark.parametrize('i', range(3))", f"def test_c{n}(sgl_worker, i):", "    time.sleep(0.3)", ""]
    pytester.makepyfile(test_ahead="\n".join(body))
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "-v", "--sgl-gpus", "sim:6", "--sgl-model", "qwen3-0.6b",
                                           "--sgl-report", str(report),
                                           timeout=120)
    result.assert_outcomes(passed=12)
    ran_once(result, 12)
    assert_no_overcommit(record, 6)
    data = json.loads(report.read_text())
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for launch in sorted(launched(data), key=lambda r: r["t_lease_requested"]):
        by_worker.setdefault(launch["xdist_worker"], []).append(launch)
    assert sorted(len(v) for v in by_worker.values()) == [2, 2], by_worker  # each configuration launched once
    for first, second in by_worker.values():
        began = min(t["t_start"] for t in first["tests"])
        assert second["t_lease_requested"] < began, (first, second)  # asked for ahead, not at its first test
        assert second["t_ready"] <= min(t["t_start"] for t in second["tests"])
        assert first["t_released"] <= max(t["t_end"] for t in second["tests"])  # let go while the second ran


def test_every_free_gpu_starts_a_configuration_several_per_xdist_worker(
        pytester: pytest.Pytester, record: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 xdist workers, 8 GPUs, 8 configurations of 2 tests (issue 43): before either worker's first test begins,
    # each has asked for the GPUs of four configurations (its own, its look-ahead into the next, and two more the
    # controller told it to launch ahead on the GPUs nobody held); before, one launch ahead each, and a
    # look-ahead launched only at its own test. Each configuration is launched once, and no GPU runs two workers
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.5")
    body = ["import time", "import pytest", ""]
    for n in range(8):
        body += [f"@pytest.mark.sgl_worker(args=['--max-total-tokens', '{4096 + n}'])",
                 "@pytest.mark.parametrize('i', range(2))", f"def test_c{n}(sgl_worker, i):", "    time.sleep(0.2)", ""]
    pytester.makepyfile(test_many="\n".join(body))
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "-v", "--sgl-gpus", "sim:8", "--sgl-model", "qwen3-0.6b",
                                           "--sgl-report", str(report), timeout=120)
    result.assert_outcomes(passed=16)
    ran_once(result, 16)
    assert_no_overcommit(record, 8)
    data = json.loads(report.read_text())
    assert sorted(r["config"] for r in launched(data)) == sorted({r["config"] for r in data["launches"]})
    assert len(launched(data)) == 8
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for launch in launched(data):
        by_worker.setdefault(launch["xdist_worker"], []).append(launch)
    for worker, mine in by_worker.items():
        began = min(t["t_start"] for launch in mine for t in launch["tests"])
        assert sum(launch["t_lease_requested"] < began for launch in mine) == 4, (worker, mine)


@pytest.mark.parametrize("dist", [(), ("--sgl-dist", "on", "--dist", "loadgroup")], ids=["auto", "on-over-loadgroup"])
def test_affinity_six_configurations(pytester: pytest.Pytester, record: Path, tmp_path: Path,
                                     dist: tuple[str, ...]) -> None:
    _six_config_files(pytester)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "-n", "4", "-v", "--sgl-gpus", "sim:4", "--sgl-model", "a,b",
                                           "--sgl-report", str(report), *dist, timeout=120)
    result.assert_outcomes(passed=18)
    ran_once(result, 18)
    out = result.stdout.str()
    assert "sglworker: xdist tests scheduled by worker configuration" in out
    assert "sglworker: xdist scheduled 18 tests by worker configuration: 6 configuration(s) on 4" in out
    counts = launches(report)
    assert len(counts) == 6
    assert sum(counts.values()) <= 6 + 4 - 1, counts
    assert_no_overcommit(record, 4)


TWO_LARGE = """
    import time
    import pytest

    @pytest.mark.parametrize("i", range(16))
    def test_large(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200
        time.sleep(0.15)
"""


@pytest.mark.parametrize("gpus", [4, 3])
def test_stealing_two_large_configurations(pytester: pytest.Pytester, record: Path, tmp_path: Path,
                                           gpus: int) -> None:
    pytester.makepyfile(TWO_LARGE)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "-n", "4", "-v", "--sgl-gpus", f"sim:{gpus}", "--sgl-model",
                                           "qwen3-0.6b,llama-1b", "--sgl-report", str(report), timeout=120)
    result.assert_outcomes(passed=32)
    ran_once(result, 32)
    counts = launches(report)
    found = assert_no_overcommit(record, gpus)
    assert peak(found) <= gpus
    assert sum(counts.values()) <= 2 + 4 - 1, counts
    if gpus == 4:
        assert counts == {"qwen3-0.6b": 2, "llama-1b": 2}, counts  # both copied at once: the GPUs are free
    else:  # one copy fits in the third GPU at first; another only once an xdist worker leaves and frees one
        assert max(counts.values()) == 2, counts
    assert re.search(r"\d launch\(es\) planned, [12] of them extra copies by work stealing", result.stdout.str())


@pytest.mark.parametrize(("args", "addopts", "line"), [
    (("--dist", "load"), "", "sglworker: xdist's --dist load hands out the tests, as given"),
    ((), "--dist loadgroup", "sglworker: xdist's --dist loadgroup hands out the tests, as given"),
    (("--sgl-dist", "off"), "", "sglworker: xdist's own --dist load hands out the tests (--sgl-dist off)"),
], ids=["dist-load", "addopts-loadgroup", "off"])
def test_an_explicit_dist_is_respected(pytester: pytest.Pytester, record: Path, monkeypatch: pytest.MonkeyPatch,
                                       args: tuple[str, ...], addopts: str, line: str) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(4))
        def test_w(sgl_worker, i):
            pass
    """)
    monkeypatch.setenv("PYTEST_ADDOPTS", addopts)
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "--sgl-gpus", "sim:2", "--sgl-model", "qwen3-0.6b",
                                           *args, timeout=90)
    result.assert_outcomes(passed=4)
    out = result.stdout.str()
    assert line in out
    assert "xdist scheduled" not in out and "scheduled by worker configuration" not in out


@pytest.mark.parametrize("args", [("-p", "no:xdist"), ("-n", "0")], ids=["no-xdist", "n0"])
def test_without_distribution_nothing_changes(pytester: pytest.Pytester, record: Path, args: tuple[str, ...]) -> None:
    pytester.makepyfile("""
        def test_w(sgl_worker):
            pass

        def test_plain():
            pass
    """)
    result = pytester.runpytest_subprocess(*SIM, *args, "--sgl-gpus", "sim:1", "--sgl-model", "qwen3-0.6b",
                                           "--sgl-dist", "on", timeout=60)
    result.assert_outcomes(passed=2)
    assert "xdist" not in "\n".join(line for line in result.stdout.lines if line.startswith("sglworker:"))


def test_a_run_without_worker_tests_is_xdist_load(pytester: pytest.Pytester, record: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(12))
        def test_plain(i):
            pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "-v", "--sgl-model", "qwen3-0.6b", timeout=60)
    result.assert_outcomes(passed=12)
    ran_once(result, 12)
    assert "no collected test needs a pooled worker: xdist's load scheduling handed them out" in result.stdout.str()


def test_a_crashed_xdist_worker_is_replaced_and_its_tests_rescheduled(pytester: pytest.Pytester, record: Path,
                                                                      tmp_path: Path) -> None:
    pytester.makepyfile("""
        import os, time
        import pytest

        @pytest.mark.parametrize("i", range(8))
        def test_w(sgl_worker, i):
            time.sleep(0.05)
            if i == 1 and sgl_worker.spec.name == "qwen3-0.6b":
                os._exit(1)  # the xdist worker dies, with tests of its configuration still queued on it
    """)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "-v", "--sgl-gpus", "sim:2", "--sgl-model",
                                           "qwen3-0.6b,llama-1b", "--sgl-report", str(report), timeout=120)
    result.assert_outcomes(passed=15, failed=1)
    ran_once(result, 16)
    out = result.stdout.str()
    assert "replacing crashed worker" in out
    assert re.search(r"worker 'gw\d' crashed while running '.*test_w\[qwen3-0.6b-1\]'", out)
    assert_no_overcommit(record, 2)


def test_maxfail_stops_the_run_cleanly(pytester: pytest.Pytester, record: Path) -> None:
    pytester.makepyfile("""
        import time
        import pytest

        @pytest.mark.parametrize("i", range(8))
        def test_w(sgl_worker, i):
            time.sleep(0.05)
            assert not (i == 2 and sgl_worker.spec.name == "llama-1b")
    """)
    result = pytester.runpytest_subprocess(*SIM, "-n", "2", "-x", "--sgl-gpus", "sim:2", "--sgl-model",
                                           "qwen3-0.6b,llama-1b", timeout=90)
    out = result.stdout.str() + result.stderr.str()
    # xdist ends a -x run by raising its Interrupted, whatever the scheduler: exit status 2, as under --dist load
    assert result.ret in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.INTERRUPTED), out
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    assert "stopping after 1 failures" in out
    assert result.parseoutcomes().get("failed") == 1


HISTORY_SUITE = """
    import time
    import pytest

    @pytest.mark.sgl_worker(args=["--max-running-requests", "8"])
    @pytest.mark.parametrize("i", range(3))
    def test_many(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200

    @pytest.mark.sgl_worker(args=["--max-running-requests", "9"])
    def test_long(sgl_worker):
        time.sleep(1.5)
"""


def _ran(result: pytest.RunResult) -> list[str]:
    return [i.split("@", 1)[0].split("::")[-1] for i in
            re.findall(r"\[gw\d+\] \[\s*\d+%\] PASSED (\S+)", result.stdout.str())]


def test_earlier_durations_order_the_configurations(pytester: pytest.Pytester, record: Path) -> None:
    # By test count the 3-test configuration starts first; once pytest's cache holds the durations a run measured,
    # the configuration with the most work (the 1.5 s test) does. Under -p no:cacheprovider nothing is kept.
    pytester.makepyfile(HISTORY_SUITE)
    args = ("--sgl-engine", "sim", "-p", "no:randomly", "-n", "1", "-v", "--sgl-gpus", "sim:1", "--sgl-model",
            "qwen3-0.6b")
    first = pytester.runpytest_subprocess(*args, timeout=120)
    first.assert_outcomes(passed=4)
    assert _ran(first)[0].startswith("test_many"), _ran(first)
    kept = json.loads((pytester.path / ".pytest_cache" / "v" / "sglworker" / "durations").read_text())
    calls = {n.split("::")[-1].split("[")[0]: s for n, s in kept["tests"].items()}
    assert len(kept["tests"]) == 4 and len(kept["startups"]) == 2, kept
    assert calls["test_long"] >= 1.5 > calls["test_many"], kept  # the calls alone, not a setup's launch
    # the two startups measured depend on how fast this machine started each process (under load, by more than the
    # 1.5 s test): they are made equal, so that the tests' measured durations alone decide the order
    typical = statistics.median(kept["startups"].values())
    kept["startups"] = dict.fromkeys(kept["startups"], typical)
    (pytester.path / ".pytest_cache" / "v" / "sglworker" / "durations").write_text(json.dumps(kept))
    second = pytester.runpytest_subprocess(*args, timeout=120)
    second.assert_outcomes(passed=4)
    assert _ran(second)[0].startswith("test_long"), _ran(second)
    shutil.rmtree(pytester.path / ".pytest_cache")
    pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider", timeout=120).assert_outcomes(passed=4)
    assert not (pytester.path / ".pytest_cache").exists()


# --------------------------------------------------------------------------------------------------------
# The run's plan (plan_model): the controller plays the run in its own model with each order and keeps the best
# --------------------------------------------------------------------------------------------------------

#: bench/boxgen.py's suite 23 (x1): 10 configurations on 8 GPUs, three of two GPUs: (key, GPUs, startup, tests)
SUITE_23 = [("c00", 1, 2.523, [0.457, 1.308, 0.901, 1.256, 1.468, 0.191, 1.093]),
            ("c01", 1, 6.888, [1.115, 0.331, 0.779, 0.19, 1.154, 1.346]),
            ("c02", 1, 5.77, [0.406, 0.724, 1.403, 0.812, 1.383, 0.272]),
            ("c03", 1, 2.633, [0.661, 1.02, 0.786, 1.189, 1.384, 1.344, 0.926, 0.585]),
            ("c04", 2, 2.713, [1.253, 0.812]), ("c05", 2, 5.066, [1.086]),
            ("c06", 2, 4.052, [0.787, 1.322, 0.924, 0.99, 0.462, 0.224]),
            ("c07", 1, 1.336, [1.31, 0.334, 1.095, 0.298, 0.701, 0.174, 0.672]), ("c08", 1, 3.855, [0.412]),
            ("c09", 1, 1.755, [0.87, 0.981, 0.506, 1.098, 0.346, 0.889, 1.468, 0.318])]


#: issue 43's generated suite 59 (bench/boxgen.py), as SUITE_23: at -n 8 with history, starting the most work first
#: leaves its long startups and two-GPU configurations to the end
SUITE_59 = [("c00", 2, 7.682, [0.423, 1.008]),
            ("c01", 1, 1.948, [0.531, 1.461, 0.86]),
            ("c02", 2, 3.637, [0.168, 1.246, 0.574]),
            ("c03", 1, 5.5, [1.165, 1.387]),
            ("c04", 1, 6.741, [0.906, 1.137, 1.488, 0.29, 1.147]),
            ("c05", 1, 3.918, [0.775, 1.483, 1.081, 1.248, 0.51, 0.226]),
            ("c06", 1, 6.717, [0.81, 1.207, 0.386, 1.367]),
            ("c07", 1, 5.957, [0.947, 0.452]),
            ("c08", 1, 7.115, [1.213, 0.17, 0.402, 0.262, 0.888]),
            ("c09", 1, 2.706, [1.179, 1.348, 1.381, 0.558]),
            ("c10", 1, 4.243, [1.016, 0.793, 0.548, 0.867]),
            ("c11", 1, 1.708, [0.465, 0.319, 0.392, 1.148, 1.301, 1.101]),
            ("c12", 1, 7.366, [0.838]),
            ("c13", 2, 6.349, [0.373, 1.458, 0.362, 0.31, 1.413]),
            ("c14", 2, 1.071, [0.823, 0.213, 0.473, 0.242, 0.194, 0.409, 0.285]),
            ("c15", 1, 1.713, [1.196, 0.164, 0.738, 1.238, 1.335, 0.353, 0.824]),
            ("c16", 2, 5.626, [0.643, 1.445, 0.987, 0.562])]


def _suite_23() -> tuple[list[Unit | None], list[float], dict[str, float]]:
    return _suite(SUITE_23)


def _suite(rows: list[tuple[str, int, float, list[float]]]) -> tuple[list[Unit | None], list[float], dict[str, float]]:
    units: list[Unit | None] = [Unit(key, gpus) for key, gpus, _, tests in rows for _ in tests]
    return units, [t for *_, tests in rows for t in tests], {key: s for key, _, s, _ in rows}


@pytest.mark.parametrize("order", ["work", "gpus", "startup"])
@pytest.mark.parametrize("nodes", [2, 8])
def test_plan_model_plays_the_run_as_the_model_of_xdist_does(order: str, nodes: int) -> None:
    # the controller's model (plan_model.predict) and this file's (simulate) are written apart: a run they play
    # alike, to the millisecond, is the planner's, whatever the order
    from pytest_sglworker.plugin.plan_model import predict

    units, tests, startups = _suite_23()
    history = (tests, startups)
    expected = simulate(units, nodes=nodes, gpus=8, startup=startups, test=tests, history=history, order=order)
    assert predict(units, tests, startups, nodes=nodes, gpus=8, steal_min=4, order=order,
                   history=history) == pytest.approx(expected.wall, abs=1e-6)


def test_plan_model_keeps_the_order_whose_run_ends_soonest() -> None:
    # with history, -n 8: starting the most work first leaves long startups and two-GPU configurations to the end
    # (30.5 s in the model); the plan plays every order and keeps the one that ends soonest, which the run then ends
    # sooner with
    from pytest_sglworker.plugin.plan_model import choose_order
    from pytest_sglworker.plugin.planner import ORDERS

    units, tests, startups = _suite(SUITE_59)
    order, walls = choose_order(units, (tests, startups), nodes=8, gpus=8, steal_min=4)
    assert set(walls) == set(ORDERS) and walls[order] == min(walls.values())
    assert order != "work" and walls[order] < 0.9 * walls["work"], walls
    run = simulate(units, nodes=8, gpus=8, startup=startups, test=tests, history=(tests, startups), order=order)
    default = simulate(units, nodes=8, gpus=8, startup=startups, test=tests, history=(tests, startups))
    assert run.wall < default.wall and sorted(run.ran) == list(range(len(units)))


def test_plan_model_plays_nothing_without_the_tests_seconds_or_too_big_a_collection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pytest_sglworker.plugin.plan_model as plan_model

    units, tests, startups = _suite_23()
    assert plan_model.choose_order(units, None, nodes=4, gpus=8, steal_min=4) == ("work", {})  # a first run
    assert plan_model.choose_order(units, ([None] * len(units), startups), nodes=4, gpus=8, steal_min=4) == (
        "work", {})  # startups alone: the tests' seconds are guesses, the default order stands
    assert plan_model.choose_order(units, (tests, startups), nodes=4, gpus=None, steal_min=4) == ("work", {})
    monkeypatch.setattr(plan_model, "MAX_TESTS", len(units) - 1)
    assert plan_model.choose_order(units, (tests, startups), nodes=4, gpus=8, steal_min=4) == ("work", {})
    with pytest.raises(ValueError, match="unknown order 'fastest'; known: work, area"):
        Planner(units, gpus_total=8, steal_min=None, workers=2, order="fastest")



def test_a_send_to_an_xdist_worker_that_just_died_is_no_internal_error(pytester: pytest.Pytester) -> None:
    """A worker killed between its last report and the next send (seen when the adopter of a group handed over was
    killed, under load): xdist's channel raises OSError, which was an INTERNALERROR that ended the run. The node is
    marked down; xdist's ``remove_node`` then gives its tests back, as for any crash."""
    from types import SimpleNamespace

    from pytest_sglworker.plugin.planner import Actions
    from pytest_sglworker.plugin.xdist_scheduling import ConfigScheduling

    class Gone:
        gateway = SimpleNamespace(id="gw1")

        def send_runtest_some(self, indices: list[int]) -> None:
            raise OSError("cannot send (already closed?)")

        def shutdown(self) -> None:  # xdist's own ignores a closed channel
            pass

    logged: list[str] = []
    scheduling = ConfigScheduling(pytester.parseconfig("--tx", "2*popen"), None, map_dir=None, steal_min=None)
    scheduling.log = lambda *args: logged.append(" ".join(map(str, args)))
    scheduling.collection = ["t.py::a", "t.py::b"]
    scheduling.planner = Planner(suite(2), gpus_total=2, steal_min=None, workers=2)
    gone = Gone()
    scheduling.planner.add_node(gone)
    scheduling._apply(scheduling.planner.fill_all())
    assert scheduling.planner.nodes[gone].down and logged == ["gw1 is gone: its tests go back when xdist removes it"]
    crashed, _ = scheduling.planner.remove_node(gone)
    assert crashed == 0 and list(scheduling.planner.queues["c0"]) == [1]  # the first counts as crashed, as xdist's
    scheduling._apply(Actions())
