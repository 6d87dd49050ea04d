"""The pieces of warm workers between runs that need no engine: the TTL option's values, the warm record (written
atomically, read without trusting the lock directory), the hand-over of a flock by descriptor, and the claim.
The sessions themselves are tested in tests/acceptance/test_warm.py."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from pytest_sglworker.plugin.options import parse_ttl
from pytest_sglworker.resources.processes import hostname, prove_process
from pytest_sglworker.resources.warm import Claim, dup_lock_fd, forget_lock
from pytest_sglworker.resources.warm_records import (
    FORMAT,
    KEEPER_ENV,
    Party,
    WarmEntry,
    WarmMember,
    WarmRecord,
    adopter_alive,
    keeper_alive,
    matching,
    parse_warm_record,
    read_warm_record,
    record_path,
    run_alive,
    warm_records,
    write_warm_record,
)


@pytest.mark.parametrize(("value", "seconds"), [
    ("on", 900.0), ("", 900.0), ("off", None), ("0", None), ("90s", 90.0), ("15m", 900.0), ("1h", 3600.0),
    ("2.5", 2.5), ("1.5m", 90.0),
])
def test_ttl_values(value: str, seconds: float | None) -> None:
    assert parse_ttl(value) == seconds


@pytest.mark.parametrize(("value", "why"), [
    ("soon", "is not a TTL: give 'on', 'off', or a duration"), ("tests/", "a TTL goes after '='"),
    ("-5", "is not a TTL between 1 s and 7 days"), ("8d", "is not a TTL"), ("nan", "is not a TTL between"),
    ("0.5", "is not a TTL between 1 s and 7 days"),
])
def test_bad_ttl_values(value: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_ttl(value)
    assert why in str(info.value)


def make_record(wid: str = "4242-abcdef12", **changes: object) -> WarmRecord:
    now = time.time()
    member = WarmMember(role="worker", index=0, kind="HttpWorker", pid=4243, since=now - 10, tag=f"{wid}:beef",
                        port=20004, ports=(("http", 20004), ("nccl", 20005)), gpus="0",
                        log="/tmp/sglang-worker-20004.log",
                        argv="python -m sglang.launch_server --api-key ***", started_at=now - 10, startup_seconds=2.0,
                        probe_seconds=0.001)
    record = WarmRecord(id=wid, hostname="host", state="warm", kept_by=Party(4000, now, "4000-aa", "suite (pid 4000)"),
                        ttl=900.0, created=now, last_used=now, expires_at=now + 900, config_key="w", label="w",
                        model="Qwen/Qwen3-0.6B", identity=(("argv", "ab" * 16), ("env", "cd" * 16)),
                        namespace="sim-2x80", gpus=(0,), gpu_uuids=("GPU-sim-000000000000",), memory_mib=4096,
                        members=(member,), keeper=Party(4242, now - 11, "keeper"))
    return replace(record, **changes)  # type: ignore[arg-type]


def test_a_record_survives_its_round_trip(tmp_path: Path) -> None:
    record = make_record()
    write_warm_record(tmp_path, record)
    path = record_path(tmp_path, record.id)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_warm_record(path).record == record
    assert [e.record for e in warm_records(tmp_path)] == [record]


@pytest.mark.parametrize(("mutate", "why"), [
    (lambda d: d.update(format="other/v9"), "its format is"),
    (lambda d: d.update(id="4242-ABC"), "is not a warm group id"),
    (lambda d: d.update(state="asleep"), "its state 'asleep' is not one of"),
    (lambda d: d["members"][0].update(pid=1e999), "Infinity is not a number a warm record holds"),
    (lambda d: d["members"][0].update(pid=-5), "'pid' is not a whole number"),
    (lambda d: d.update(members=[]), "it names no member"),
    (lambda d: d.update(ttl=10 ** 9), "'ttl' is not a number"),
    (lambda d: d.update(log_policy="some"), "its log policy 'some' is not one of"),
    (lambda d: d["members"][0].update(tag="has space"), "'tag' is not printable text"),
    (lambda d: d.pop("kept_by"), "missing 'kept_by'"),
    # what a record may name: whole tags of its own keeper's session, worker logs by absolute path, a file identity
    (lambda d: d["members"][0].update(tag="4242-abcdef12:"), "is not a whole owner tag"),
    (lambda d: d["members"][0].update(tag="999-abcdef99:beef"), "carry tags of another session than its keeper's"),
    (lambda d: d["members"][0].update(log="/root/.ssh/authorized_keys"), "is not the path of a worker log"),
    (lambda d: d["members"][0].update(links=["sglang-worker-1.log"]), "is not the path of a worker log"),
    (lambda d: d["members"][0].update(log_id=[1]), "'log_id' is not a device and an inode"),
])
def test_a_record_that_cannot_be_trusted_says_why(tmp_path: Path, mutate: object, why: str) -> None:
    data = make_record().as_dict()
    mutate(data)  # type: ignore[operator]
    path = tmp_path / "warm-4242-abcdef12.json"
    path.write_text(json.dumps(data))
    entry = read_warm_record(path)
    assert entry.record is None and entry.problem is not None and why in entry.problem, entry.problem


def test_a_record_under_another_name_a_symlink_or_a_giant_is_untrusted(tmp_path: Path) -> None:
    raw = json.dumps(make_record().as_dict()).encode()
    with pytest.raises(ValueError, match="not the one its file name says"):
        parse_warm_record(raw, "warm-1-other.json")
    target = tmp_path / "real.json"
    target.write_bytes(raw)
    link = tmp_path / "warm-4242-abcdef12.json"
    link.symlink_to(target)
    assert read_warm_record(link).problem == "is a symlink (never followed)"
    link.unlink()
    link.write_bytes(b" " * (300 * 1024))
    assert "larger than" in (read_warm_record(link).problem or "")
    link.write_bytes(raw[:40])
    assert (read_warm_record(link).problem or "").startswith("not valid JSON")
    assert json.loads(raw)["format"] == FORMAT


def _held(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_flock_handed_over_by_descriptor_is_never_unlocked_on_the_way(tmp_path: Path) -> None:
    import subprocess
    import sys

    from pytest_sglworker.resources.lockfiles import LockFile

    path = tmp_path / "gpu-sim-1x80-0.lock"
    lock = LockFile(path)
    assert lock.acquire()
    copy = dup_lock_fd(lock)  # what a keeper gets
    keeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=[copy])
    try:
        os.close(copy)
        with pytest.raises(OSError, match="is not locked by this process"):
            dup_lock_fd(LockFile(tmp_path / "other.lock"))  # nothing held: nothing to hand over
        forget_lock(lock)  # the session lets go of its own descriptor, without unlocking
        assert not lock.is_locked
        assert _held(path), "the flock went with the session's descriptor"
        lock.release()  # whatever the session does with the forgotten lock touches nothing
        del lock
        assert _held(path)
    finally:
        assert keeper.stdin is not None
        keeper.stdin.close()  # the keeper exits, with its descriptor
        keeper.wait(10)
    assert not _held(path)


def test_a_claim_is_exclusive(tmp_path: Path) -> None:
    record = make_record()
    write_warm_record(tmp_path, record)
    first = Claim.take(tmp_path, record.id)
    assert first is not None and first.read() == record
    assert Claim.take(tmp_path, record.id) is None
    assert Claim.take(tmp_path, record.id, wait=0.2) is None
    first.remove()
    first.release()
    assert not record_path(tmp_path, record.id).exists()
    again = Claim.take(tmp_path, record.id)
    assert again is not None and again.read() is None  # a claim on a group that is gone finds no record
    again.release()


# ---------------------------------------------------------------------------------------------- who may adopt


@pytest.fixture
def keeper_process() -> Iterator[tuple[int, float, str]]:
    """A live process carrying a keeper's marker (KEEPER_ENV=<its group's id suffix>): pid, start time, suffix."""
    import subprocess
    import sys

    import psutil

    suffix = "abcdef12"
    # Popen returns once the child has begun its exec (vfork): until the exec is through, /proc shows it with an
    # empty command line and environment. A keeper is proven long after it started; so is this one, once it says so.
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, KEEPER_ENV: suffix})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield proc.pid, psutil.Process(proc.pid).create_time(), suffix
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()  # type: ignore[union-attr]


def test_the_keeper_is_alive_only_when_proven(keeper_process: tuple[int, float, str]) -> None:
    pid, since, suffix = keeper_process
    here = hostname()
    alive = make_record(f"{pid}-{suffix}", hostname=here, keeper=Party(pid, since, "keeper"))
    assert keeper_alive(alive), prove_process(pid, since, suffix, env_name=KEEPER_ENV)
    assert not keeper_alive(replace(alive, keeper=None))
    assert not keeper_alive(replace(alive, hostname="elsewhere"))
    assert not keeper_alive(replace(alive, id=f"{pid + 1}-{suffix}", keeper=Party(pid, since, "keeper")))
    assert not keeper_alive(replace(alive, keeper=Party(pid, since + 5.0, "keeper")))  # a reused pid
    assert not keeper_alive(replace(alive, id=f"{pid}-12345678"))  # the marker names another group


def test_the_adopter_is_alive_while_its_process_runs() -> None:
    here = hostname()
    me = Party(os.getpid(), time.time(), "4000-aa")
    assert adopter_alive(make_record(hostname=here, adopter=me))
    assert not adopter_alive(make_record(hostname=here, adopter=None))
    assert not adopter_alive(make_record(hostname=here, adopter=Party(os.getpid(), time.time() - 10**6)))
    assert adopter_alive(make_record(hostname="elsewhere", adopter=Party(2**22 + 1, 0.0)))  # cannot be told there


def test_only_this_users_records_of_this_host_config_namespace_and_gpus_match(tmp_path: Path) -> None:
    here, me = hostname(), os.getuid()
    visible = {0: "GPU-sim-000000000000", 1: "GPU-sim-000000000001"}

    def entry(record: WarmRecord | None, owner: int = me) -> WarmEntry:
        return WarmEntry(tmp_path / "warm-x.json", record, None, owner)

    older = make_record("4242-aaaaaaa1", hostname=here, last_used=100.0)
    newer = make_record("4242-aaaaaaa2", hostname=here, last_used=200.0, gpus=(1,),
                        gpu_uuids=("GPU-sim-000000000001",))
    refused = [
        entry(make_record("4242-bbbbbbb1", hostname=here), owner=me + 1),
        entry(None),
        entry(make_record("4242-bbbbbbb2", hostname="elsewhere")),
        entry(make_record("4242-bbbbbbb3", hostname=here, config_key="other")),
        entry(make_record("4242-bbbbbbb4", hostname=here, namespace="sim-1x80")),
        entry(make_record("4242-bbbbbbb5", hostname=here, gpu_uuids=("GPU-sim-000000000009",))),
        entry(make_record("4242-bbbbbbb6", hostname=here, gpus=(0, 1), gpu_uuids=("GPU-sim-000000000000",))),
        entry(make_record("4242-bbbbbbb7", hostname=here, gpus=(2,), gpu_uuids=("GPU-sim-000000000002",))),
    ]
    found = matching([entry(older), *refused, entry(newer)], config_key="w", namespace="sim-2x80", visible=visible)
    assert [r.id for r in found] == [newer.id, older.id]
    for one in refused:
        assert matching([one], config_key="w", namespace="sim-2x80", visible=visible) == []


def test_a_group_published_within_a_run_is_only_that_runs(tmp_path: Path) -> None:
    """A run-tagged record (in-run adoption under xdist) round-trips, matches only a session of its run, and its
    run is alive while the process it names runs; a record that names no run is every session's, as before."""
    here, me = hostname(), os.getuid()
    visible = {0: "GPU-sim-000000000000"}
    run = Party(os.getpid(), time.time(), "run-abc", "the xdist controller")
    record = make_record(hostname=here, run=run)
    write_warm_record(tmp_path, record)
    assert read_warm_record(record_path(tmp_path, record.id)).record == record
    entries = [WarmEntry(tmp_path / "warm-x.json", record, None, me)]
    assert [r.id for r in matching(entries, config_key="w", namespace="sim-2x80", visible=visible,
                                   run="run-abc")] == [record.id]
    assert matching(entries, config_key="w", namespace="sim-2x80", visible=visible, run="run-other") == []
    assert matching(entries, config_key="w", namespace="sim-2x80", visible=visible) == []
    between_runs = [WarmEntry(tmp_path / "warm-x.json", replace(record, run=None), None, me)]
    assert matching(between_runs, config_key="w", namespace="sim-2x80", visible=visible, run="run-abc")
    assert run_alive(record) and run_alive(replace(record, run=None))
    assert not run_alive(replace(record, run=Party(os.getpid(), time.time() - 10**6, "run-abc")))  # a reused pid


def test_the_keeper_ends_a_group_of_a_run_that_is_gone(tmp_path: Path) -> None:
    """A group handed over within a run gives no reason to end while its run's process lives, and one once it is gone
    (a reused pid counts as gone): nothing it holds outlives the run, even when nobody ends it on purpose."""
    import socket

    from pytest_sglworker.resources.warm_keeper import _Keeper

    ours, theirs = socket.socketpair()
    try:
        keeper = _Keeper(tmp_path, "4242-abcdef12", theirs)
        me = Party(os.getpid(), time.time(), "run-abc")
        alive = make_record(hostname=hostname(), run=me)
        with pytest.MonkeyPatch.context() as mp:  # its members live: only the run decides
            mp.setattr("pytest_sglworker.resources.warm_keeper.members_alive", lambda record: True)
            assert keeper.why_end(alive) is None
            gone = replace(alive, run=Party(os.getpid(), time.time() - 10**6, "run-abc"))
            assert keeper.why_end(gone) == f"the run that published it (pid {os.getpid()}) ended"
    finally:
        ours.close()
        theirs.close()
