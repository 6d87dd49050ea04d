"""Worker groups as users meet them (``sgl_workers``): real pytest sessions against simulated engines on
loopback. Regular groups, prefill/decode pairs, data parallelism, leases and ports per member, pooling,
parallel starts, failures, deliberate stops, and every bad marker value. Every test is also checked for
leftover processes (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "-p", "no:cacheprovider"]


def _run(pytester: pytest.Pytester, *args: str, timeout: float = 120) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*SIM, *args, timeout=timeout)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every simulated engine appends its start/ready/exit events (port, CUDA_VISIBLE_DEVICES, time) here."""
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(path))
    return path


def test_regular_group_is_pooled_and_members_get_their_own_gpus_and_ports(
        pytester: pytest.Pytester, sim_env: dict[str, str], record: Path) -> None:
    pytester.makepyfile("""
        import pytest

        SEEN = []

        @pytest.mark.sgl_workers(count=3)
        def test_one(sgl_workers):
            assert len(sgl_workers) == 3 and len(sgl_workers.workers) == 3
            assert [w.role for w in sgl_workers] == ["worker"] * 3
            assert sgl_workers.prefill == [] and sgl_workers.decode == []
            assert len({w.port for w in sgl_workers}) == 3 and len({w.pid for w in sgl_workers}) == 3
            for w in sgl_workers:
                assert w.url == f"http://127.0.0.1:{w.port}"
                assert w.client.get("/health").status_code == 200
                assert "Uvicorn running" in w.log_tail()
            SEEN.append(sorted(w.pid for w in sgl_workers))

        @pytest.mark.sgl_workers(count=3)
        def test_two(sgl_workers):
            SEEN.append(sorted(w.pid for w in sgl_workers))
            assert SEEN[0] == SEEN[1]  # the same group, reused
    """)
    result = _run(pytester, "--sgl-gpus", "sim:4")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["qwen3-0.6b [[]3x[]]: 1 launched, 1 reused*"])
    starts = [e for e in _events(record) if e["event"] == "start"]
    assert len(starts) == 3
    assert sorted(e["cuda_visible_devices"] for e in starts) == ["0", "1", "2"]  # one GPU each, none shared
    assert len({e["port"] for e in starts}) == 3 and len({e["nccl_port"] for e in starts}) == 3


def test_members_start_in_parallel(pytester: pytest.Pytester, sim_env: dict[str, str], record: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(count=3, env={"SGLSIM_STARTUP_SECONDS": "2"})
        def test_group(sgl_workers):
            pass
    """)
    _run(pytester, "--sgl-gpus", "sim:3").assert_outcomes(passed=1)
    events = _events(record)
    starts = sorted(e["time"] for e in events if e["event"] == "start")
    readies = sorted(e["time"] for e in events if e["event"] == "ready")
    assert len(starts) == 3 and len(readies) == 3
    # every member was started before any of them was ready: the startups overlap instead of adding up
    assert starts[-1] < readies[0], (starts, readies)


def test_prefill_decode_pair(pytester: pytest.Pytester, sim_env: dict[str, str], record: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(prefill=2, decode=1, decode_args=["--max-running-requests", "8"])
        def test_pd(sgl_workers):
            assert [w.role for w in sgl_workers] == ["prefill", "prefill", "decode"]
            assert len(sgl_workers.prefill) == 2 and len(sgl_workers.decode) == 1
            for w in sgl_workers.prefill:
                argv = w.argv
                assert argv[argv.index("--disaggregation-mode") + 1] == "prefill"
                assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == str(w.bootstrap_port)
                assert w.bootstrap_port == w.ports["bootstrap"] and w.bootstrap_port not in (w.port, w.ports["nccl"])
                assert w.client.get("/server_info").json()["disaggregation_mode"] == "prefill"
            (decode,) = sgl_workers.decode
            assert decode.argv[decode.argv.index("--disaggregation-mode") + 1] == "decode"
            assert "--max-running-requests" in decode.argv and decode.bootstrap_port is None
            assert "--max-running-requests" not in sgl_workers.prefill[0].argv
            assert len({w.bootstrap_port for w in sgl_workers.prefill}) == 2
    """)
    result = _run(pytester, "--sgl-gpus", "sim:3")
    result.assert_outcomes(passed=1)
    assert sorted(e["cuda_visible_devices"] for e in _events(record) if e["event"] == "start") == ["0", "1", "2"]


def test_data_parallel_worker_leases_tp_times_dp_gpus(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                       record: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(args=["--dp-size", "2"])
        def test_dp(sgl_worker):
            assert sgl_worker.gpus == "0,1"

        @pytest.mark.sgl_worker(args=["--dp-size", "2", "--enable-dp-attention"])
        def test_dp_attention_stays_inside_tp(sgl_worker):
            assert len(sgl_worker.gpus.split(",")) == 1

        @pytest.mark.sgl_worker(args=["--dp-size", "8"])
        def test_too_big(sgl_worker):
            raise AssertionError("skipped at collection")
    """)
    result = _run(pytester, "--sgl-gpus", "sim:4", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*qwen3-0.6b: the worker leases 8 GPU(s) at once (tp x data-parallel "
                                 "replicas): tp=8 needs 8 GPUs but the inventory has 4*"])
    visible = [e["cuda_visible_devices"] for e in _events(record) if e["event"] == "start"]
    assert "0,1" in visible


def test_groups_the_inventory_can_never_hold_are_skipped_at_collection(
        pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makeconftest("""
        from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("tiny-tp2", "org/tiny", 4, tp=2))
    """)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(prefill=2, decode=2)
        def test_2p2d(sgl_workers):
            assert [len(w.gpus.split(",")) for w in sgl_workers] == [2, 2, 2, 2]
            assert len({g for w in sgl_workers for g in w.gpus.split(",")}) == 8
    """)
    on_8 = pytester.runpytest_subprocess("--sgl-engine", "sim", "--sgl-model", "tiny-tp2", "--sgl-gpus", "sim:8",
                                         "-p", "no:cacheprovider", timeout=120)
    on_8.assert_outcomes(passed=1)
    on_4 = pytester.runpytest_subprocess("--sgl-engine", "sim", "--sgl-model", "tiny-tp2", "--sgl-gpus", "sim:4",
                                         "-p", "no:cacheprovider", "-rs", timeout=120)
    on_4.assert_outcomes(skipped=1)
    on_4.stdout.fnmatch_lines(["*SKIPPED*tiny-tp2: the group 2P+2D leases 8 GPU(s) at once: tp=8 needs 8 GPUs but "
                               "the inventory has 4*"])
    assert "launched" not in on_4.stdout.str()


def test_a_member_that_fails_stops_the_others_and_is_named(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                            record: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(prefill=1, decode=1, env={"SGLSIM_STARTUP_SECONDS": "5"},
                                 decode_args=["--chunked-prefill-size", "not-a-number"])
        def test_pd(sgl_workers):
            raise AssertionError("never reached")
    """)
    result = _run(pytester, "--sgl-gpus", "sim:2", "--sgl-startup-timeout", "60")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*worker qwen3-0.6b (decode 0): sglang rejected the arguments* — exited during "
                                 "startup with code 2 after * s (on 127.0.0.1:*"])
    events = _events(record)
    # the prefill side (5 s startup) was stopped at once (or never started), not left to finish its startup
    assert not [e for e in events if e["event"] == "ready"], events
    started = {e["pid"] for e in events if e["event"] == "start"}
    assert started <= {e["pid"] for e in events if e["event"] == "exit"}, events


def test_deliberate_stops_are_not_deaths(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import signal
        import pytest

        @pytest.mark.sgl_workers(count=2)
        def test_stop_one(sgl_workers):
            sgl_workers[0].stop()
            assert not sgl_workers[0].is_alive() and sgl_workers[1].is_alive()

        @pytest.mark.sgl_workers(count=2)
        def test_kill_one_on_purpose(sgl_workers):
            sgl_workers[1].kill(signal.SIGKILL)
            sgl_workers[1].process.wait(10)

        def test_worker_stop(sgl_worker):
            sgl_worker.stop()
    """)
    result = _run(pytester, "--sgl-gpus", "sim:2", "--sgl-report", "report.json")
    result.assert_outcomes(passed=3)
    report = json.loads((pytester.path / "report.json").read_text())
    workers = report["workers"]
    assert sum(w["deaths"] for w in workers.values()) == 0, workers
    assert sum(w["stops"] for w in workers.values()) == 3, workers
    result.stdout.fnmatch_lines(["*[[]2x[]]: 2 launched*0 died, 2 stopped*"])
    assert {r["outcome"] for r in report["launches"]} >= {"stopped", "ok"}


def test_a_member_that_dies_during_a_test_fails_it(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import os, signal
        import pytest

        @pytest.mark.sgl_workers(count=2)
        def test_crash(sgl_workers):
            os.kill(sgl_workers[1].pid, signal.SIGKILL)
            sgl_workers[1].process.wait(10)

        @pytest.mark.sgl_workers(count=2)
        def test_next_gets_a_fresh_group(sgl_workers):
            assert all(w.is_alive() for w in sgl_workers)
    """)
    result = _run(pytester, "--sgl-gpus", "sim:2")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*worker qwen3-0.6b exited with code -9 (SIGKILL) during the test: this test killed "
                                 "it (os.kill(*, SIGKILL))*"])
    result.stdout.fnmatch_lines(["*[[]2x[]]: 2 launched, 0 reused*1 died*"])


@pytest.mark.parametrize(("marker", "message"), [
    ("count=0", "sgl_workers(count=0) asks for no worker"),
    ("count=-1", "sgl_workers(count=...) must be a whole number, got -1"),
    ("prefill=1", "needs count=N, or both prefill=P and decode=D"),
    ("count=2, prefill=1, decode=1", "takes count=N (regular workers) or prefill=P, decode=D, not both"),
    ("count=2, sizes=3", "sgl_workers got unknown argument(s) sizes"),
    ("count=2, prefill_args=['--x']", "sgl_workers(prefill_args=...) belong to a prefill/decode group"),
    ("count=True", "must be a whole number, got True"),
    ("prefill=1, decode=1, decode_args='--x'", "decode_args=...) must be a list of arguments"),
])
def test_bad_markers_are_errors_of_the_test(pytester: pytest.Pytester, sim_env: dict[str, str], marker: str,
                                            message: str) -> None:
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.sgl_workers({marker})
        def test_bad(sgl_workers):
            raise AssertionError("never reached")

        def test_unaffected():
            pass
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([f"*{message}*"])
    assert "INTERNALERROR" not in result.stdout.str() and "launched" not in result.stdout.str()


def test_role_args_that_loosen_the_budget_stop_the_session(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(prefill=1, decode=1, prefill_args=["--mem-fraction-static", "0.9"])
        def test_pd(sgl_workers):
            raise AssertionError("never reached")
    """)
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*test test_role_args_that_loosen_the_budget_stop_the_session.py::test_pd*prefill_args=*0.9*) breaks "
        "the mandatory worker budget:",
        "*--mem-fraction-static: 0.9 is above the budget of 0.6",
        "*fix: drop the args that loosen the budget, or add @pytest.mark.sgl_budget_opt_out*",
    ])
    assert not list(Path(sim_env["SGLWORKER_LOG_DIR"]).glob("*.log"))  # nothing launched


def test_a_test_blocked_by_its_own_workers_fails_at_once(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("""
        def test_two_on_one_gpu(sgl_worker, sgl_spawn_worker):
            sgl_spawn_worker()
    """)
    result = _run(pytester, "--sgl-gpus", "sim:1", "--sgl-lease-timeout", "600", timeout=60)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*needs 1 GPU(s), but this process's own workers in use hold 1 of the 1 GPU(s)*"
                                 "waiting would last until --sgl-lease-timeout*"])
