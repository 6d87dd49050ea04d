"""GPU budgeting across pytest-xdist, proven with real pytest sessions (issue 4).

Every inner session runs the simulated engine with ``SGLSIM_RECORD`` pointing at one file: each simulated
worker appends its ``start``/``ready``/``exit`` events there (pid, port, nccl_port, CUDA_VISIBLE_DEVICES,
tp_size, time). :func:`lifetimes` turns the file into live intervals and :func:`assert_exclusive` checks
that no GPU and no port was ever held by two live workers at once. A worker's recorded life lies inside its
GPU lease and its port block (leased before the process starts, released after it is gone), so an overlap
of recorded lives is a double booking.

Every process started here is gone at the end of each test (the leftover check in tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from worker_lives import Life, assert_exclusive, lifetimes, max_concurrency

from pytest_sglworker import LeaseTimeout
from pytest_sglworker.resources.gpus import DeclaredInventory, HolderRecord, LeaseManager, _record_path, _write_record
from pytest_sglworker.resources.processes import OWNER_ENV

SIM = ("-p", "no:cacheprovider", "--sgl-engine", "sim")
EXAMPLES = Path(__file__).resolve().parents[2] / "conftest_examples"


@pytest.fixture
def record(sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "sim-record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(path))
    return path


def _run(pytester: pytest.Pytester, *args: str, timeout: float = 120) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*SIM, *args, timeout=timeout)


def _outcome_line(result: pytest.RunResult) -> str:
    return result.stdout.lines[-1] if result.stdout.lines else "<no output>"


# --------------------------------------------------------------------------------------------------------
# 1. no GPU and no port is ever shared, with as many and with more xdist workers than configurations
# --------------------------------------------------------------------------------------------------------

THREE_CONFIGS = """
    import time
    import pytest

    SMALL = ["--mem-fraction-static", "0.5", "--max-total-tokens", "4096"]
    TIGHT = ["--mem-fraction-static", "0.4", "--max-total-tokens", "2048"]

    @pytest.mark.parametrize("i", range(4))
    def test_default(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200
        time.sleep(0.1)

    @pytest.mark.sgl_worker(args=SMALL)
    @pytest.mark.parametrize("i", range(4))
    def test_small(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200
        time.sleep(0.1)

    @pytest.mark.sgl_worker(args=TIGHT, fresh=True)
    @pytest.mark.parametrize("i", range(3))
    def test_tight_fresh(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200
        time.sleep(0.1)
"""


@pytest.mark.parametrize(("xdist_workers", "gpus", "dist"), [(2, 2, "load"), (4, 4, "load"), (2, 2, "loadscope")],
                         ids=["n2-sim2", "n4-sim4", "n2-sim2-loadscope"])
def test_xdist_workers_never_share_a_gpu_or_port(pytester: pytest.Pytester, record: Path, xdist_workers: int,
                                                   gpus: int, dist: str) -> None:
    pytester.makepyfile(THREE_CONFIGS)
    result = _run(pytester, "-n", str(xdist_workers), "--dist", dist, "--sgl-gpus", f"sim:{gpus}",
                  "--sgl-model", "qwen3-0.6b")
    result.assert_outcomes(passed=11)
    lives = lifetimes(record)
    assert_exclusive(lives, gpu_count=gpus)
    # every fresh test got its own worker
    assert Counter(life.fraction for life in served_lives(record, lives))[0.4] == 3
    assert max_concurrency(lives) >= 2, "the xdist workers never ran workers side by side"
    assert len({g for life in lives for g in life.gpus}) >= 2


# --------------------------------------------------------------------------------------------------------
# 2. more xdist workers than GPUs: they wait for a lease instead of failing
# --------------------------------------------------------------------------------------------------------


def test_xdist_workers_outnumbering_gpus_wait_for_a_lease(pytester: pytest.Pytester, record: Path,
                                                          tmp_path: Path) -> None:
    pytester.makepyfile("""
        import os
        import time
        from pathlib import Path

        import pytest

        @pytest.mark.sgl_worker(fresh=True)
        @pytest.mark.parametrize("i", range(6))
        def test_hold(sgl_worker, i):
            # the first test to get the only GPU, whichever it is, holds it until another xdist worker waits for it
            # (its waiter flag), however long a loaded machine takes to start the others; the rest hold it a moment.
            # (Test 0 held it so before: when another test leased first, the others could all be done before test 0
            # leased, and it waited for a waiter that never came, a minute.)
            locks = Path(os.environ["SGLWORKER_LOCK_DIR"])
            try:
                marker = Path(os.environ["SGLSIM_RECORD"]).parent / "first-holder"  # the test's own directory
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                first = True
            except FileExistsError:
                first = False
            deadline = time.monotonic() + (60 if first else 0.3)
            while time.monotonic() < deadline:
                if first and any(p.name.startswith("waiting-") and not p.name.startswith("waiting-ports-")
                                 for p in locks.iterdir()):
                    break
                time.sleep(0.02)
    """)
    report = tmp_path / "report.json"
    result = _run(pytester, "-n", "4", "--sgl-gpus", "sim:1", "--sgl-model", "qwen3-0.6b",
                  "--sgl-report", str(report))
    result.assert_outcomes(passed=6)
    lives = lifetimes(record)
    assert len(lives) == 6
    assert_exclusive(lives, gpu_count=1)
    assert max_concurrency(lives) == 1
    workers = json.loads(report.read_text())["workers"]
    assert sum(w["launches"] for w in workers.values()) == 6
    assert sum(w["lease_wait_seconds"] for w in workers.values()) > 0, workers


# --------------------------------------------------------------------------------------------------------
# 3. and 4. tensor parallelism: two GPUs per tp=2 worker; tp=4 on two GPUs is skipped at collection
# --------------------------------------------------------------------------------------------------------


def test_tp2_worker_gets_two_distinct_adjacent_gpus(pytester: pytest.Pytester, record: Path) -> None:
    pytester.makeconftest("""
        from pytest_sglworker import ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("tp2", "org/tp2", 4, tp=2))
    """)
    pytester.makepyfile("""
        import time
        import pytest

        @pytest.mark.parametrize("i", range(2))
        def test_shared(sgl_worker, i):
            assert "--tp-size" in sgl_worker.argv
            time.sleep(0.2)

        @pytest.mark.sgl_worker(fresh=True)
        @pytest.mark.parametrize("i", range(2))
        def test_fresh(sgl_worker, i):
            time.sleep(0.2)
    """)
    result = _run(pytester, "-n", "2", "--sgl-gpus", "sim:4", "--sgl-model", "tp2")
    result.assert_outcomes(passed=4)
    lives = lifetimes(record)
    assert lives
    assert all(life.tp_size == 2 for life in lives)
    assert_exclusive(lives, gpu_count=4)
    # adjacent, aligned pairs are preferred: with at most two leases out of four GPUs, always 0,1 or 2,3
    assert {frozenset(life.gpus) for life in lives} <= {frozenset({"0", "1"}), frozenset({"2", "3"})}


def test_tp_larger_than_the_inventory_is_skipped_at_collection(pytester: pytest.Pytester, record: Path) -> None:
    pytester.makeconftest("""
        from pytest_sglworker import ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("tp4", "org/tp4", 4, tp=4))
    """)
    pytester.makepyfile("""
        def test_needs_four(sgl_worker):
            raise AssertionError("must never run")

        def test_without_worker():
            pass
    """)
    result = _run(pytester, "-n", "2", "--sgl-gpus", "sim:2", "--sgl-model", "tp4", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*tp4: tp=4 needs 4 GPUs but the inventory has 2*"])
    assert lifetimes(record) == [], "a test that can never get its GPUs launched a worker"


# --------------------------------------------------------------------------------------------------------
# 5. an xdist worker killed while holding a worker: its lease is taken over, only once its engine is gone
# --------------------------------------------------------------------------------------------------------


class _DeathWatch:
    """Waits for ``info`` (written by the dying test: the pid of its simulated worker), then notes the time
    that worker is gone. It ignores SIGTERM, so it dies by SIGKILL and records no exit event of its own."""

    def __init__(self, info: Path) -> None:
        self.info = info
        self.pid: int | None = None
        self.gone_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and self.pid is None:
            try:
                self.pid = json.loads(self.info.read_text())["pid"]
            except (OSError, ValueError):
                time.sleep(0.02)
        while not self._stop.is_set() and self.pid is not None:
            try:
                alive = psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                self.gone_at = time.time()
                return
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_killed_xdist_worker_lease_is_taken_over_after_its_engine_is_gone(
    pytester: pytest.Pytester, record: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "dying.json"
    monkeypatch.setenv("DYING_INFO", str(info))
    pytester.makepyfile("""
        import json, os, time
        import pytest

        # First in the file, so that xdist hands it out first: the others queue for the only GPU meanwhile.
        # The engine ignores SIGTERM, like a real one slow to shut down: it outlives its xdist worker.
        @pytest.mark.sgl_worker(fresh=True, env={"SGLSIM_FAULT": "ignore_sigterm"})
        def test_dies_holding_the_gpu(sgl_worker):
            with open(os.environ["DYING_INFO"], "w") as fh:
                json.dump({"pid": sgl_worker.pid}, fh)
            time.sleep(0.5)
            os._exit(1)  # the xdist worker dies hard, its lease and its engine still out

        @pytest.mark.parametrize("i", range(4))
        def test_later(sgl_spawn_worker, i):
            deadline = time.monotonic() + 20  # ask for the GPU only once the dying test holds it: the
            while not os.path.exists(os.environ["DYING_INFO"]) and time.monotonic() < deadline:
                time.sleep(0.05)              # surviving xdist worker is then queued when the holder dies
            worker = sgl_spawn_worker()
            assert worker.client.get("/health").status_code == 200
    """)
    watch = _DeathWatch(info)
    try:
        result = _run(pytester, "-n", "2", "--sgl-gpus", "sim:1", "--sgl-model", "qwen3-0.6b")
    finally:
        watch.close()
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["*replacing crashed worker*", "*crashed while running*test_dies_holding_the_gpu*"])
    assert watch.pid is not None and watch.gone_at is not None, "the orphaned engine was never reaped"
    lives = lifetimes(record)
    orphan = next(life for life in lives if life.pid == watch.pid)
    assert orphan.end is None  # SIGKILLed by the watchdog or the janitor (it ignores SIGTERM)
    orphan.end = watch.gone_at
    assert_exclusive(lives, gpu_count=1)
    assert any(life.start > watch.gone_at for life in lives), "no later test got the GPU after the death"


def _environ(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def test_gpu_of_a_dead_holder_stays_busy_while_its_workers_run(tmp_path: Path) -> None:
    """The unit behind the test above: an unlocked GPU whose dead holder left a worker running is not free.

    The dead holder is one whose pid another process took since (the record predates that process's start):
    a holder that is a zombie or gone would make its planted worker fair game for the janitor of any other plugin
    session starting on this machine meanwhile (it reaps tagged workers of dead sessions machine-wide, as it
    should), and one did, in a loaded full run, between the two lease attempts below. A janitor leaves the
    workers of a pid that looks like a live pytest alone."""
    # The orphan starts first and takes the holder's tag by exec'ing itself (same pid, same start time), so that
    # it is older than the process now at the holder's pid, as a worker of the dead holder would be.
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; tag = sys.stdin.readline().strip(); os.execve(sys.executable, "
         f"[sys.executable, '-c', 'import time; time.sleep(60)'], {{**os.environ, {OWNER_ENV!r}: tag}})"],
        stdin=subprocess.PIPE, text=True)
    holder = None
    try:
        time.sleep(0.05)  # start times count clock ticks (10 ms): the holder's is 5 ticks later, checked below
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        holder_started = psutil.Process(holder.pid).create_time()
        assert holder_started > psutil.Process(orphan.pid).create_time()
        since = holder_started - 10  # the lease predates the process at its pid
        inventory = DeclaredInventory(3, 81920)
        manager = LeaseManager(tmp_path, inventory, namespace=inventory.namespace)
        _write_record(_record_path(tmp_path, inventory.namespace, 0), HolderRecord(
            pid=holder.pid, hostname=socket.gethostname(), holder="tests/x.py::killed", since=since,
            uuid="GPU-sim-000000000000", memory_mib=4096, index=0, namespace=inventory.namespace, gpus=(0,)))
        assert orphan.stdin is not None
        orphan.stdin.write(f"{holder.pid}-deadbeef:0123456789ab\n")
        orphan.stdin.close()
        deadline = time.monotonic() + 10
        while OWNER_ENV not in _environ(orphan.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert OWNER_ENV in _environ(orphan.pid)
        # GPU 0 is passed over for the next run (its lock of GPU 1 given back before that run is locked)
        other = manager.try_acquire(2, 1000, holder="me")
        assert other is not None and other.indices == (1, 2)
        try:
            assert manager.try_acquire(1, 1000, holder="me") is None
            with pytest.raises(LeaseTimeout, match=rf"GPU 0 still used by worker process\(es\) {orphan.pid} of "
                                                rf"pid {holder.pid}, which died"):
                manager.acquire(1, 1000, holder="me", timeout=0.2, poll_interval=0.05)
        finally:
            other.release()
        single = manager.try_acquire(1, 1000, holder="me")  # one GPU: the orphaned one is passed over too
        assert single is not None and single.indices == (1,)
        single.release()
    finally:
        for proc in (orphan, holder):
            if proc is not None:
                proc.kill()
                proc.wait()
    lease = manager.acquire(1, 1000, holder="me", timeout=5, poll_interval=0.05)
    assert lease.indices == (0,)
    lease.release()


# --------------------------------------------------------------------------------------------------------
# 6. two concurrent pytest sessions share the machine's GPUs and ports through the lock directory
# --------------------------------------------------------------------------------------------------------

# One worker at a time per test: a test that takes two workers one after the other (sgl_spawn_worker twice)
# in each of two sessions on two GPUs deadlocks, each holding one lease and waiting for the other's, until
# --sgl-lease-timeout.
SESSION_TESTS = """
    import time
    import pytest

    @pytest.mark.sgl_worker(fresh=True)
    @pytest.mark.parametrize("i", range(3))
    def test_fresh(sgl_worker, i):
        time.sleep(0.5)
"""


@pytest.fixture
def sessions() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_two_concurrent_sessions_share_gpus_through_the_lock_dir(
    pytester: pytest.Pytester, record: Path, sim_env: dict[str, str], sessions: list[subprocess.Popen[bytes]]
) -> None:
    pytester.makepyfile(test_a=SESSION_TESTS, test_b=SESSION_TESTS)
    outputs = []
    for name in ("a", "b"):
        out = pytester.path / f"session-{name}.out"
        outputs.append(out)
        with open(out, "wb") as fh:
            sessions.append(subprocess.Popen(
                [sys.executable, "-m", "pytest", f"test_{name}.py", *SIM, "--sgl-gpus", "sim:2",
                 "--sgl-model", "qwen3-0.6b", "--basetemp", str(pytester.path / f"basetemp-{name}")],
                cwd=pytester.path, stdout=fh, stderr=subprocess.STDOUT))
    codes = [proc.wait(timeout=120) for proc in sessions]
    texts = [out.read_text() for out in outputs]
    assert codes == [0, 0], "\n\n".join(texts)
    assert all("3 passed" in text for text in texts), "\n\n".join(texts)
    lives = lifetimes(record)
    assert len(lives) == 6
    assert_exclusive(lives, gpu_count=2)
    assert max_concurrency(lives) == 2, "the two sessions never held workers at the same time"


# --------------------------------------------------------------------------------------------------------
# 7. --dist loadgroup: each worker configuration is launched once in the whole run
# --------------------------------------------------------------------------------------------------------


def served_lives(record: Path, lives: list[Life]) -> list[Life]:
    """The lives of the simulated engines that became ready. A launch whose port was still bound (the launcher's
    documented retry: the engine logs the bind error and waits, the plugin ends it and launches again, and counts
    one launch) is a life that never became ready, ended by the plugin: asserted here, and left out. Full runs on 2
    busy CPUs met one in two of these tests."""
    ready = {event["pid"] for event in map(json.loads, record.read_text().splitlines()) if event["event"] == "ready"}
    assert all(life.exit_reason == "SIGTERM" for life in lives if life.pid not in ready), lives
    return [life for life in lives if life.pid in ready]


def test_loadgroup_launches_each_configuration_once(pytester: pytest.Pytester, record: Path,
                                                    tmp_path: Path) -> None:
    pytester.makepyfile("""
        import pytest

        A = ["--mem-fraction-static", "0.5"]
        B = ["--mem-fraction-static", "0.4"]

        # interleaved on purpose: the grouping, not the file order, keeps a configuration together
        @pytest.mark.parametrize("i", range(3))
        def test_default(sgl_worker, i):
            pass

        @pytest.mark.sgl_worker(args=A)
        @pytest.mark.parametrize("i", range(3))
        def test_a(sgl_worker, i):
            pass

        @pytest.mark.sgl_worker(args=B)
        @pytest.mark.parametrize("i", range(3))
        def test_b(sgl_worker, i):
            pass
    """)
    report = tmp_path / "report.json"
    result = _run(pytester, "-n", "2", "--dist", "loadgroup", "--sgl-gpus", "sim:4", "--sgl-model", "qwen3-0.6b",
                  "--sgl-report", str(report), "-v")
    result.assert_outcomes(passed=9)
    result.stdout.re_match_lines([r".*PASSED .*test_default.*@sgl-qwen3-0\.6b\s*$"])  # groups end in any order
    result.stdout.fnmatch_lines(["*PASSED*test_a*@sgl-qwen3-0.6b-*"])
    lives = lifetimes(record)
    assert Counter(life.fraction for life in served_lives(record, lives)) == {0.6: 1, 0.5: 1, 0.4: 1}
    assert_exclusive(lives, gpu_count=4)
    workers = json.loads(report.read_text())["workers"]
    assert sorted((w["launches"], w["reuses"]) for w in workers.values()) == [(1, 2)] * 3, workers


# --------------------------------------------------------------------------------------------------------
# The example suites, so that they never rot
# --------------------------------------------------------------------------------------------------------


def test_example_xdist_sharding(pytester: pytest.Pytester, record: Path, tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "xdist_sharding", pytester.path / "xdist_sharding")
    report = tmp_path / "report.json"
    result = _run(pytester, "xdist_sharding", "-n", "2", "--dist", "loadgroup", "--sgl-gpus", "sim:4",
                  "--sgl-model", "qwen3-0.6b", "--sgl-report", str(report))
    result.assert_outcomes(passed=8)
    workers = json.loads(report.read_text())["workers"]
    assert len(workers) == 3 and all(w["launches"] == 1 for w in workers.values()), workers
    assert_exclusive(lifetimes(record), gpu_count=4)


def test_example_other_repo_gpu_tests(pytester: pytest.Pytester, record: Path) -> None:
    shutil.copytree(EXAMPLES / "other_repo_gpu_tests", pytester.path / "other_repo_gpu_tests")
    result = _run(pytester, "other_repo_gpu_tests", "--sgl-model", "gateway-qwen3")
    result.assert_outcomes(passed=5)
    assert_exclusive(lifetimes(record), gpu_count=8)
