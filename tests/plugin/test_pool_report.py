"""The worker pool, test ordering, the live status and the run report, through real pytest sessions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pytest_sglworker.plugin.terminal import STATUS_AFTER_SECONDS

SIM = ["--sgl-engine", "sim", "-p", "no:cacheprovider", "-p", "no:randomly"]


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_pool_reuses_by_configuration_and_fresh_is_unshared(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    pytester.makepyfile("""
        import pytest

        SEEN = {}

        def test_a1(sgl_worker): SEEN.setdefault("a", set()).add(sgl_worker.pid)
        def test_a2(sgl_worker): SEEN.setdefault("a", set()).add(sgl_worker.pid)

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
        def test_b1(sgl_worker): SEEN.setdefault("b", set()).add(sgl_worker.pid)

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
        def test_b2(sgl_worker): SEEN.setdefault("b", set()).add(sgl_worker.pid)

        @pytest.mark.sgl_worker(fresh=True)
        def test_fresh(sgl_worker): SEEN.setdefault("fresh", set()).add(sgl_worker.pid)

        def test_a3(sgl_worker): SEEN.setdefault("a", set()).add(sgl_worker.pid)

        def test_check():
            assert len(SEEN["a"]) == 1 and len(SEEN["b"]) == 1
            assert SEEN["fresh"].isdisjoint(SEEN["a"] | SEEN["b"])
    """)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:4",
                                           "--sgl-report", str(report))
    result.assert_outcomes(passed=7)
    data = json.loads(report.read_text())
    assert data["schema"] == "pytest-sglworker/report/v1"
    workers = data["workers"]
    plain = workers["qwen3-0.6b"]
    assert (plain["launches"], plain["reuses"]) == (2, 2)  # one pooled + one fresh; a2 and a3 reused
    tight = next(v for k, v in workers.items() if k.startswith("qwen3-0.6b-"))
    assert (tight["launches"], tight["reuses"]) == (1, 1)
    assert tight["label"] == "qwen3-0.6b --max-total-tokens 512"
    assert plain["startup_seconds"]["min"] > 0 and len(plain["startup_seconds"]["samples"]) == 2
    # The sim is told the declared card (80 GB by default) and the free memory the ledger predicts with:
    # predicted and actual agree exactly, and the summary says so.
    assert plain["kv_tokens"]["actual"] == plain["kv_tokens"]["predicted"] > 0
    result.stdout.fnmatch_lines(["*qwen3-0.6b:*KV #tokens * (as predicted)*"])
    assert tight["kv_tokens"]["actual"] == 512
    assert sum(1 for r in _records(record) if r["event"] == "start") == 3


def test_idle_worker_is_evicted_when_its_lease_is_needed(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    pytester.makepyfile("""
        import pytest

        def test_a(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
        def test_b(sgl_worker): pass

        def test_a_again(sgl_worker): pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1",
                                           "--sgl-lease-timeout", "20", "--sgl-reorder", "off", "-s")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*evicting idle worker qwen3-0.6b on 127.0.0.1:*to free its GPU lease*"])
    events = _records(record)
    # one GPU: a worker exits before the next one starts
    starts = [r for r in events if r["event"] == "start"]
    exits = [r for r in events if r["event"] == "exit"]
    assert len(starts) == 3 and len(exits) == 3
    for later, earlier_exit in zip(starts[1:], exits[:-1], strict=True):
        assert earlier_exit["time"] <= later["time"]


def test_reorder_groups_tests_of_one_configuration(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        def test_1(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
        def test_2(sgl_worker): pass

        def test_3(): pass

        def test_4(sgl_worker): pass
    """)
    result = pytester.runpytest(*SIM, "--sgl-model", "qwen3-0.6b", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*test_1*", "*test_4*", "*test_2*", "*test_3*"])
    result = pytester.runpytest(*SIM, "--sgl-model", "qwen3-0.6b", "--collect-only", "-q", "--sgl-reorder", "off")
    result.stdout.fnmatch_lines(["*test_1*", "*test_2*", "*test_3*", "*test_4*"])


def test_worker_tests_get_an_xdist_group_per_configuration(pytester: pytest.Pytester) -> None:
    """Under ``--dist loadgroup`` each configuration's tests are one group (xdist appends it to the node ids); a
    run that xdist does not distribute gets no marks (nothing would read them)."""
    pytester.makeconftest("""
        def pytest_collection_finish(session):
            for item in session.items:
                mark = item.get_closest_marker("xdist_group")
                print("GROUP", item.name, mark.kwargs["name"] if mark else None)
    """)
    pytester.makepyfile("""
        import pytest

        def test_1(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
        def test_2(sgl_worker): pass

        def test_3(): pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "-n", "1", "--dist", "loadgroup",
                                           "-v", timeout=120)
    result.assert_outcomes(passed=3)
    ids = [line.split()[-1] for line in result.stdout.lines if " PASSED " in line]
    assert any(i.endswith("::test_1[qwen3-0.6b]@sgl-qwen3-0.6b") for i in ids), ids
    assert any(i.endswith("::test_3") for i in ids), ids  # no configuration, no group
    assert any("test_2[qwen3-0.6b]@sgl-qwen3-0.6b-" in i for i in ids), ids
    result = pytester.runpytest(*SIM, "--sgl-model", "qwen3-0.6b", "--collect-only", "-s")
    assert "GROUP test_1[qwen3-0.6b] None" in result.stdout.str()


def test_waiting_status_and_summary(pytester: pytest.Pytester, sim_env: dict[str, str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "2.5")
    pytester.makepyfile("def test_a(sgl_worker): pass")
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*[[]sglworker[]] * s *: worker qwen3-0.6b on 127.0.0.1:* (pid *, GPUs 0)",
        "*sglang workers*",
        "qwen3-0.6b: 1 launched, 0 reused, startup min/median/max */*/* s*KV #tokens * (as predicted)",
    ])
    # the status line waits for STATUS_AFTER_SECONDS of startup (the second it shows depends on the machine's load)
    shown = [int(n) for n in re.findall(r"\[sglworker\] (\d+) s ", result.stdout.str())]
    assert shown and min(shown) >= STATUS_AFTER_SECONDS, shown
    quiet = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "-q")
    quiet.assert_outcomes(passed=1)
    assert not re.search(r"\[sglworker\] \d+ s ", quiet.stdout.str()), quiet.stdout.str()
    assert "1 launched" in quiet.stdout.str()  # the summary stays under -q
    silent = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "-qq")
    assert silent.ret == 0 and "sglang workers" not in silent.stdout.str()


def test_list_models_uses_declared_inventory_for_the_ledger(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--sgl-list-models", "--sgl-gpus", "sim:2x24", "-v")
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "memory ledger for: declared sim:2x24 (24576 MiB)",
        "*llama-8b*",
    ])
    result = pytester.runpytest("--sgl-list-models", "--sgl-card", "H100-80G", "-v")
    result.stdout.fnmatch_lines(["memory ledger for: H100-80G", "*verdict: fits*"])


def test_worker_is_retired_after_the_last_test_of_its_configuration(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    pytester.makepyfile("""
        import json, os, time, pytest

        def _live():
            path = os.environ["SGLSIM_RECORD"]
            events = [json.loads(line) for line in open(path)]
            started = {e["pid"] for e in events if e["event"] == "start"}
            exited = {e["pid"] for e in events if e["event"] == "exit"}
            return started - exited

        def test_a1(sgl_worker): pass
        def test_a2(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
        def test_b(sgl_worker):
            # the worker of a1/a2 goes, no later test needing it: its retirement began as a2 ended and goes on off
            # the main thread; kept to the session's end, it would outlive this test
            deadline = time.monotonic() + 60
            while len(_live()) != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(_live()) == 1
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:4")
    result.assert_outcomes(passed=3)


def test_budget_opt_out_reason_is_in_the_report(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                tmp_path: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_budget_opt_out(reason="measures the default fraction")
        @pytest.mark.sgl_worker(args=["--mem-fraction-static", "0.8"])
        def test_loose(sgl_worker): pass
    """)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-report", str(report))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*--mem-fraction-static 0.8 (budget opt-out: measures the default fraction)*"])
    labels = [w["label"] for w in json.loads(report.read_text())["workers"].values()]
    assert labels == ["qwen3-0.6b --mem-fraction-static 0.8 (budget opt-out: measures the default fraction)"]


def test_deselected_tests_are_not_checked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(args=["--mem-fraction-static", "0.9"])
        def test_loose(sgl_worker): pass

        def test_other(): pass
    """)
    result = pytester.runpytest(*SIM, "--sgl-model", "qwen3-0.6b", "-k", "not loose")
    result.assert_outcomes(passed=1, deselected=1)


def test_worker_deaths_are_counted(pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path) -> None:
    pytester.makepyfile("""
        import time, pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1"})
        def test_dies(sgl_worker):
            sgl_worker.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
            deadline = time.monotonic() + 10
            while sgl_worker.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
    """)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-report", str(report))
    result.assert_outcomes(passed=1, errors=1)
    (stats,) = json.loads(report.read_text())["workers"].values()
    assert stats["deaths"] == 1


def test_xdist_workers_status_lines_show_through_the_controller(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "4")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("n", range(2))
        @pytest.mark.sgl_worker(fresh=True)
        def test_each(sgl_worker, n):
            pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "-n", "2", "--sgl-gpus", "sim:2",
                                           timeout=120)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*[[]sglworker[]] [[]gw?[]] * s *: worker qwen3-0.6b on 127.0.0.1:*"])


def test_status_line_on_a_terminal_fits_and_is_cleared_before_pytest_writes(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import pty
    import subprocess
    import sys
    import time

    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "3")
    pytester.makepyfile("def test_a(sgl_worker): pass\n\ndef test_b(sgl_worker): pass\n")
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "70", "LINES": "40", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *SIM, "--sgl-model", "qwen3-0.6b", "-v",
                             "-p", "no:xdist"], cwd=pytester.path, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # the other side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(30) == 0
    out = b"".join(chunks).decode(errors="replace")
    shown_at = [int(n) for n in re.findall(r"\r\[sglworker\] (\d+) s ", out)]
    assert shown_at and min(shown_at) >= STATUS_AFTER_SECONDS, out[-2000:]
    # every shown status line fits the 70-column terminal, and is wiped before the test's outcome is written
    shown = [s.split("\r")[0] for s in out.split("\r[sglworker] ")[1:]]
    assert shown and all(len("[sglworker] " + s) <= 69 for s in shown), shown
    for line in out.replace("\r\n", "\n").split("\n"):
        visible = line.rsplit("\r", 1)[-1]
        assert not ("PASSED" in visible and "pid" in visible), line


def test_declared_card_size_reaches_the_sim_and_the_ledger(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """--sgl-gpus sim:2x24: the sim's KV pool is that of a 24 GiB card, as the ledger predicts; a spec whose
    args make the engine disagree with the ledger is flagged as a mismatch in the summary."""
    pytester.makepyfile("""
        import pytest

        def test_plain(sgl_worker):
            info = sgl_worker.client.get("/server_info").json()
            assert info["max_total_num_tokens"] > 0

        @pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"])
        def test_capped(sgl_worker): pass
    """)
    reports = {}
    for card in ("24", "80"):
        path = tmp_path / f"report-{card}.json"
        result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", f"sim:2x{card}",
                                               "--sgl-report", str(path))
        result.assert_outcomes(passed=2)
        reports[card] = json.loads(path.read_text())["workers"]
        plain = reports[card]["qwen3-0.6b"]["kv_tokens"]
        assert plain["actual"] == plain["predicted"] > 0
    small, large = (reports[c]["qwen3-0.6b"]["kv_tokens"]["actual"] for c in ("24", "80"))
    assert 0 < small < large / 2  # the 24 GiB card's pool, not the 80 GB default's
    capped = next(v for k, v in reports["24"].items() if k != "qwen3-0.6b")["kv_tokens"]
    assert capped["actual"] == 4096
    if capped["predicted"] != 4096:  # a ledger that ignores the cap is a finding, said as such
        result.stdout.fnmatch_lines(["*MISMATCH: the ledger predicted*"])


def test_each_member_of_a_prefill_decode_group_is_compared_with_its_own_ledger(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """A PD group on a declared card: every member's KV pool is predicted with that member's own args (its
    role's args and its ``--disaggregation-mode``), not the group's shared args, so the summary shows no false
    mismatch. The two roles are given different caps: a ledger built from the shared args misses the prefill
    cap, and one built from the first member's args misses the decode cap."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(prefill=1, decode=1, prefill_args=["--max-total-tokens", "4096"],
                                 decode_args=["--max-total-tokens", "8192"])
        def test_pd(sgl_workers):
            (prefill,), (decode,) = sgl_workers.prefill, sgl_workers.decode
            assert prefill.client.get("/server_info").json()["max_total_num_tokens"] == 4096
            assert decode.client.get("/server_info").json()["max_total_num_tokens"] == 8192
    """)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:2x80",
                                           "--sgl-report", str(report))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["qwen3-0.6b [[]1P+1D[]]*KV #tokens * (as predicted)"])
    result.stdout.no_fnmatch_line("*MISMATCH*")
    (pd,) = json.loads(report.read_text())["workers"].values()
    assert pd["kv_tokens"]["actual"] == pd["kv_tokens"]["predicted"]


def test_a_pooled_worker_comes_back_without_the_faults_a_test_switched_on(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path
) -> None:
    # sglang's gateway suites switch a worker's faults at run time; the next test must not inherit them
    pytester.makepyfile("""
        import httpx

        PIDS = set()

        def test_breaks_its_worker(sgl_worker):
            PIDS.add(sgl_worker.pid)
            httpx.post(f"{sgl_worker.url}/_sim/faults", json={"status": 503, "fail_first": 100}, timeout=5)
            assert httpx.post(f"{sgl_worker.url}/generate", json={"text": "x"}, timeout=5).status_code == 503

        def test_gets_it_as_it_was(sgl_worker):
            PIDS.add(sgl_worker.pid)
            assert len(PIDS) == 1  # the same worker, reused
            assert httpx.post(f"{sgl_worker.url}/generate", json={"text": "x"}, timeout=5).status_code == 200
            assert sgl_worker.requests_served() == 1  # the failed request of the first test is not counted
    """)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1",
                                           "--sgl-report", str(report))
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["qwen3-0.6b: 1 launched, 1 reused, *, 0 died, 1 set back after runtime faults*"])
    plain = json.loads(report.read_text())["workers"]["qwen3-0.6b"]
    assert (plain["reuses"], plain["resets"], plain["not_reset"]) == (1, 1, 0)


FAULTY_SUITE = """
    import os, time, pytest

    def _generate(worker):
        worker.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})

    def test_passes(sgl_worker): _generate(sgl_worker)
    def test_fails(sgl_worker): assert False, "on purpose"
    def test_skips(sgl_worker): pytest.skip("on purpose")
    def test_without_worker(): pass

    @pytest.mark.xfail(reason="on purpose", strict=True)
    def test_xfails(sgl_worker): assert False

    @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "crash_oom"})
    def test_oom(sgl_worker): pass

    @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1"})
    def test_dies(sgl_worker):
        _generate(sgl_worker)
        deadline = time.monotonic() + 10
        while sgl_worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    @pytest.mark.sgl_workers(count=2, fresh=True)
    def test_half_a_group(sgl_workers): pass
"""

# the second member of test_half_a_group's group (its GPU 1) runs out of memory at startup; nothing else does
FAULTY_CONFTEST = """
    import os

    def pytest_sglworker_worker_env(spec, lease_env):
        if "test_half_a_group" in os.environ.get("PYTEST_CURRENT_TEST", "") and lease_env.get(
                "CUDA_VISIBLE_DEVICES") == "1":
            return {**lease_env, "SGLSIM_FAULT": "crash_oom"}
        return None
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_the_report_counts_tests_as_pytest_does_and_keeps_what_failed(
    pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, xdist: list[str]
) -> None:
    """A suite with passing, failing, skipped, xfailed, erroring workers' tests (a start that runs out of memory,
    a group of which one member does, a worker that dies during its test): the report and the timeline count the
    tests as pytest's summary line does, each test's spans carry pytest's outcome, and the failed starts and the
    death keep their GPUs, logs, diagnoses and exit statuses."""
    pytester.makeconftest(FAULTY_CONFTEST)
    pytester.makepyfile(FAULTY_SUITE)
    report, page = tmp_path / "report.json", tmp_path / "timeline.html"
    result = pytester.runpytest_subprocess(*SIM, *xdist, "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:2",
                                           "--sgl-report", str(report), "--sgl-timeline", str(page), timeout=240)
    summary = result.parseoutcomes()  # pytest's own summary line: "1 failed, 3 passed, 1 skipped, ... in 9.1s"
    assert summary == {"failed": 1, "passed": 3, "skipped": 1, "xfailed": 1, "errors": 3}, result.stdout.str()
    data = json.loads(report.read_text())
    counts = {k: v for k, v in data["outcomes"].items() if v}
    assert counts == summary
    outcome = {nodeid.split("::")[1].split("[")[0]: entry["outcome"] for nodeid, entry in data["tests"].items()}
    assert outcome == {"test_passes": "passed", "test_fails": "failed", "test_skips": "skipped",
                       "test_without_worker": "passed", "test_xfails": "xfailed", "test_oom": "error",
                       "test_dies": "error", "test_half_a_group": "error"}
    # the timeline's header says the same, and counts each test that used a worker once
    header = re.search(r'<div id="summary" class="summary" ([^>]*)>', page.read_text())
    assert header is not None
    shown = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', header.group(1)))
    assert {k: int(shown[k]) for k in summary} == summary
    assert shown["tests"] == "7"  # every test but test_without_worker; the group's test once for its two members

    launches = {r["label"]: [x for x in data["launches"] if x["label"] == r["label"]] for r in data["launches"]}
    spans = {t["nodeid"].split("::")[1].split("[")[0]: t["outcome"] for r in data["launches"] for t in r["tests"]}
    assert spans == {k: v for k, v in outcome.items() if k != "test_without_worker"}  # pytest's, not the call's
    # a failed start: on the GPU its lease gave it, with its own log, its diagnosis and its exit status
    (oom,) = launches["qwen3-0.6b env SGLSIM_FAULT=crash_oom"]
    assert oom["outcome"] == "startup_failed" and len(oom["gpus"]) == 1 and oom["gpu_names"]
    assert oom["diagnosis"].startswith("CUDA out of memory") and oom["exit_code"] == -9
    assert oom["failure"].startswith(f"worker qwen3-0.6b: {oom['diagnosis']} — exited during startup")
    assert Path(oom["log_path"]).is_file()
    assert [t["outcome"] for t in oom["tests"]] == ["error"]
    # a death during a passing call: its diagnosis and exit status; its test an error, as pytest says
    (dead,) = launches["qwen3-0.6b env SGLSIM_FAULT=die_after=1"]
    assert dead["outcome"] == "died" and "simulated death after 1 requests" in dead["diagnosis"]
    assert dead["exit_code"] == -9 and "exited with" in dead["failure"] and Path(dead["log_path"]).is_file()
    # the group: its member on GPU 1 failed with its own log and diagnosis, the other one is cancelled for it
    members = sorted(launches["qwen3-0.6b [2x]"], key=lambda r: r["gpus"])
    assert [m["gpus"] for m in members] == [[0], [1]]
    first, second = members
    assert second["outcome"] == "startup_failed" and second["diagnosis"].startswith("CUDA out of memory")
    assert second["exit_code"] == -9 and Path(second["log_path"]).is_file()
    assert first["outcome"] == "cancelled" and "member worker 1 of its group failed to start" in first["failure"]
    assert first["diagnosis"] is None and first["log_path"] != second["log_path"]
    # the per-configuration figures of the terminal summary agree: one failed test each
    workers = {w["label"]: w for w in data["workers"].values()}
    assert workers["qwen3-0.6b"]["failed_tests"] == 1  # test_fails (the skip and the xfail are not failures)
    for label in ("qwen3-0.6b env SGLSIM_FAULT=crash_oom", "qwen3-0.6b env SGLSIM_FAULT=die_after=1",
                  "qwen3-0.6b [2x]"):
        assert workers[label]["failed_tests"] == 1, label
