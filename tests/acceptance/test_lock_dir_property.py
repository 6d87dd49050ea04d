"""Property: whatever a lock directory holds, the plugin's readers of it (the janitor, ``--sgl-warm list`` and
``stop``, the choice of warm groups to adopt) change no file and signal no process that is not provably theirs,
and never raise.

Hypothesis generates hostile lock directories: warm records with random fields, paths into a sandbox of victim
files (some named like worker logs), pids of live processes this test started (tagged like workers of a live
session, one marked like a warm keeper), tags that prefix, extend or copy live ones, the victims' real file
identities, other owners (``chown``, as root), and entries that are no records at all (directories, symlinks,
empty or garbled files). The one thing a record of this user may do is what this user may do anyway: so a record
of this user is generated never to hold the whole truth about a live process or a victim (pid, start time and exact
tag; path and file identity), while another user's record may hold all of it and must still be ignored.

The positive half: beside the hostile entries lies one legitimate record of this user (its keeper gone, its member a
live process this test started with the member's owner tag, its log the file the record identifies): the janitor
must still end that group, remove its record and treat its log as its policy says. A checker that refused to act on
anything would pass the negative half alone.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_sglworker.plugin.reporter import render_warm
from pytest_sglworker.resources.processes import OWNER_ENV
from pytest_sglworker.resources.reaper import reap_dead_sessions
from pytest_sglworker.resources.warm import stop_warm
from pytest_sglworker.resources.warm_records import FORMAT, KEEPER_ENV, matching, warm_records

NOBODY = 65534
PRECIOUS = b"precious\n"
AS_ROOT = os.geteuid() == 0


@dataclass(frozen=True)
class Live:
    pid: int
    since: float
    tag: str
    env: str  # OWNER_ENV or KEEPER_ENV


@dataclass(frozen=True)
class Sandbox:
    root: Path
    victims: tuple[Path, ...]
    live: tuple[Live, ...]


def _start(env_name: str, value: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env={**os.environ, env_name: value}, start_new_session=True)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    root = tmp_path_factory.mktemp("sandbox")
    victims = []
    for i, name in enumerate(["sglang-worker-30001.log", "sglang-worker-30002-2.log", "id_rsa", "notes.txt"]):
        folder = root / f"v{i}"
        folder.mkdir(mode=0o700)
        path = folder / name
        path.write_bytes(PRECIOUS)
        path.chmod(0o600)
        victims.append(path)
    session = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # a live session: this pytest
    procs = [_start(OWNER_ENV, f"{session}:{uuid.uuid4().hex[:12]}") for _ in range(2)]
    keeper_suffix = uuid.uuid4().hex[:8]
    procs.append(_start(KEEPER_ENV, keeper_suffix))
    live = []
    for proc, env in zip(procs, [OWNER_ENV, OWNER_ENV, KEEPER_ENV], strict=True):
        deadline = time.monotonic() + 30
        while env not in psutil.Process(proc.pid).environ() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the exec has happened
        value = psutil.Process(proc.pid).environ()[env]
        live.append(Live(proc.pid, psutil.Process(proc.pid).create_time(), value, env))
    try:
        yield Sandbox(root, tuple(victims), tuple(live))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


_DEAD: list[int] = []


def _dead_pid() -> int:
    """A pid whose process has exited (a handful, made once)."""
    if not _DEAD:
        for _ in range(4):
            proc = subprocess.Popen(["true"])
            proc.wait()
            _DEAD.append(proc.pid)
    return _DEAD[uuid.uuid4().int % len(_DEAD)]


# -- what a hostile record holds -----------------------------------------------------------------------


def _session_of(tag: str) -> str:
    return tag.split(":")[0]


@st.composite
def members(draw: st.DrawFn, box: Sandbox, wid: str, whole_truth: bool) -> dict[str, Any]:
    """A member: mostly well formed (so that the record is trusted and acted on), hostile in what it names."""
    workers = [x for x in box.live if x.env == OWNER_ENV]
    target = draw(st.sampled_from(workers))
    tags = [f"{_session_of(target.tag)}:", target.tag + "0", f"{wid}:{uuid.uuid4().hex[:12]}"]
    if whole_truth or wid != _session_of(target.tag):
        tags += [target.tag]  # (for this user's record, its id then says another session: untrusted)
    tag = draw(st.sampled_from(tags))
    exact_since = whole_truth or tag != target.tag
    since = target.since if exact_since and draw(st.booleans()) else target.since + 5.0
    logs = [v for v in box.victims if v.name.startswith("sglang-worker-")]  # what a record's parser takes
    victim = draw(st.sampled_from(logs))
    stat = victim.stat()
    ids = [None, [stat.st_dev, stat.st_ino + 1]]
    if whole_truth:
        ids += [[stat.st_dev, stat.st_ino]]
    links = draw(st.lists(st.sampled_from(logs), max_size=2))
    return {
        "role": draw(st.sampled_from(["worker", "prefill"])), "index": 0,
        "kind": "HttpWorker", "pid": draw(st.sampled_from([target.pid, _dead_pid()])),
        "since": since, "tag": tag, "port": 30001, "ports": {"http": 30001},
        "gpus": "0", "log": str(victim), "links": [str(p) for p in links], "log_id": draw(st.sampled_from(ids)),
        "argv": "x", "started_at": time.time() - 10, "startup_seconds": 1.0, "probe_seconds": 0.0,
    }


@st.composite
def records(draw: st.DrawFn, box: Sandbox, whole_truth: bool) -> tuple[str, dict[str, Any]]:
    keeper = next(x for x in box.live if x.env == KEEPER_ENV)
    keeper_id = f"{keeper.pid}-{keeper.tag}"
    worker_session = _session_of(next(x for x in box.live if x.env == OWNER_ENV).tag)
    wid = draw(st.sampled_from([keeper_id, worker_session, f"{_dead_pid()}-{uuid.uuid4().hex[:8]}"]))
    now = time.time()
    keeper_party = draw(st.sampled_from([
        None, {"pid": keeper.pid, "since": keeper.since + (0.0 if whole_truth else 5.0)},
        {"pid": _dead_pid(), "since": now}]))
    record = {
        "format": FORMAT, "id": wid, "hostname": os.uname().nodename,
        "state": draw(st.sampled_from(["warm", "handover", "adopted", "stop"])),
        "keeper": keeper_party, "kept_by": {"pid": _dead_pid(), "since": now - 60},
        "adopter": draw(st.sampled_from([None, {"pid": os.getpid(), "since": now}])),
        "ttl": 60.0, "created": now - 60, "last_used": now - 60,
        "expires_at": draw(st.sampled_from([now - 3600, now + 3600])),
        "config": {"key": "k", "label": "planted", "model": "m"}, "identity": {},
        "namespace": "sim", "gpus": [0], "gpu_uuids": ["GPU-sim-0"], "memory_mib": 1024, "log_dir": None,
        "log_policy": draw(st.sampled_from(["none", "all", "failed"])), "tainted": draw(st.booleans()),
        "uses": 0,
        "members": draw(st.lists(members(box, wid, whole_truth), min_size=1, max_size=2)),
    }
    return f"warm-{wid}.json", record


@st.composite
def entries(draw: st.DrawFn, box: Sandbox) -> list[tuple[str, str, Any, bool]]:
    """(name, kind, content, another user's) for each entry of a lock directory."""
    found = []
    for _ in range(draw(st.integers(1, 4))):
        foreign = AS_ROOT and draw(st.booleans())
        kind = draw(st.sampled_from(["record", "record", "record", "empty", "garbage", "directory", "symlink",
                                     "dangling-claim"]))
        if kind == "record":
            name, content = draw(records(box, whole_truth=foreign))
            found.append((name, kind, content, foreign))
        else:
            name = f"warm-{_dead_pid()}-{uuid.uuid4().hex[:8]}.json"
            found.append((name, kind, draw(st.sampled_from(box.victims)), foreign))
    return found


def _lay(lock_dir: Path, planted: list[tuple[str, str, Any, bool]]) -> None:
    for name, kind, content, foreign in planted:
        path = lock_dir / name
        if kind == "record":
            path.write_text(json.dumps(content))
        elif kind == "empty":
            path.write_bytes(b"")
        elif kind == "garbage":
            path.write_bytes(b"{\"format\": [[[[" * 50)
        elif kind == "directory":
            path.mkdir(exist_ok=True)
        elif kind == "symlink":
            if not os.path.lexists(path):
                path.symlink_to(content)
        else:
            path.write_bytes(b"")
            claim = path.with_suffix(".lock")
            if not os.path.lexists(claim):
                claim.symlink_to(lock_dir / "nowhere")
        if foreign:
            os.lchown(path, NOBODY, NOBODY)


@dataclass
class Legit:
    """A legitimate warm record of this user whose keeper is gone: the janitor must end it."""

    proc: subprocess.Popen[bytes]
    record: Path
    log: Path
    policy: str


def _legit(box: Sandbox, lock_dir: Path, policy: str) -> Legit:
    wid = f"{_dead_pid()}-{uuid.uuid4().hex[:8]}"
    tag = f"{wid}:{uuid.uuid4().hex[:12]}"
    proc = _start(OWNER_ENV, tag)
    deadline = time.monotonic() + 30
    while OWNER_ENV not in psutil.Process(proc.pid).environ() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the exec has happened
    since = psutil.Process(proc.pid).create_time()
    folder = Path(tempfile.mkdtemp(dir=box.root))
    log = folder / "sglang-worker-30009.log"
    log.write_bytes(b"its own log\n")
    log.chmod(0o600)
    st = log.stat()
    now = time.time()
    record = {
        "format": FORMAT, "id": wid, "hostname": os.uname().nodename, "state": "warm", "keeper": None,
        "kept_by": {"pid": _dead_pid(), "since": now - 60}, "adopter": None, "ttl": 60.0, "created": now - 60,
        "last_used": now - 60, "expires_at": now + 3600, "config": {"key": "k", "label": "legit", "model": "m"},
        "identity": {}, "namespace": "sim", "gpus": [0], "gpu_uuids": ["GPU-sim-0"], "memory_mib": 1024,
        "log_dir": None, "log_policy": policy, "tainted": False, "uses": 0,
        "members": [{"role": "worker", "index": 0, "kind": "HttpWorker", "pid": proc.pid, "since": since, "tag": tag,
                     "port": 30009, "ports": {"http": 30009}, "gpus": "0", "log": str(log), "links": [],
                     "log_id": [st.st_dev, st.st_ino], "argv": "x", "started_at": now - 60, "startup_seconds": 1.0,
                     "probe_seconds": 0.0}],
    }
    path = lock_dir / f"warm-{wid}.json"
    path.write_text(json.dumps(record))
    path.chmod(0o600)
    return Legit(proc, path, log, policy)


def _state(box: Sandbox) -> dict[str, Any]:
    files = {}
    for p in box.victims:
        st = p.stat()
        files[str(p)] = (p.read_bytes(), st.st_nlink, st.st_ino, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    procs = {}
    for x in box.live:
        proc = psutil.Process(x.pid)
        procs[x.pid] = (proc.create_time(), proc.status())
    return {"files": files, "procs": procs}


@pytest.mark.skipif(sys.platform != "linux", reason="the process and file checks read /proc")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_no_hostile_lock_directory_touches_what_is_not_ours(sandbox: Sandbox, data: st.DataObject) -> None:
    before = _state(sandbox)
    planted = data.draw(entries(sandbox))
    lock_dir = Path(tempfile.mkdtemp(dir=sandbox.root))
    lock_dir.chmod(0o1777)
    legit: Legit | None = None
    try:
        _lay(lock_dir, planted)
        legit = _legit(sandbox, lock_dir, data.draw(st.sampled_from(["none", "all"])))
        reap_dead_sessions(lock_dir=lock_dir)
        # the positive half: the legitimate record was acted on
        assert legit.proc.wait(30) is not None, "the legitimate warm group's member was not ended"
        assert not legit.record.exists(), "the legitimate record was not removed"
        if legit.policy == "none":
            assert not legit.log.exists(), "the legitimate group's log was not removed (policy none)"
        else:
            assert b"warm worker ended: its keeper is gone" in legit.log.read_bytes()
        render_warm(lock_dir, "list")
        matched = matching(warm_records(lock_dir), config_key="k", namespace="sim", visible={0: "GPU-sim-0"})
        assert all(os.lstat(lock_dir / f"warm-{r.id}.json").st_uid == os.getuid() for r in matched), \
            "another user's record was a candidate for adoption"
        text, code = render_warm(lock_dir, "stop")
        assert code in (0, 1), text
        stop_warm(lock_dir)
        after = _state(sandbox)
        assert after["files"] == before["files"], "a victim file changed"
        for pid, (started, _) in before["procs"].items():  # still the same process, neither stopped nor ended
            assert after["procs"][pid][0] == started and after["procs"][pid][1] not in (
                psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD), \
                f"live process {pid} was signalled (status {after['procs'][pid][1]})"
        for name, _, _, foreign in planted:
            if foreign:
                assert os.path.lexists(lock_dir / name), f"another user's {name} was removed"
    finally:
        if legit is not None and legit.proc.poll() is None:
            legit.proc.kill()
            legit.proc.wait()
        shutil.rmtree(lock_dir, ignore_errors=True)
