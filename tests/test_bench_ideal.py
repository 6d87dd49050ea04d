"""bench/ideal.py, the ideal model the generated GPU-box suites' figures compare runs with (issue 43): its plays on
suites small enough to work out by hand, its search, and the references the committed JSON carries, which must be
what the model computes now (a change to the model without ``--add-references`` fails here).

The bench's modules import each other as siblings: they are loaded from their files here, with bench/ on
``sys.path`` only while they load.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ideal() -> ModuleType:
    return _load("ideal")


@pytest.fixture(scope="module")
def boxgen() -> ModuleType:
    return _load("boxgen")


def test_configurations_on_one_gpu_start_one_after_the_other(ideal: ModuleType) -> None:
    assert ideal.play([(1, 1.0, 1.0), (1, 2.0, 0.5)], [0, 1], n=4, gpus=1) == pytest.approx(4.5)


def test_startups_need_no_xdist_worker_so_they_overlap_and_only_the_tests_queue(ideal: ModuleType) -> None:
    # both start at 0 and are ready at 3; the one xdist worker runs their tests one configuration after the other
    assert ideal.play([(1, 3.0, 1.0), (1, 3.0, 1.0)], [0, 1], n=1, gpus=2) == pytest.approx(5.0)


def test_a_configuration_that_does_not_fit_lets_a_later_one_start(ideal: ModuleType) -> None:
    jobs = [(1, 1.0, 1.0), (2, 1.0, 1.0), (1, 4.0, 0.0)]
    # 0 takes one GPU, 1 (two GPUs) does not fit, 2 takes the other; 1 starts once both are free, at 4
    assert ideal.play(jobs, [0, 1, 2], n=2, gpus=2) == pytest.approx(6.0)
    assert ideal.play(jobs, [1, 0, 2], n=2, gpus=2) == pytest.approx(6.0)  # 1 first: then 0 and 2 side by side


def test_a_ready_configuration_waits_for_the_first_free_xdist_worker(ideal: ModuleType) -> None:
    # 0 is ready at 1 and holds the only worker until 5; 1, ready at 2, runs its test from 5 to 6
    assert ideal.play([(1, 1.0, 4.0), (1, 2.0, 1.0)], [0, 1], n=1, gpus=2) == pytest.approx(6.0)


def test_a_configuration_larger_than_the_box_is_refused(ideal: ModuleType) -> None:
    with pytest.raises(ValueError, match="more than the 2 GPUs"):
        ideal.play([(4, 1.0, 1.0)], [0], n=1, gpus=2)


def test_the_reference_of_a_small_suite_is_the_best_of_every_start_order(ideal: ModuleType) -> None:
    jobs = [(1, 4.0, 1.0), (2, 1.0, 1.0), (1, 1.0, 3.0), (1, 2.0, 0.5), (2, 2.5, 0.5)]
    walls = [ideal.play(jobs, order, 2, 3) for order in itertools.permutations(range(len(jobs)))]
    wall, order = ideal.reference(jobs, 2, 3)
    assert wall == pytest.approx(min(walls)) and ideal.play(jobs, order, 2, 3) == pytest.approx(wall)
    assert min(walls) < max(walls)  # the order matters in this suite: the search has something to find


@pytest.mark.parametrize("seed", [0, 12])
def test_a_large_suite_s_reference_is_a_schedule_no_worse_than_the_rules_and_never_below_the_bound(
        ideal: ModuleType, boxgen: ModuleType, seed: int) -> None:
    configs = boxgen.generate(seed)
    jobs = ideal.jobs_of(configs)
    assert len(jobs) > ideal.EXHAUSTIVE  # the local search, not every order
    for n in (2, 8):
        wall, order = ideal.reference(jobs, n)
        assert sorted(order) == list(range(len(jobs))) and ideal.play(jobs, order, n) == pytest.approx(wall)
        assert wall <= min(ideal.play(jobs, rule, n) for rule in ideal._rules(jobs))
        work = sum(g * (s + p) for g, s, p in jobs) / ideal.GPUS
        assert wall >= max(work, max(s + p for _, s, p in jobs), sum(p for _, _, p in jobs) / n) - 1e-9
        assert ideal.reference(jobs, n) == (wall, order)  # seeded: the same every time
        assert ideal.declared_reference(configs, n) >= wall - 1e-9  # knowing less never finds a shorter one


def test_the_declared_reference_is_the_median_over_the_orders_the_declared_startups_cannot_part(
        ideal: ModuleType) -> None:
    # 2 GPUs, 1 xdist worker, three one-GPU configurations of one 1 s test each, every startup declared 2 s: every
    # order is equally short as declared. True, the third starts in 2 s and the others in 1 s. Started among the first
    # two, it is ready when the worker is free: 4 s (four orders); started last, at 2 s, its test ends at 5 s (two
    # orders, the first of them the search's first). The reference is the median, 4 s, not the first order's 5 s.
    configs = [{"kind": "tp1", "startup": s, "declared": 2.0, "tests": [1.0]} for s in (1.0, 1.0, 2.0)]
    assert ideal.play(ideal.jobs_of(configs), [0, 1, 2], 1, 2) == pytest.approx(5.0)
    assert ideal.declared_reference(configs, 1, 2) == pytest.approx(4.0)
    walls = sorted(ideal.play(ideal.jobs_of(configs), order, 1, 2) for order in itertools.permutations(range(3)))
    assert walls == pytest.approx([4.0, 4.0, 4.0, 4.0, 5.0, 5.0])


def test_the_committed_references_are_what_the_model_computes_now(ideal: ModuleType, boxgen: ModuleType) -> None:
    figures = json.loads((BENCH / "results" / "box_suites.json").read_text())
    for seed in ("0", "5", "12"):  # one suite of every order (5: every start order; 0, 12: the local search)
        configs, stored = boxgen.generate(int(seed), figures["scale"]), figures["suites"][seed]
        for n in figures["n"]:
            assert stored["reference"][n] == round(ideal.reference(ideal.jobs_of(configs), int(n))[0], 3), (
                f"suite {seed} at -n {n}: run bench/box_suites.py --add-references bench/results/box_suites.json")
            assert stored["declared_reference"][n] == round(ideal.declared_reference(configs, int(n)), 3)



@pytest.fixture(scope="module")
def box_suites() -> ModuleType:
    return _load("box_suites")


def test_the_committed_planner_model_is_what_the_planner_computes_now(box_suites: ModuleType,
                                                                      boxgen: ModuleType) -> None:
    """The model column says what the scheduler's own rules make of each suite: a change to the planner (its rules,
    its orders) without ``--add-references`` fails here, as the figures would no longer be the planner's."""
    figures = json.loads((BENCH / "results" / "box_suites.json").read_text())
    for seed in ("5", "12"):
        configs, stored = boxgen.generate(int(seed), figures["scale"]), figures["suites"][seed]
        for n in figures["n"]:
            model = box_suites.planner_model(configs, int(n))
            assert stored["model"][n] == model, (
                f"suite {seed} at -n {n}: run bench/box_suites.py --add-references bench/results/box_suites.json")
            assert model["cold"] >= stored["bounds"][n] - 0.01 and model["history"] >= stored["bounds"][n] - 0.01


def test_the_distance_table_puts_each_step_over_the_bound(box_suites: ModuleType) -> None:
    suite = {"bounds": {"4": 10.0}, "reference": {"4": 10.5}, "declared_reference": {"4": 11.0},
             "model": {"4": {"cold": 12.0, "history": 11.5}}}
    other = {"bounds": {"4": 20.0}, "reference": {"4": 20.2}, "declared_reference": {"4": 24.0},
             "model": {"4": {"cold": 30.0, "history": 22.0}}}
    runs = [{"n": 4, "variant": "cold", "suite": "0", "wall": 14.0}, {"n": 4, "variant": "cold", "suite": "1",
                                                                      "wall": 29.0},
            {"n": 4, "variant": "history", "suite": "0", "wall": 13.0}]
    figures = {"suites": {"0": suite, "1": other}, "n": {"4": {"floor": 1.0}}, "runs": runs}
    row = box_suites._distance_table(figures)[-1]
    # median / worst of each: ideal 1.05, 1.01; declared 1.10, 1.20; model cold 1.20, 1.50; runs less the floor
    # (13 / 10, 28 / 20); model history 1.15, 1.10; the one history run 12 / 10
    assert row == ("| 4 | 1.03x / 1.05x | 1.15x / 1.20x | 1.35x / 1.50x | 1.35x / 1.40x | 1.12x / 1.15x | "
                   "1.20x / 1.20x |")
    del figures["suites"]["1"]["model"]
    assert box_suites._distance_table(figures) == []  # a file from before the model column: no table


@pytest.fixture(scope="module")
def bound(box_suites: ModuleType) -> ModuleType:
    """bench/bound.py as box_suites imported it (a module of dataclasses: loaded under its own name, not by file)."""
    return importlib.import_module(box_suites.bound_at.__module__)


def _suite(*startups: float, tests: float) -> list[dict[str, object]]:
    """Configurations of one GPU with these startups; the first holds every test's seconds (one test)."""
    return [{"name": f"c{i}", "kind": "tp1", "startup": s, "tests": [tests if i == 0 else 0.0]}
            for i, s in enumerate(startups)]


def test_the_first_startups_bound_counts_each_xdist_worker_from_a_ready_configuration(bound: ModuleType) -> None:
    # two workers: the first can start at 1, the second at 2; 6 s of tests: 1 + 2 + 6 over 2
    assert bound.first_startups_bound(_suite(1.0, 2.0, 10.0, tests=6.0), 2) == pytest.approx(4.5)
    # the second configuration is ready only at 9, after the first worker has run everything (by 3)
    assert bound.first_startups_bound(_suite(1.0, 9.0, tests=2.0), 2) == pytest.approx(3.0)
    # more workers than configurations: only one group, so only one worker ever runs a test
    assert bound.first_startups_bound(_suite(2.0, tests=4.0), 4) == pytest.approx(6.0)
    # the bound's own tests / n term is never above it: it only adds the waits
    configs = _suite(0.5, 1.5, 3.0, tests=9.0)
    for n in (1, 2, 3, 8):
        assert bound.first_startups_bound(configs, n) >= bound.bound_at(configs, n)["tests_over_n"]


def test_the_committed_tight_bounds_are_computed_now_and_below_every_reference(
        bound: ModuleType, boxgen: ModuleType) -> None:
    """A lower bound above a schedule the ideal model played (each configuration launched once, a ready group waiting
    for a free xdist worker) would be wrong: every suite's committed reference is checked against it."""
    figures = json.loads((BENCH / "results" / "box_suites.json").read_text())
    for seed, stored in figures["suites"].items():
        configs = boxgen.generate(int(seed), figures["scale"])
        for n in figures["n"]:
            tight = max(bound.bound_at(configs, int(n))["bound"], bound.first_startups_bound(configs, int(n)))
            assert stored["tight_bound"][n] == round(tight, 3), (
                f"suite {seed} at -n {n}: run bench/box_suites.py --add-references bench/results/box_suites.json")
            assert stored["bounds"][n] - 0.005 <= tight <= stored["reference"][n] + 0.001, (seed, n)


def test_the_tight_table_puts_the_runs_over_the_tighter_bound(box_suites: ModuleType) -> None:
    suite = {"bounds": {"2": 10.0}, "tight_bound": {"2": 12.0}, "reference": {"2": 12.6}}
    other = {"bounds": {"2": 20.0}, "tight_bound": {"2": 20.0}, "reference": {"2": 21.0}}
    runs = [{"n": 2, "variant": "cold", "suite": "0", "wall": 16.0}, {"n": 2, "variant": "cold", "suite": "1",
                                                                      "wall": 25.0},
            {"n": 2, "variant": "history", "suite": "1", "wall": 23.0}]
    figures = {"suites": {"0": suite, "1": other}, "n": {"2": {"floor": 1.0}}, "runs": runs}
    row = box_suites._tight_table(figures)[-1]
    # tighter in suite 0 only (1.2, 1.0); references 1.05 and 1.05; cold runs 15 / 12, 24 / 20; history 22 / 20
    assert row == "| 2 | 1 of 2 | 1.10x / 1.20x | 1.05x / 1.05x | 1.23x / 1.25x | 1.10x / 1.10x |"
    del figures["suites"]["0"]["tight_bound"]
    assert box_suites._tight_table(figures) == []  # a file from before the tighter bound: no table
