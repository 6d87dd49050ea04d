"""An xdist worker follows the controller's word while a test runs (issue 43): a launch ahead the controller names
starts once its GPUs are free, not after the test that was running then (:mod:`pytest_sglworker.plugin.hint_follower`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pytest_sglworker.plugin.hint_follower import HintFollower
from pytest_sglworker.plugin.launch_hints import write_launch_hint


def _all_ended(pids: list[int]) -> bool:
    """Every process of ``pids`` has ended (a zombie counts: its parent reaps it)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def _wait_for(condition, seconds: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


class _Launches:
    """What the follower asked to launch, in order; ``fail``: keys whose launch raises."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.fail = fail
        self.lock = threading.Lock()

    def __call__(self, kit: str) -> bool:
        with self.lock:
            self.calls.append(kit)
        if kit in self.fail:
            raise RuntimeError(f"{kit} broke")
        return True

    def seen(self) -> list[str]:
        with self.lock:
            return list(self.calls)


def test_the_follower_starts_the_handed_launches_the_hint_names_in_its_order(tmp_path: Path) -> None:
    launches, errors = _Launches(fail=("c3",)), []
    follower = HintFollower(tmp_path, "gw0", launches, on_error=errors.append, poll=0.01)
    follower.hand({"c1": "c1", "c2": "c2", "c3": "c3"})
    follower.start()
    try:
        assert _wait_for(lambda: follower.running)
        # c9 has no kit (this source launches it between tests only); c1's tests are all handed out (drop)
        write_launch_hint(tmp_path, "gw0", ["c2", "c9", "c1", "c3"], drop=["c1"])
        assert _wait_for(lambda: {"c2", "c3"} <= set(launches.seen()))
        seen = launches.seen()
        assert "c9" not in seen and "c1" not in seen, seen
        assert seen.index("c2") < seen.index("c3")  # each round in the hint's order
        assert _wait_for(lambda: launches.seen().count("c3") >= 3)  # retried, as a launch that found no GPU is
        assert errors == ["launch ahead of c3 failed to start: RuntimeError('c3 broke')"]  # said once
        write_launch_hint(tmp_path, "gw1", ["c1"], drop=[])  # another worker's word is not this one's
    finally:
        follower.stop()
    assert not follower.running  # stopped: its thread has ended, nothing starts after stop()


def test_a_follower_without_kits_or_without_a_hint_starts_nothing(tmp_path: Path) -> None:
    launches = _Launches()
    follower = HintFollower(tmp_path, "gw0", launches, poll=0.01)

    def looked() -> None:  # until the thread has read the hint twice since now
        since = follower.rounds
        assert _wait_for(lambda: follower.rounds >= since + 2)

    follower.start()
    try:
        (tmp_path / "ahead-gw0.json").write_text("{not json")  # a claim, not an order: ignored
        write_launch_hint(tmp_path, "gw1", ["c1"], drop=[])
        looked()
        follower.hand({"c1": "c1"})
        looked()
        assert launches.seen() == []
        (tmp_path / "ahead-gw0.json").write_text(json.dumps({"schema": "other", "configurations": ["c1"]}))
        looked()
        assert launches.seen() == []
        write_launch_hint(tmp_path, "gw0", ["c1"], drop=[])  # the same kit, named: started
        assert _wait_for(lambda: launches.seen()[:1] == ["c1"])
    finally:
        follower.stop()


def test_the_follower_hands_over_while_the_word_names_groups_to_hand_over(tmp_path: Path) -> None:
    """The word's ``hand`` (groups launched ahead here whose tests went to another xdist worker) makes the thread ask
    the source to hand over what is ready, each round until the word no longer names one; a hand-over that raises is
    said once."""
    launches, errors, rounds = _Launches(), [], []

    def hand_over(keys: tuple[str, ...]) -> None:
        assert keys == ("c1",)
        rounds.append(threading.current_thread().name)
        if len(rounds) == 2:
            raise RuntimeError("keeper gone")

    follower = HintFollower(tmp_path, "gw0", launches, on_error=errors.append, poll=0.01, hand_over=hand_over)
    follower.start()
    try:
        write_launch_hint(tmp_path, "gw0", [], drop=[])
        since = follower.rounds
        assert _wait_for(lambda: follower.rounds >= since + 2)
        assert rounds == []  # nothing to hand over: not asked
        write_launch_hint(tmp_path, "gw0", [], drop=[], hand=["c1"])
        assert _wait_for(lambda: len(rounds) >= 3)
        assert set(rounds) == {"sglworker-follow-gw0"}
        write_launch_hint(tmp_path, "gw0", [], drop=[])
        seen = len(rounds)
        since = follower.rounds
        assert _wait_for(lambda: follower.rounds >= since + 3)
        assert len(rounds) <= seen + 1  # a round that had read the word before it changed, at most
    finally:
        follower.stop()
    assert errors == ["handing a group over while a test runs failed: RuntimeError('keeper gone')"]


#: two configurations under -n 1 on sim:2, GPU 1 held by a process outside the run until the first test lets it go.
#: So the launch ahead of b, which the controller asks for at once, finds no free GPU when the first test's own
#: launch starts it; the first test lets GPU 1 go and waits until b's engine runs, started by this xdist worker.
#: Between tests nothing could start it: without the follower, that test fails at its deadline.
SUITE = '''
import json, os, time
from pathlib import Path
import psutil
import pytest

def b_started_here():
    record = Path(os.environ["SGLSIM_RECORD"])
    if not record.exists():
        return False
    for line in record.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "start" and event["cuda_visible_devices"] == "1":  # b: a holds GPU 0
            try:
                parents = [p.pid for p in psutil.Process(event["pid"]).parents()]
            except psutil.Error:
                return False
            return os.getpid() in parents
    return False

@pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"])
@pytest.mark.parametrize("i", range(2))
def test_a(sgl_worker, i):
    if i == 0:
        assert not b_started_here()
        Path(os.environ["FOLLOW_GO"]).write_text("go")
        deadline = time.monotonic() + 60
        while not b_started_here() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b_started_here(), "b's launch ahead did not start while this test ran"

@pytest.mark.sgl_worker(args=["--max-total-tokens", "4097"])
def test_b(sgl_worker):
    assert sgl_worker.client.get("/health").status_code == 200
'''

#: holds GPU 1's lock file of the sim:2 lease namespace until the go file appears (at most 120 s)
HOLDER = '''
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
open(sys.argv[2], "w").write("held")
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
    time.sleep(0.01)
'''


def _follow_run(pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                suite: str, conftest: str | None, *args: str) -> pytest.RunResult:
    """``suite`` under -n 1 on sim:2 with GPU 1 held outside the run until its first test of a lets it go; a and b
    each launched once, by the run, and nothing left running."""
    from pytest_sglworker.resources.gpus.holders import gpu_lock_path
    from pytest_sglworker.resources.gpus.selection import parse_gpus_option

    locks = Path(sim_env["SGLWORKER_LOCK_DIR"])
    locks.mkdir(parents=True, exist_ok=True)
    go, held, record = tmp_path / "go", tmp_path / "held", tmp_path / "sim-record.jsonl"
    monkeypatch.setenv("FOLLOW_GO", str(go))
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    lock = gpu_lock_path(locks, parse_gpus_option("sim:2").namespace, 1)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(held), str(go)])
    try:
        assert _wait_for(held.exists), "the outside holder did not take GPU 1"
        pytester.makepyfile(test_follow=suite)
        if conftest is not None:
            pytester.makeconftest(conftest)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-gpus", "sim:2",
                                               "-n", "1", "-v", *args, timeout=180)
    finally:
        go.write_text("go")
        holder.wait(30)
    started = [json.loads(line)["pid"] for line in record.read_text().splitlines()
               if json.loads(line)["event"] == "start"] if record.exists() else []
    assert len(started) == 2, (started, result.stdout.str()[-3000:])  # a and b, each launched once
    assert _wait_for(lambda: _all_ended(started)), "engines left running"
    assert os.path.exists(lock)  # the outside holder's file is not the run's to remove
    return result


def test_a_launch_ahead_starts_while_a_test_runs_once_its_gpu_is_free(
        pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _follow_run(pytester, sim_env, tmp_path, monkeypatch, SUITE, None, "--sgl-model", "qwen3-0.6b")
    result.assert_outcomes(passed=3)

#: the same with a test whose worker is attached (``--sgl-worker-url``), first or last (the spec that declares the
#: shorter startup comes first: the xdist worker, waiting for its first launch, starts with it). First: the session
#: launches nothing for it, so its pool does not exist yet and the follower has no launch to be handed; it is handed
#: them at a's launch. Last: the scheduler keeps no GPU for it (an attached worker leases none), so b, not it, has
#: GPU 1 once it is free
ATTACHED_CONFTEST = '''
from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec("outside", "org/outside", 4, features={"outside"}, worker_args=CI_WORKER_ARGS,
                           startup_seconds=OUTSIDE))
    registry.add(ModelSpec("inside", "org/inside", 4, features={"chat"}, worker_args=CI_WORKER_ARGS,
                           startup_seconds=INSIDE))
'''
ATTACHED_SUITE = SUITE.replace("@pytest.mark.sgl_worker(args=[\"--max-total-tokens\", \"4096\"])", '''
@pytest.mark.sgl_requires("outside")
def test_0_attached(sgl_worker):
    assert sgl_worker.client.get("/health").status_code == 200

@pytest.mark.sgl_requires("chat")
@pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"])''').replace(
    "@pytest.mark.sgl_worker(args=[\"--max-total-tokens\", \"4097\"])",
    "@pytest.mark.sgl_requires(\"chat\")\n@pytest.mark.sgl_worker(args=[\"--max-total-tokens\", \"4097\"])")


@pytest.mark.parametrize("attached", ["first", "last"])
def test_the_follower_beside_a_test_whose_worker_is_attached(
        attached: str, pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_sglworker import CI_WORKER_ARGS, ModelSpec
    from pytest_sglworker.workers.launcher import LaunchOptions, sim_launcher, spawn_worker

    assert ATTACHED_SUITE.count("sgl_requires") == 3
    startups = {"OUTSIDE": "0.1", "INSIDE": "5"} if attached == "first" else {"OUTSIDE": "5", "INSIDE": "0.1"}
    conftest = ATTACHED_CONFTEST.replace("OUTSIDE", startups["OUTSIDE"]).replace("INSIDE", startups["INSIDE"])
    outside = spawn_worker(ModelSpec("outside", "org/outside", 4, worker_args=CI_WORKER_ARGS),
                           options=LaunchOptions(launcher=tuple(sim_launcher()), log_dir=tmp_path / "outside-logs",
                                                 lock_dir=tmp_path / "outside-locks", startup_timeout=60),
                           env={"SGLSIM_STARTUP_SECONDS": "0.1"})
    try:
        result = _follow_run(pytester, sim_env, tmp_path, monkeypatch, ATTACHED_SUITE, conftest,
                             "--sgl-model", "outside", "--sgl-model", "inside", "--sgl-worker-url",
                             f"outside={outside.url}")
        ran = ["*PASSED test_follow.py::test_0_attached?outside?*", "*PASSED test_follow.py::test_a?inside-0?*"]
        result.stdout.fnmatch_lines(ran if attached == "first" else ran[::-1])
        assert outside.is_alive()  # an attached worker is not the run's to stop
        # the skipped tests' configuration (inside, no marker) was never launched ahead, nor leased for
        assert not [line for line in result.stdout.lines if line.startswith("inside:")], result.stdout.str()
    finally:
        outside.stop()
    result.assert_outcomes(passed=4, skipped=4)


#: a, then b (launched ahead on the other GPU), under -n 1 on sim:2: a's last test is named in the controller's word
#: when it is sent, so a's group goes as that test ends, before b's first test begins (b's tests sleep, so a test later
#: would be well after it)
LAST_SUITE = '''
import time
import pytest

@pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"])
@pytest.mark.parametrize("i", range(2))
def test_a(sgl_worker, i):
    assert sgl_worker.client.get("/health").status_code == 200

@pytest.mark.sgl_worker(args=["--max-total-tokens", "4097"])
@pytest.mark.parametrize("i", range(2))
def test_b(sgl_worker, i):
    time.sleep(0.5)
'''


def test_a_configurations_group_goes_as_its_last_test_here_ends(
        pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: the word that a's tests are all handed out came only once the controller heard a's last test had run,
    while this xdist worker already ran b's first: a's GPUs stood idle through it."""
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    report = tmp_path / "report.json"
    pytester.makepyfile(test_last=LAST_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-gpus", "sim:2",
                                           "-n", "1", "-v", "--sgl-model", "qwen3-0.6b", "--sgl-report", str(report),
                                           timeout=180)
    result.assert_outcomes(passed=4)
    launches = json.loads(report.read_text())["launches"]
    # by the flag, not a substring of the argv: its --port may hold "4096" too (port 24096 was seen)
    by_args = {m.group(1) if (m := re.search(r"--max-total-tokens (\d+)", r["argv"])) else r["argv"]: r
               for r in launches}
    assert len(launches) == 2 and set(by_args) == {"4096", "4097"}, launches  # each launched once
    a, b = by_args["4096"], by_args["4097"]
    assert [t["nodeid"].rsplit("-", 1)[1] for t in a["tests"]] == ["0]", "1]"]
    first_b = min(t["t_start"] for t in b["tests"])
    # its retirement begins as its last test ends, before b's first (it goes on off the main thread: released later)
    assert a["t_stop_requested"] is not None and a["t_stop_requested"] <= first_b, (a, b)
    assert a["t_stop_requested"] >= max(t["t_end"] for t in a["tests"])  # not before its last test
    assert a["t_released"] is not None and a["t_released"] >= a["t_stop_requested"]
    pids = [r["pid"] for r in launches]
    assert _wait_for(lambda: _all_ended(pids)), "engines left running"


#: a, then b (launched ahead while a runs: the controller's word names it until it hears that b's one test ran), then
#: a test of no worker; the controller hears of b's teardown a second late, so the word that this xdist worker's
#: follower reads through z still names b, whose group went as that test ended
STALE_SUITE = '''
import time
import pytest

@pytest.mark.sgl_worker(args=["--max-total-tokens", "4096"])
@pytest.mark.parametrize("i", range(2))
def test_a(sgl_worker, i):
    time.sleep(0.3)

@pytest.mark.sgl_worker(args=["--max-total-tokens", "4097"])
def test_b(sgl_worker):
    pass

def test_z():
    time.sleep(1.5)
'''
STALE_CONFTEST = '''
import time

CONTROLLER = []

def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # not an xdist worker (the environment may say so: an outer run's)
        CONTROLLER.append(True)

def pytest_runtest_logreport(report):
    if CONTROLLER and report.when == "teardown" and "test_b[" in report.nodeid:
        time.sleep(1.0)  # the controller: what it writes next (the word without b) comes a second late
'''


def test_a_stale_word_does_not_launch_again_a_configuration_whose_last_test_here_ran(
        pytester: pytest.Pytester, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """b's group goes as its last test here ends; the follower then reads a word that still names b (written before
    the controller heard of that test) and, before the fix, launched b again for no test: seen in a full run as a
    third engine stopped unused at the session's end. b is launched once."""
    record = tmp_path / "sim-record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makepyfile(test_stale=STALE_SUITE)
    pytester.makeconftest(STALE_CONFTEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-gpus", "sim:2",
                                           "-n", "1", "-v", "--sgl-model", "qwen3-0.6b", timeout=180)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*PASSED test_stale.py::test_b*", "*PASSED test_stale.py::test_z*"])  # z after b
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    started = [e["pid"] for e in lines if e["event"] == "start"]
    assert len(started) == 2, (lines, result.stdout.str()[-3000:])  # a and b, each launched once
    result.stdout.fnmatch_lines(["*--max-total-tokens 4097: 1 launched*"])
    assert _wait_for(lambda: _all_ended(started)), "engines left running"
