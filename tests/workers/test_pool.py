"""Unit tests of :class:`pytest_sglworker.workers.pool.WorkerPool` without pytest sessions: the pool driven directly,
over real simulated engines and real file-locked leases of a declared inventory in a private directory."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sglworker import ModelSpec
from pytest_sglworker.errors import LeaseImpossible
from pytest_sglworker.resources.gpus import DeclaredInventory, LeaseManager
from pytest_sglworker.workers.config import GroupShape, WorkerConfig
from pytest_sglworker.workers.errors import LaunchError, WorkerStartupError
from pytest_sglworker.workers.launcher import LaunchOptions, sim_launcher
from pytest_sglworker.workers.pool import WorkerPool

QWEN = ModelSpec("qwen3-0.6b", "Qwen/Qwen3-0.6B", 4)


@pytest.fixture
def make_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:  # type: ignore[type-arg]
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "0.2")
    pools: list[WorkerPool] = []

    def make(gpus: int = 2, **kwargs) -> WorkerPool:  # type: ignore[no-untyped-def]
        lock_dir = tmp_path / "locks"
        leases = LeaseManager(lock_dir, DeclaredInventory(gpus, 80 * 1024), namespace=f"sim-{gpus}x80")
        options = LaunchOptions(launcher=tuple(sim_launcher()), log_dir=tmp_path / "logs", lock_dir=lock_dir,
                                startup_timeout=60)
        messages: list[str] = []
        pool = WorkerPool(options, leases=leases, lease_timeout=5, on_message=messages.append, release_wait=5,
                          **kwargs)
        pool.messages = messages  # type: ignore[attr-defined]
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def test_reuse_by_configuration_and_fresh_groups(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    config = WorkerConfig.of(QWEN)
    first = pool.acquire(config, holder="t1")
    pool.release(first)
    again = pool.acquire(config, holder="t2")
    assert again is first and again[0].is_alive()
    pool.release(again)
    other = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "512"]), holder="t3")
    assert other is not first
    fresh = pool.acquire(config, holder="t4", fresh=True)
    assert fresh is not first  # fresh: never the pooled one, never pooled after
    pool.release(fresh)
    assert fresh not in pool.groups() and not fresh[0].is_alive()
    stats = pool.stats[config.key]
    assert (stats.launches, stats.reuses) == (2, 1)


def test_idle_groups_are_evicted_lru_for_a_lease(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(gpus=2)
    a = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), holder="a")
    b = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "512"]), holder="b")
    pool.release(a)
    pool.release(b)
    c = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "1024"]), holder="c")
    assert not a[0].is_alive() and b[0].is_alive()  # the least recently used went first
    assert any("evicting idle worker qwen3-0.6b" in m for m in pool.messages)
    assert c[0].gpus == a[0].gpus


def test_dead_and_frozen_idle_workers_are_replaced(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    config = WorkerConfig.of(QWEN)
    group = pool.acquire(config, holder="t1")
    pool.release(group)
    os.kill(group[0].pid, signal.SIGKILL)
    group[0].process.wait(10)
    replacement = pool.acquire(config, holder="t2")
    assert replacement is not group and replacement[0].is_alive()
    assert any("died while idle in the pool; replacing it" in m for m in pool.messages)
    pool.release(replacement)
    os.kill(replacement[0].pid, signal.SIGSTOP)
    third = pool.acquire(config, holder="t3")
    assert third is not replacement and not replacement[0].is_alive()
    assert any("does not answer its health check (frozen or wedged)" in m for m in pool.messages)
    # the frozen one was stopped in order: it shut down on SIGTERM (exit 0), not killed (that a stopped tree gets
    # SIGCONT with its SIGTERM, so that its grace is not sat out, is held by tests/resources/test_reaper.py)
    assert replacement[0].process.returncode == 0, replacement[0].process.returncode
    assert pool.stats[config.key].deaths == 1  # the killed one; the frozen one was replaced, not dead


def test_a_group_leases_all_its_gpus_at_once_and_splits_them(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(gpus=4)
    config = WorkerConfig.of(QWEN, group=GroupShape(prefill=1, decode=1))
    group = pool.acquire(config, holder="pd")
    assert [m.role for m in group] == ["prefill", "decode"]
    assert [m.gpus for m in group] == ["0", "1"]
    assert group.prefill[0].bootstrap_port is not None
    held = pool.leases.holders()
    assert sorted(held) == [0, 1] and {r.holder for r in held.values()} == {"pd"}
    records = [r for r in pool.launches if r.group == group.id]
    assert [r.role for r in records] == ["prefill", "decode"] and all(r.t_ready for r in records)


def test_a_failing_member_fails_the_group_and_frees_everything(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(gpus=2)
    config = WorkerConfig.of(QWEN, ["--chunked-prefill-size", "nope"], group=GroupShape(count=2))
    with pytest.raises(WorkerStartupError, match="exited during startup with code 2"):
        pool.acquire(config, holder="bad")
    assert pool.groups() == [] and pool.leases.holders() == {}
    assert pool.stats[config.key].failures == 1
    # each member's own end: a member that failed, its own diagnosis and log on its own GPU; one stopped because
    # the other failed first, cancelled (both bad args: either may be first, or both fail on their own)
    records = pool.launches
    assert [r.gpus for r in records] == [[0], [1]]
    assert "startup_failed" in {r.outcome for r in records} <= {"startup_failed", "cancelled"}
    for record in records:
        if record.outcome == "startup_failed":
            assert record.exit_code == 2 and record.log_path and record.diagnosis and record.failure
        else:
            assert record.failure is not None and "of its group failed to start" in record.failure


def test_a_request_its_own_workers_block_fails_at_once(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(gpus=1)
    pool.acquire(WorkerConfig.of(QWEN), holder="first")
    asked: list[object] = []
    acquire = pool.leases.acquire

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(args)
        return acquire(*args, **kwargs)

    pool.leases.acquire = spy  # type: ignore[method-assign]
    with pytest.raises(LeaseImpossible, match="this process's own workers in use hold 1 of the 1 GPU"):
        pool.acquire(WorkerConfig.of(QWEN), holder="second", fresh=True)
    assert asked == []  # failed before asking for the lease: no wait for the 5 s lease timeout


def test_deliberate_stops_and_deaths_are_told_apart(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(gpus=2)
    config = WorkerConfig.of(QWEN, group=GroupShape(count=2))
    group = pool.acquire(config, holder="t")
    group[0].stop()
    os.kill(group[1].pid, signal.SIGKILL)
    group[1].process.wait(10)
    pool.discard(group)
    stats = pool.stats[config.key]
    assert (stats.stops, stats.deaths) == (1, 1)
    assert sorted(r.outcome for r in pool.launches) == ["died", "stopped"]


def test_a_failing_member_gets_the_memory_ledger_of_its_own_args(make_pool) -> None:  # type: ignore[no-untyped-def]
    """A decode member whose own args leave no memory for the KV pool: the ledger attached to its failure is
    the decode side's (its mode, its role's fraction), not that of the group's shared args."""
    pool = make_pool(gpus=2)
    config = WorkerConfig.of(QWEN, group=GroupShape(prefill=1, decode=1, role_args=(
        ("decode", ("--mem-fraction-static", "0.005")),)))
    with pytest.raises(WorkerStartupError) as info:
        pool.acquire(config, holder="pd")
    ledger = info.value.ledger
    assert ledger is not None
    assert (ledger.mode, ledger.mem_fraction_static) == ("decode", 0.005)
    assert ledger.kv_tokens == 0
    assert pool.groups() == [] and pool.leases.holders() == {}


def test_a_failed_launch_ahead_called_off_is_not_the_failure_of_the_test_that_called_it_off(
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """On one GPU a launch ahead of B holds the lease and then fails (here: its worker_env hook raises once it is
    called off). The test that needs the GPU now calls it off and gets its own worker; B's failure is met by the
    test that needs B, when it launches B itself."""
    aheads: list = []  # type: ignore[type-arg]

    def worker_env(spec: ModelSpec, lease_env: dict[str, str]) -> dict[str, str]:
        if threading.current_thread().name.startswith("sglworker-ahead"):
            deadline = time.monotonic() + 10
            while not aheads and time.monotonic() < deadline:  # the test has not picked it up yet
                time.sleep(0.01)
            aheads[0].cancel.wait(10)  # holds the lease until called off
            raise LaunchError("B's launch ahead broke")
        if os.environ.get("B_BROKEN") == "1":
            raise LaunchError("B is broken")
        return lease_env

    pool = make_pool(gpus=1, worker_env=worker_env)
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    assert pool.launch_ahead(b, holder="ahead")
    aheads.append(pool._ahead[b])
    group = pool.acquire(a, holder="needs the GPU now")  # called B off: not B's failure
    assert group[0].is_alive()
    pool.release(group)
    monkeypatch.setenv("B_BROKEN", "1")
    with pytest.raises(LaunchError, match="B is broken"):
        pool.acquire(b, holder="needs B")


def _faults(worker) -> dict:  # type: ignore[no-untyped-def]
    import httpx

    return httpx.get(f"{worker.url}/_sim/faults", timeout=5).json()["faults"]


def _set_faults(worker, **faults) -> None:  # type: ignore[no-untyped-def]
    import httpx

    resp = httpx.post(f"{worker.url}/_sim/faults", json=faults, timeout=5)
    assert resp.status_code == 200, resp.text


def test_runtime_faults_a_test_switched_on_are_set_back_before_the_next_test(  # type: ignore[no-untyped-def]
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLSIM_FAULT", "latency=0.01")  # a fault from the launch: part of what it was
    pool = make_pool()
    config = WorkerConfig.of(QWEN)
    group = pool.acquire(config, holder="t1")
    launched = _faults(group[0])
    assert launched["latency"] == 0.01
    _set_faults(group[0], fail_first=3, status=503, latency=None)
    pool.release(group)
    again = pool.acquire(config, holder="t2")
    assert again is group and _faults(again[0]) == launched  # reused, as it was handed out
    pool.release(again)  # this test changed nothing: nothing to set back
    stats = pool.stats[config.key]
    assert (stats.reuses, stats.resets, stats.not_reset) == (1, 1, 0)


def test_a_worker_whose_faults_cannot_be_set_back_is_not_reused(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    config = WorkerConfig.of(QWEN)
    group = pool.acquire(config, holder="t1")
    _set_faults(group[0], hang_requests=True)
    # a control endpoint that answers what it is asked but keeps the fault: what the pool finds after it sets back
    from pytest_sglworker.workers import reset

    original = reset.SimFaults.write
    reset.SimFaults.write = lambda self, worker, state: None  # type: ignore[method-assign]
    try:
        pool.release(group)
    finally:
        reset.SimFaults.write = original  # type: ignore[method-assign]
    assert not group[0].is_alive()
    assert any("is not reused: what the test changed in it could not be set back (runtime faults still differ" in m
               for m in pool.messages)
    fresh = pool.acquire(config, holder="t2")
    assert fresh is not group and _faults(fresh[0])["hang_requests"] is False
    stats = pool.stats[config.key]
    assert (stats.launches, stats.resets, stats.not_reset) == (2, 0, 1)


def test_requests_served_counts_a_workers_inference_requests_from_its_log(  # type: ignore[no-untyped-def]
        make_pool) -> None:
    import httpx

    pool = make_pool()
    group = pool.acquire(WorkerConfig.of(QWEN), holder="t1")
    worker = group[0]
    assert worker.requests_served() == 0  # its own warm-up request comes before its ready line
    for i in range(3):
        assert httpx.post(f"{worker.url}/generate", json={"text": f"hi {i}", "sampling_params": {"max_new_tokens": 1}},
                          timeout=10).status_code == 200
    assert httpx.post(f"{worker.url}/v1/chat/completions", json={
        "model": QWEN.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=10).is_success
    httpx.get(f"{worker.url}/health", timeout=10)  # not an inference request
    _set_faults(worker, fail_first=1)
    assert httpx.post(f"{worker.url}/generate", json={"text": "x"}, timeout=10).status_code == 500  # not served

    def counted() -> int:
        deadline = time.monotonic() + 10  # the access line follows the answer
        while (n := worker.requests_served()) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        return n

    assert counted() == 4
    assert worker._served is not None and worker._served.refused == {"/generate": 1}


def _another_process_waits(lock_dir: Path, gpus: int) -> None:
    """Flag a live process other than this one (our parent) as waiting for a lease of the pool's inventory."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    (lock_dir / f"waiting-sim-{gpus}x80-{os.getppid()}").touch()


def test_while_another_process_waits_only_the_group_the_next_test_needs_stays_pooled(  # type: ignore[no-untyped-def]
        make_pool, tmp_path: Path) -> None:
    """Another process waits for a GPU: a group the next test needs stays pooled (given back, it would be launched
    again at once); every other idle group goes back to the waiter after the test, not only the one released."""
    pool = make_pool(gpus=3)
    first, needed, other = (WorkerConfig.of(QWEN, ["--max-total-tokens", str(n)]) for n in (256, 512, 1024))
    a = pool.acquire(first, holder="a")
    b = pool.acquire(needed, holder="b")
    pool.release(a)  # pooled: nobody waits yet
    _another_process_waits(tmp_path / "locks", 3)
    pool.release(b, needed_next=True)
    assert b in pool.groups() and b[0].is_alive()
    pool.yield_idle(keep=needed)
    assert a not in pool.groups()  # idle, no known use: the waiter's now (retired off the main thread)
    pool._join_retiring()
    assert not a[0].is_alive()
    assert b[0].is_alive() and pool.acquire(needed, holder="b2") is b
    c = pool.acquire(other, holder="c")
    pool.release(c)
    assert not c[0].is_alive()  # not needed next while someone waits: retired, as before
    assert pool.stats[needed.key].launches == 1


SUITE_NEXT_TEST = '''
import pytest

@pytest.mark.sgl_worker(args=["--max-total-tokens", "512"])
@pytest.mark.parametrize("i", range(3))
def test_a(sgl_worker, i):
    pass

@pytest.mark.sgl_worker(args=["--max-total-tokens", "1024"])
def test_b(sgl_worker):
    pass
'''


def test_a_session_keeps_the_group_its_next_test_needs_while_another_process_waits(
        pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """Through the fixtures: with another process waiting for a GPU all along, the three tests of one
    configuration share one launch (each test's give-back knows the next test's configuration)."""
    _another_process_waits(Path(sim_env["SGLWORKER_LOCK_DIR"]), 2)
    pytester.makepyfile(test_suite=SUITE_NEXT_TEST)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "--sgl-engine", "sim",
                                           "--sgl-gpus", "sim:2", "--sgl-model", "qwen3-0.6b", "--sgl-report",
                                           str(report), timeout=120)
    result.assert_outcomes(passed=4)
    launches = {w["label"]: w["launches"] for w in json.loads(report.read_text())["workers"].values()}
    assert launches == {"qwen3-0.6b --max-total-tokens 512": 1, "qwen3-0.6b --max-total-tokens 1024": 1}, launches


def test_a_process_that_comes_to_wait_during_a_startup_gets_the_idle_groups(  # type: ignore[no-untyped-def]
        make_pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle group is given back to a process that starts waiting for a GPU while this one starts another
    configuration (a startup of seconds: nothing else would hand it back before the next test's end)."""
    pool = make_pool(gpus=4)
    idle = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), holder="a")
    pool.release(idle)
    _another_process_waits(tmp_path / "locks", 4)
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.5")  # the launch's wait looks every YIELD_EVERY_S
    started = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "512"]), holder="b")
    assert started[0].is_alive() and not idle[0].is_alive() and idle not in pool.groups()
    # a group's members start on threads of their own; the main thread looks while it waits for them
    pool.release(started, needed_next=True)
    group = pool.acquire(WorkerConfig.of(QWEN, group=GroupShape(prefill=1, decode=1)), holder="pd")
    assert group.is_alive() and not started[0].is_alive() and started not in pool.groups()


def test_while_a_launch_ahead_finishes_the_idle_groups_of_finished_configurations_go(  # type: ignore[no-untyped-def]
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An xdist worker whose next test waits for the group it launched ahead lets go, meanwhile, the idle groups of
    the configurations the controller says no later test takes (their GPUs serve a launch elsewhere): at once, not
    when the launch ahead is ready."""
    done: set[str] = set()
    pool = make_pool(gpus=4, finished=lambda: frozenset(done))
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    first = pool.acquire(a, holder="a")
    pool.release(first)
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "2")
    assert pool.launch_ahead(b, holder="ahead")
    done.add(a.key)  # the controller's word: a's tests have all run
    group = pool.acquire(b, holder="b")
    assert group[0].is_alive() and not first[0].is_alive() and first not in pool.groups()
    by_config = {r.config: r for r in pool.records.launches}
    stopped, ready = by_config[a.key].t_stop_requested, by_config[b.key].t_ready
    assert stopped is not None and ready is not None
    assert stopped < ready - 1.0, (stopped, ready)  # let go while b still had most of its 2 s startup to go


def test_while_a_test_s_own_launch_starts_the_session_follows_the_controller(  # type: ignore[no-untyped-def]
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the main thread waits for a test's own single-member startup it asks the session (``follow``), about
    every 0.1 s, for what the xdist controller said meanwhile: a launch ahead told then starts at once, not after
    that startup and the test (issue 43)."""
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    asked: list[str] = []

    def follow(waiting: WorkerConfig) -> None:
        asked.append(waiting.key)
        if len(asked) == 1:
            assert pool.launch_ahead(b, holder="ahead")

    pool = make_pool(gpus=4, follow=follow)
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.5")
    group = pool.acquire(a, holder="a")
    assert group[0].is_alive() and set(asked) == {a.key}
    by_config = {r.config: r for r in pool.records.launches}
    requested, ready = by_config[b.key].t_lease_requested, by_config[a.key].t_ready
    assert requested is not None and ready is not None and requested < ready
    pool.release(group)
    assert pool.acquire(b, holder="b")[0].is_alive() and pool.stats[b.key].launches == 1


def test_a_group_launched_ahead_is_evicted_last(make_pool) -> None:  # type: ignore[no-untyped-def]
    """Idle groups go least recently used first to make room for a lease, but a group launched ahead that no test has
    used yet goes last: a coming test needs it (it is older than a group a test just gave back)."""
    pool = make_pool(gpus=2)
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    assert pool.launch_ahead(b, holder="ahead")
    pool._ahead[b].thread.join(30)  # ready and idle before a is given back
    first = pool.acquire(a, holder="a")
    pool.release(first)
    c = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "1024"]), holder="c")
    assert c[0].is_alive() and not first[0].is_alive()
    ahead = pool.acquire(b, holder="b")  # the group launched ahead, not a launch of its own
    assert pool.stats[b.key].launches == 1 and ahead[0].is_alive()


class _Word:
    """The xdist controller's word about one group handed over within the run, to the giver (``giver``) or to the
    taker; the giver's answers are the taker's to read."""

    def __init__(self, key: str, answers: dict[str, bool], *, giver: bool) -> None:
        self.key, self.answers, self.giver = key, answers, giver

    def to_hand_over(self) -> tuple[str, ...]:
        return (self.key,) if self.giver else ()

    def answer(self, key: str, published: bool) -> None:
        self.answers[key] = published

    def expects(self, key: str) -> bool:
        return not self.giver and key == self.key

    def awaited(self, key: str) -> bool | None:
        return self.answers.get(key)


def _giver_and_taker(make_pool, tmp_path: Path, config: WorkerConfig,  # type: ignore[no-untyped-def]
                     answers: dict[str, bool]) -> tuple[WorkerPool, WorkerPool]:
    """Two pools of one run, as two xdist workers: the giver launched ``config`` ahead, the controller sent its tests
    to the taker."""
    import psutil

    from pytest_sglworker.resources.processes import SESSION_ID
    from pytest_sglworker.resources.warm_records import Party
    from pytest_sglworker.workers.warm import Warm, WarmSettings

    run = Party(os.getpid(), psutil.Process().create_time(), SESSION_ID, "the xdist controller")

    def pool_of(name: str) -> WorkerPool:
        pool: WorkerPool = make_pool(gpus=2, handover=_Word(config.key, answers, giver=name == "giver"))
        pool.warm = Warm(WarmSettings(lock_dir=tmp_path / "locks", log_dir=tmp_path / "logs",
                                      options=pool.options, holder=name, run=run), pool.leases, pool.records)
        return pool

    return pool_of("giver"), pool_of("taker")


def _exited(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_giver_let_go_while_its_promised_launch_starts_hands_it_over_once_ready(
        make_pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The controller promised a group one xdist worker launched ahead to another, then let the first go (it had no
    test left) while that group still started: the giver's session end waits for it and hands it over, not cancels
    it, so the taker adopts it instead of launching it again, its whole startup later."""
    config = WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    answers: dict[str, bool] = {}
    giver, taker = _giver_and_taker(make_pool, tmp_path, config, answers)
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.5")
    assert giver.launch_ahead(config, holder="ahead")
    assert giver._ahead[config].thread.is_alive()  # still starting when its xdist worker is let go
    giver.close()
    assert answers == {config.key: True}  # handed over once ready
    group = taker.acquire(config, holder="taker")
    assert group[0].is_alive() and taker.stats[config.key].launches == 0  # adopted, not launched again
    pid = group[0].pid
    taker.release(group)
    taker.close()
    _until(lambda: _exited(pid), f"engine {pid} to end")


def test_a_ready_group_promised_elsewhere_is_handed_over_from_another_thread(
        make_pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The follower's part (issue 43): from another thread, while the giver's main thread runs a test, a ready group it
    launched ahead and the controller promised to another xdist worker goes to the run at once, and the taker adopts
    it; while the group still starts, or while the main thread is at work on the entries, the thread leaves it alone.
    The main thread's own pass then has nothing left to do."""
    config = WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    answers: dict[str, bool] = {}
    giver, taker = _giver_and_taker(make_pool, tmp_path, config, answers)
    monkeypatch.setenv("SGLSIM_STARTUP_SECONDS", "1.0")
    assert giver.launch_ahead(config, holder="ahead")
    _in_thread(lambda: giver.hand_over_ready((config.key,)))  # still starting
    assert answers == {}
    giver._ahead[config].thread.join(30)
    with giver._at_work_on():
        _in_thread(lambda: giver.hand_over_ready((config.key,)))
    assert answers == {}
    _in_thread(lambda: giver.hand_over_ready((config.key,)))
    assert answers == {config.key: True}
    assert [r.outcome for r in giver.launches] == ["handed_over"]
    giver.hand_over_ahead()  # between its tests: answered already, nothing retired
    assert answers == {config.key: True} and giver.messages == []
    group = taker.acquire(config, holder="taker")
    assert group[0].is_alive() and taker.stats[config.key].launches == 0  # adopted, not launched again
    pid = group[0].pid
    assert not giver.launch_ahead(config, holder="ahead")  # handed over: not launched ahead again here
    taker.release(group)
    taker.close()
    giver.close()
    _until(lambda: _exited(pid), f"engine {pid} to end")


def test_a_hand_over_from_another_thread_that_fails_is_left_to_the_main_thread(
        make_pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A hand-over the follower cannot make puts the group back, answers nothing and is not tried again from a thread:
    the main thread tries it once more, then retires it and answers "no" (the taker launches its own), and says what
    went wrong, on its own thread."""
    config = WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    answers: dict[str, bool] = {}
    giver, _ = _giver_and_taker(make_pool, tmp_path, config, answers)
    assert giver.warm is not None
    threads: list[str] = []

    def refuse(request, *, say=None) -> bool:  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        (say or giver.on_message)("the keeper is gone")
        return False

    monkeypatch.setattr(giver.warm, "publish", refuse)
    assert giver.launch_ahead(config, holder="ahead")
    giver._ahead[config].thread.join(30)
    pid = next(iter(giver._idle.values())).group[0].pid
    _in_thread(lambda: giver.hand_over_ready((config.key,)))
    _in_thread(lambda: giver.hand_over_ready((config.key,)))  # not tried again from a thread: the main thread's now
    assert answers == {} and giver.messages == [] and len(giver._idle) == 1  # back in the pool, nothing said yet
    assert len(threads) == 1
    giver.hand_over_ahead()  # between its tests: tried once more, then retired
    assert answers == {config.key: False} and giver._idle == {}
    assert threads[0] != threading.current_thread().name and threads[1] == threading.current_thread().name
    giver._flush_retired()
    assert giver.messages == ["the keeper is gone", "the keeper is gone"]
    _until(lambda: _exited(pid), f"engine {pid} to end")


# -- a launch ahead started from another thread (an xdist worker's follower of the controller, issue 43) -------------
def _kit(pool: WorkerPool, config: WorkerConfig):  # type: ignore[no-untyped-def]
    from pytest_sglworker.workers.process import inherited_environ

    return pool.ahead_kit(config, holder="ahead", environ=inherited_environ(), worker_env=lambda spec, env: dict(env))


def _in_thread(call):  # type: ignore[no-untyped-def]
    """``call()`` on a thread of its own (as the follower makes it), its result."""
    result: list = []  # type: ignore[type-arg]
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and result
    return result[0]


def test_a_launch_ahead_from_another_thread_starts_what_the_main_thread_worked_out(make_pool) -> None:  # type: ignore[no-untyped-def]
    """Started from another thread with the kit the main thread made: once per configuration, on the free GPU, and
    the test that needs it gets it as its launch (not a reuse)."""
    pool = make_pool(gpus=2)
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    group_a = pool.acquire(a, holder="a")
    kit = _kit(pool, b)
    assert _in_thread(lambda: pool.launch_ahead_kit(kit)) is True
    assert _in_thread(lambda: pool.launch_ahead_kit(kit)) is False  # launching already: never twice
    group_b = pool.acquire(b, holder="needs B")
    assert group_b[0].gpus == "1" and group_a[0].gpus == "0"
    assert (pool.stats[b.key].launches, pool.stats[b.key].reuses) == (1, 0)
    assert _in_thread(lambda: pool.launch_ahead_kit(kit)) is False  # its group is here


def test_no_launch_ahead_of_a_configuration_whose_last_test_here_has_run(make_pool) -> None:  # type: ignore[no-untyped-def]
    """The group of A goes after its last test here; a launch ahead of A read from a word that still names it (the
    controller has not heard yet that the test ran) starts nothing, from any thread, until a test acquires A again
    (a test run again after a crash elsewhere), which launches it as usual. Seen: a third engine, launched after
    the last test of its configuration and stopped unused at the session's end."""
    pool = make_pool(gpus=2)
    a = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"])
    kit = _kit(pool, a)
    group = pool.acquire(a, holder="a")
    pool.finish(a.key)
    pool.discard(group, failed=False)
    pool._join_retiring()
    assert _in_thread(lambda: pool.launch_ahead_kit(kit)) is False
    assert pool.launch_ahead(a, holder="ahead") is False
    assert [r.config for r in pool.launches] == [a.key] and pool.leases.holders() == {}
    again = pool.acquire(a, holder="a, run again")
    assert again[0].is_alive() and pool.stats[a.key].launches == 2
    pool.release(again)
    pool.retire_idle((a.key,))
    pool._join_retiring()
    assert _in_thread(lambda: pool.launch_ahead_kit(kit)) is True  # acquired again: no longer finished


def test_a_launch_ahead_from_another_thread_waits_for_a_free_gpu_without_starting_anything(
        make_pool) -> None:  # type: ignore[no-untyped-def]
    """No free GPU: nothing starts (no keeper, no lease, no record), and the same kit starts once the GPU is free."""
    pool = make_pool(gpus=1)
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    group_a = pool.acquire(a, holder="a")
    kit = _kit(pool, b)
    assert _in_thread(lambda: pool.launch_ahead_kit(kit)) is False
    assert [r.config for r in pool.launches] == [a.key] and sorted(pool.leases.holders()) == [0]
    pool.discard(group_a, failed=False)
    pool._join_retiring()  # retired off the main thread: its GPU is free once that ends (the follower polls)
    assert _in_thread(lambda: pool.launch_ahead_kit(kit)) is True
    group_b = pool.acquire(b, holder="needs B")
    assert group_b[0].is_alive() and pool.stats[b.key].launches == 1


def test_a_launch_ahead_from_another_thread_leaves_alone_what_the_main_thread_acquires(
        make_pool) -> None:  # type: ignore[no-untyped-def]
    """While the main thread launches B for its test, a launch ahead from another thread starts nothing: not B (one
    launch of B, not two), nor C on a GPU B's launch may yet need (it would be called off); after close() has
    begun, none starts at all."""
    answers: list[bool] = []
    box: dict = {}  # type: ignore[type-arg]

    def follow(config: WorkerConfig) -> None:  # the main thread, each tick of its own launch of B
        if not answers:
            answers.append(_in_thread(lambda: box["pool"].launch_ahead_kit(box["kit"])))
            answers.append(_in_thread(lambda: box["pool"].launch_ahead_kit(box["kit_c"])))

    pool = make_pool(gpus=3, follow=follow)
    b, c = WorkerConfig.of(QWEN, ["--max-total-tokens", "512"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "1024"])
    box.update(pool=pool, kit=_kit(pool, b), kit_c=_kit(pool, c))
    group = pool.acquire(b, holder="needs B")
    assert answers == [False, False] and group[0].is_alive()
    assert pool.stats[b.key].launches == 1 and len(pool.launches) == 1
    kit_c = box["kit_c"]
    assert _in_thread(lambda: pool.launch_ahead_kit(kit_c)) is True  # the main thread is in its test now
    pool.close()
    c2 = WorkerConfig.of(QWEN, ["--max-total-tokens", "2048"])
    kit_c = _kit(pool, c2)
    assert _in_thread(lambda: pool.launch_ahead_kit(kit_c)) is False
    assert pool.groups() == [] and not group[0].is_alive() and pool.leases.holders() == {}


def test_a_launch_ahead_from_another_thread_leaves_alone_a_group_the_main_thread_gives_back(
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A group given back is in none of the pool's entries while what its test changed is set back: a launch ahead of
    its configuration from another thread then would launch it a second time."""
    pool = make_pool(gpus=2)
    b = WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    group = pool.acquire(b, holder="b")
    kit, answers = _kit(pool, b), []
    set_back = pool._set_back

    def setting_back(entry):  # type: ignore[no-untyped-def]
        answers.append(_in_thread(lambda: pool.launch_ahead_kit(kit)))
        return set_back(entry)

    monkeypatch.setattr(pool, "_set_back", setting_back)
    pool.release(group)
    assert answers == [False]
    assert pool.groups() == [group] and pool.stats[b.key].launches == 1 and len(pool.launches) == 1


def test_the_wait_for_a_launch_makes_the_http_clients_tls_context_on_the_main_thread(
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The first client a process hands out cost its test about 0.15 s (httpx's import, the CA bundle), more on a
    loaded machine: an xdist worker's first test paid it. The main thread makes it while it waits for a launch."""
    import httpx

    from pytest_sglworker.workers import process

    monkeypatch.setattr(process, "_tls_context", None)
    made: list[str] = []
    real = httpx.create_ssl_context

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "create_ssl_context", counted)
    pool = make_pool()
    group = pool.acquire(WorkerConfig.of(QWEN), holder="t1")
    assert made == [threading.main_thread().name]  # while it waited, on the main thread, once
    assert group[0].client.get("/health").status_code == 200
    assert made == [threading.main_thread().name]  # the client took the one made
    pool.release(group)


# -- a group no later test needs, retired off the main thread (issue 43) ----------------------------------------------
def _held_stop(member, monkeypatch: pytest.MonkeyPatch, *, fail: bool = False):  # type: ignore[no-untyped-def]
    """Hold ``member``'s stop until the returned event is set; the names of the threads that stopped it."""
    gate, stopped_on = threading.Event(), []
    real = member.stop

    def held(**kwargs):  # type: ignore[no-untyped-def]
        stopped_on.append(threading.current_thread().name)
        assert gate.wait(30), "never let go"
        if fail:
            real(**kwargs)
            raise RuntimeError("stop went wrong")
        return real(**kwargs)

    monkeypatch.setattr(member, "stop", held)
    return gate, stopped_on


def _until(check, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_group_no_later_test_needs_is_retired_off_the_main_thread(  # type: ignore[no-untyped-def]
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its last test's teardown returns while the group stops (sglang's clean shutdown takes seconds, and the next
    test most often needs none of it); its GPU stays leased until it is gone, and the main thread, once it needs that
    GPU, waits for the retirement: no lease wait, no message about a holder that is itself."""
    pool = make_pool(gpus=1)
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    group = pool.acquire(a, holder="a")
    member = group[0]
    gate, stopped_on = _held_stop(member, monkeypatch)
    pool.discard(group, failed=False)  # returns although the stop is held
    _until(lambda: stopped_on, "the retirement to begin")
    assert stopped_on == ["sglworker-retire-qwen3-0.6b --max-total-tokens 256"] and member.is_alive()
    assert group not in pool.groups() and sorted(pool.leases.holders()) == [0]
    pool.on_tick = gate.set  # called while the main thread waits: the stop goes on only once it waits
    other = pool.acquire(b, holder="b")
    assert not member.is_alive() and other[0].gpus == "0"
    assert not [m for m in pool.messages if "waiting for" in m], pool.messages
    record = next(r for r in pool.launches if r.config == a.key)
    assert record.outcome == "stopped" or record.outcome == "ok"
    assert record.t_stop_requested is not None and record.t_released is not None
    assert record.t_stop_requested <= record.t_released


def test_a_group_a_failed_test_used_or_a_fresh_one_is_retired_on_the_main_thread(  # type: ignore[no-untyped-def]
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(gpus=2)
    for fresh, failed in ((False, True), (True, False)):
        group = pool.acquire(WorkerConfig.of(QWEN), holder="t", fresh=fresh)
        gate, stopped_on = _held_stop(group[0], monkeypatch)
        gate.set()
        pool.discard(group, failed=failed)
        assert stopped_on == [threading.main_thread().name] and not group[0].is_alive()


def test_what_a_retirement_off_the_main_thread_says_is_said_on_the_main_thread(  # type: ignore[no-untyped-def]
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its warnings and an error it met wait for the main thread (the terminal is pytest's); the pool's close waits
    for it, and the lease is given back whatever the stop met."""
    pool = make_pool(gpus=2)
    said: list[tuple[str, str]] = []
    pool.on_message = lambda message: said.append((threading.current_thread().name, message))
    warned = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), holder="a")
    failing = pool.acquire(WorkerConfig.of(QWEN, ["--max-total-tokens", "512"]), holder="b")
    warned[0].warnings.append("a warning of its stop")
    gates = [_held_stop(warned[0], monkeypatch), _held_stop(failing[0], monkeypatch, fail=True)]
    pool.discard(warned, failed=False)
    pool.discard(failing, failed=False)
    _until(lambda: all(stopped_on for _, stopped_on in gates), "the retirements to begin")
    assert said == []
    pool.on_tick = lambda: [gate.set() for gate, _ in gates]
    pool.close()
    main = threading.main_thread().name
    assert said == [(main, "a warning of its stop"),
                    (main, "sglworker: qwen3-0.6b --max-total-tokens 512: retiring it met RuntimeError: stop went "
                           "wrong")]
    assert not warned[0].is_alive() and not failing[0].is_alive() and pool.leases.holders() == {}


def test_a_launch_ahead_on_the_gpu_of_a_retiring_group_waits_for_it(  # type: ignore[no-untyped-def]
        make_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between tests, the main thread launches the next configuration ahead on the GPU a retirement frees."""
    pool = make_pool(gpus=1)
    a, b = WorkerConfig.of(QWEN, ["--max-total-tokens", "256"]), WorkerConfig.of(QWEN, ["--max-total-tokens", "512"])
    group = pool.acquire(a, holder="a")
    gate, _ = _held_stop(group[0], monkeypatch)
    pool.discard(group, failed=False)
    ticks: list[int] = []
    pool.on_tick = lambda: ticks.append(1)
    # where a follower thread starts it once the GPU is free (an xdist worker's), the main thread does not wait
    assert pool.launch_ahead(b, holder="b", wait_retiring=False) is False
    assert ticks == [] and group[0].is_alive()
    pool.on_tick = gate.set
    assert pool.launch_ahead(b, holder="b") is True
    assert not group[0].is_alive()
    assert pool.acquire(b, holder="b")[0].gpus == "0" and pool.stats[b.key].launches == 1
