"""Sharding a suite across CI runners: ``--sgl-shard K/N`` (and ``--sgl-shard-report``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_sglworker.plugin.sharding import Costs, parse_shard, plan_shards

SIM = ["-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:2"]

# 4 worker configurations (3, 3, 2 and 1 tests) and 3 tests without workers; every test writes its node id.
SUITE = """
import os
import pytest

def _seen(request):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(request.node.nodeid + "\\n")

@pytest.fixture(autouse=True)
def seen(request):
    _seen(request)

def test_plain_a(sgl_worker): pass
def test_plain_b(sgl_worker): pass
def test_plain_c(sgl_worker): pass

@pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
class TestSmall:
    def test_1(self, sgl_worker): pass
    def test_2(self, sgl_worker): pass
    def test_3(self, sgl_worker): pass

@pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
class TestMedium:
    def test_1(self, sgl_worker): pass
    def test_2(self, sgl_worker): pass

@pytest.mark.sgl_workers(count=2)
def test_pair(sgl_workers): pass

def test_no_worker_1(): pass
def test_no_worker_2(): pass
def test_no_worker_3(): pass
"""


def test_parse_shard() -> None:
    assert (parse_shard("2/4").index, parse_shard(" 2/4 ").total) == (2, 4)
    for bad, said in [("3/2", "no shard 3 of 2"), ("0/4", "numbered from 1"), ("1/0", "N must be 1 or more"),
                      ("2", "not K/N"), ("a/b", "not K/N"), ("", "not K/N")]:
        with pytest.raises(ValueError, match=said):
            parse_shard(bad)


def test_plan_keeps_configurations_whole_and_covers_every_test_once() -> None:
    tests = [(f"t{i}", f"c{i % 5}" if i % 7 else None) for i in range(60)]
    for total in (1, 2, 3, 4, 7):
        shards = plan_shards(tests, total)
        ids = [n for s in shards for n in s.nodeids]
        assert sorted(ids) == sorted(n for n, _ in tests)  # union is everything, and nothing twice
        owners = {c: {s.index for s in shards if c in s.configs} for c in {c for _, c in tests if c}}
        assert all(len(o) == 1 for o in owners.values()), owners  # each configuration on one shard
        assert plan_shards(tests, total) == shards  # every runner computes the same partition


def test_plan_balances_by_measured_cost_longest_first() -> None:
    tests = [("big1", "big"), ("big2", "big"), ("mid", "mid"), ("s1", None), ("s2", None), ("s3", None)]
    costs = Costs(tests={"big1": 50.0, "big2": 40.0, "mid": 60.0, "s1": 10.0, "s2": 10.0, "s3": 20.0},
                  test_config={"big1": "big", "big2": "big", "mid": "mid"}, launches={"big": 5.0, "mid": 5.0},
                  sources=["r.json"])
    shards = plan_shards(tests, 2, costs)
    # big (90) | mid (60) + s3 (20) + s1 (10), then s2 (10) to the lowest-numbered of two equal shards: 100 | 90,
    # the best split there is (190 cannot be halved with a 90 that stays whole)
    assert [s.cost for s in shards] == [100.0, 90.0]
    assert [s.configs for s in shards] == [["big"], ["mid"]]
    by_count = plan_shards(tests, 2)
    assert sorted(s.cost for s in by_count) == [3.0, 3.0]
    # an unknown configuration costs the mean test time plus the mean launch; an unknown plain test the mean
    new = plan_shards([*tests, ("n1", "new"), ("n2", None)], 3, costs)
    unit = next(u for s in new for u in s.units if u.config == "new")
    assert unit.cost == pytest.approx(50.0 + 5.0) and unit.known == 0


Runs = tuple[list[set[str]], list[dict[str, object]], list[pytest.RunResult]]


def _run_shards(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, total: int,
                *extra: str, tag: str = "run") -> Runs:
    seen: list[set[str]] = []
    reports: list[dict[str, object]] = []
    results = []
    for k in range(1, total + 1):
        seen_file = tmp_path / f"seen-{tag}-{k}.txt"
        seen_file.write_text("")
        report = tmp_path / f"report-{tag}-{k}.json"
        monkeypatch.setenv("SEEN_FILE", str(seen_file))
        result = pytester.runpytest_subprocess(*SIM, "--sgl-shard", f"{k}/{total}", "--sgl-report", str(report),
                                               *extra, timeout=180)
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()
        seen.append(set(seen_file.read_text().split()))
        reports.append(json.loads(report.read_text()))
        results.append(result)
    return seen, reports, results


def test_shards_partition_the_suite_and_launch_each_configuration_once(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(SUITE)
    whole = tmp_path / "seen-whole.txt"
    whole.write_text("")
    monkeypatch.setenv("SEEN_FILE", str(whole))
    full = pytester.runpytest_subprocess(*SIM, "--sgl-report", str(tmp_path / "whole.json"), timeout=180)
    full.assert_outcomes(passed=12)
    everything = set(whole.read_text().split())
    assert len(everything) == 12

    seen, reports, results = _run_shards(pytester, monkeypatch, tmp_path, 3, tag="count")
    assert set().union(*seen) == everything  # the union of the shards is the unsharded selection
    assert sum(len(s) for s in seen) == len(everything)  # and no test runs twice
    launches: dict[str, set[str]] = {}  # configuration -> its launches (a group's members share one)
    for r in reports:
        for rec in r["launches"]:  # type: ignore[attr-defined]
            launches.setdefault(rec["config"], set()).add(rec["group"] or rec["id"])
    assert len(launches) == 4 and all(len(v) == 1 for v in launches.values()), launches  # each launched once
    results[0].stdout.fnmatch_lines(["sglworker: shard 1/3 (balanced by test count; each worker configuration's "
                                     "tests on one shard)", "sglworker: shard 1/3: * of 12 tests, * worker "
                                     "configuration(s), estimated * tests of 12.0 tests (balanced by test count)"])
    assert all("tests" in r for r in reports)

    # Balanced by the three reports of that run: the same union, and the header says so.
    pattern = str(tmp_path / "report-count-*.json")
    seen2, _, results2 = _run_shards(pytester, monkeypatch, tmp_path, 3, "--sgl-shard-report", pattern, tag="cost")
    assert set().union(*seen2) == everything and sum(len(s) for s in seen2) == 12
    results2[1].stdout.fnmatch_lines(["*shard 2/3: * of 12 tests*estimated *s of *s (balanced by 3 report(s))"])


def test_xdist_workers_shard_alike(pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(SUITE)
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    monkeypatch.setenv("SEEN_FILE", str(plain))
    result = pytester.runpytest_subprocess(*SIM, "--sgl-shard", "2/2", timeout=180)
    assert result.ret == pytest.ExitCode.OK
    under_xdist = tmp_path / "xdist.txt"
    under_xdist.write_text("")
    monkeypatch.setenv("SEEN_FILE", str(under_xdist))
    result = pytester.runpytest_subprocess(*SIM, "--sgl-shard", "2/2", "-n", "2", timeout=180)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert set(under_xdist.read_text().split()) == set(plain.read_text().split())


def test_bad_shard_input(pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path) -> None:
    pytester.makepyfile("def test_a(): pass\n")
    for value, said in [("3/2", "there is no shard 3 of 2"), ("0/4", "shards are numbered from 1")]:
        result = pytester.runpytest_subprocess(*SIM, "--sgl-shard", value, timeout=60)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"*--sgl-shard: invalid value '{value}': *{said}*"])
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    result = pytester.runpytest_subprocess(*SIM, "--sgl-shard", "1/2", "--sgl-shard-report", str(corrupt),
                                           timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--sgl-shard-report: {corrupt}: cannot be read as a --sgl-report JSON file*"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something/else"}))
    result = pytester.runpytest_subprocess(*SIM, "--sgl-shard", "1/2", "--sgl-shard-report", str(other), timeout=60)
    result.stderr.fnmatch_lines([f"*{other}: not a --sgl-report file*"])
    # a report that is not there yet (the first run of a CI cache) falls back to the test count
    result = pytester.runpytest_subprocess(*SIM, "--sgl-shard", "1/1", "--sgl-shard-report",
                                           str(tmp_path / "missing.json"), timeout=60)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*balanced by test count (no report at *missing.json)*"])
