"""Sharding a suite across CI runners: ``--sgl-shard K/N`` runs the K-th of N parts of the selected tests.

Plain Python, no pytest.

- **Units.** Every test that uses a pooled worker configuration belongs to that configuration's unit, so
  the N runners together launch each configuration once; every other test is a unit of its own.
- **Costs.** Taken from earlier runs' ``--sgl-report`` files (``--sgl-shard-report``, several allowed, e.g.
  one per shard of the previous run): a test costs the seconds its setup, call and teardown took, so a
  configuration's unit costs its launch (inside the setup of the test that waited for it) plus its tests.
  A test the reports do not know costs the mean of the known tests of its kind (with a worker or without),
  and a configuration they do not know costs the mean launch on top. Without any report every test costs 1:
  the shards are balanced by test count.
- **Assignment.** Longest first: units by falling cost (ties by key), each to the shard with the least cost
  so far (ties to the lowest number). Every runner computes the same partition from the same collection
  and the same reports; the union of the N shards is exactly the unsharded selection.

pytest-split (PyPI) was considered as the base: its algorithms place single tests (its least-duration
assignment spreads one configuration's tests over several shards, and its chunking cuts the test order
at time boundaries, not at configuration boundaries), it has no hook to group tests, and its algorithm
choice is a closed list. A configuration would be launched on several runners, which is the cost that
sharding by configuration exists to avoid.
"""

from __future__ import annotations

import glob
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Costs", "Shard", "ShardSpec", "Unit", "load_costs", "parse_shard", "plan_shards"]


@dataclass(frozen=True)
class ShardSpec:
    """``K/N``: shard ``index`` (1-based) of ``total``."""

    index: int
    total: int

    def __str__(self) -> str:
        return f"{self.index}/{self.total}"


def parse_shard(value: str) -> ShardSpec:
    """``'2/4'`` -> ShardSpec(2, 4); anything else is a ValueError that says what a shard spec is."""
    text = value.strip()
    head, sep, tail = text.partition("/")
    try:
        index, total = int(head), int(tail)
    except ValueError:
        raise ValueError(f"{value!r} is not K/N (the K-th of N shards, e.g. 2/4)") from None
    if not sep:
        raise ValueError(f"{value!r} is not K/N (the K-th of N shards, e.g. 2/4)")
    if total < 1:
        raise ValueError(f"{value!r}: N must be 1 or more")
    if index < 1:
        raise ValueError(f"{value!r}: shards are numbered from 1 (1/{total} to {total}/{total})")
    if index > total:
        raise ValueError(f"{value!r}: there is no shard {index} of {total} (1/{total} to {total}/{total})")
    return ShardSpec(index, total)


@dataclass
class Costs:
    """What earlier runs measured: seconds per test (setup + call + teardown), which configuration each test
    used, and each configuration's median startup."""

    tests: dict[str, float] = field(default_factory=dict)
    test_config: dict[str, str | None] = field(default_factory=dict)
    launches: dict[str, float] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def merge_report(self, report: Mapping[str, Any], source: str) -> None:
        tests = report.get("tests")
        if not isinstance(tests, Mapping):
            raise ValueError("it has no 'tests' section (a report of a release before --sgl-shard; "
                             "write a new one with --sgl-report)")
        for nodeid, entry in tests.items():
            if not isinstance(entry, Mapping) or not isinstance(entry.get("seconds"), int | float):
                raise ValueError(f"its entry for {nodeid!r} has no number of 'seconds'")
            self.tests[str(nodeid)] = float(entry["seconds"])
            config = entry.get("config")
            self.test_config[str(nodeid)] = str(config) if config else None
        workers = report.get("workers")
        if isinstance(workers, Mapping):
            for key, stats in workers.items():
                median = ((stats or {}).get("startup_seconds") or {}).get("median")
                if isinstance(median, int | float):
                    self.launches[str(key)] = float(median)
        self.sources.append(source)


def load_costs(patterns: Sequence[str]) -> tuple[Costs | None, list[str]]:
    """Read the reports named by ``patterns`` (paths or glob patterns). Returns the costs (None when no file
    matched) and notes for the header. A file that is not a run report raises ValueError naming it."""
    paths: list[Path] = []
    notes: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else ([pattern] if Path(pattern).exists()
                                                                               else [])
        if not matched:
            notes.append(f"no report at {pattern}")
        paths += [Path(p) for p in matched if Path(p) not in paths]
    if not paths:
        return None, notes
    costs = Costs()
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot be read as a --sgl-report JSON file: {exc}") from None
        if not isinstance(data, Mapping) or not str(data.get("schema", "")).startswith("pytest-sglworker/report/"):
            raise ValueError(f"{path}: not a --sgl-report file (no 'schema': 'pytest-sglworker/report/...')")
        try:
            costs.merge_report(data, str(path))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return costs, notes


@dataclass
class Unit:
    """Tests that must run on one shard: one configuration's, or a single test without workers."""

    key: str
    nodeids: list[str]
    config: str | None = None
    cost: float = 0.0
    #: how many of its tests the reports knew
    known: int = 0


@dataclass
class Shard:
    index: int
    units: list[Unit] = field(default_factory=list)
    cost: float = 0.0

    @property
    def nodeids(self) -> set[str]:
        return {nodeid for unit in self.units for nodeid in unit.nodeids}

    @property
    def configs(self) -> list[str]:
        return [unit.config for unit in self.units if unit.config is not None]


def make_units(tests: Sequence[tuple[str, str | None]]) -> list[Unit]:
    """``(nodeid, config key or None)`` in collection order -> units, in order of first appearance."""
    units: dict[str, Unit] = {}
    for nodeid, config in tests:
        key = f"config:{config}" if config is not None else f"test:{nodeid}"
        unit = units.get(key)
        if unit is None:
            unit = units[key] = Unit(key, [], config)
        unit.nodeids.append(nodeid)
    return list(units.values())


def _cost_units(units: Sequence[Unit], costs: Costs | None) -> None:
    if costs is None:
        for unit in units:
            unit.cost = float(len(unit.nodeids))
        return
    with_worker = [s for n, s in costs.tests.items() if costs.test_config.get(n)]
    without = [s for n, s in costs.tests.items() if not costs.test_config.get(n)]
    every = with_worker + without
    mean_all = statistics.fmean(every) if every else 1.0
    mean_with = statistics.fmean(with_worker) if with_worker else mean_all
    mean_without = statistics.fmean(without) if without else mean_all
    mean_launch = statistics.fmean(costs.launches.values()) if costs.launches else 0.0
    known_configs = set(costs.launches) | {c for c in costs.test_config.values() if c}
    for unit in units:
        mean = mean_with if unit.config is not None else mean_without
        unit.known = sum(1 for n in unit.nodeids if n in costs.tests)
        unit.cost = sum(costs.tests.get(n, mean) for n in unit.nodeids)
        if unit.config is not None and unit.config not in known_configs:
            unit.cost += mean_launch  # never launched in the reports' runs: its launch is not in any setup


def plan_shards(tests: Sequence[tuple[str, str | None]], total: int, costs: Costs | None = None) -> list[Shard]:
    """Partition ``tests`` (``(nodeid, config key or None)``, collection order) into ``total`` shards."""
    units = make_units(tests)
    _cost_units(units, costs)
    shards = [Shard(i + 1) for i in range(total)]
    for unit in sorted(units, key=lambda u: (-u.cost, u.key)):
        target = min(shards, key=lambda s: (s.cost, s.index))
        target.units.append(unit)
        target.cost += unit.cost
    return shards
