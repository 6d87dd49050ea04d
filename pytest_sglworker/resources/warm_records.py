"""The warm record of a worker group kept warm between runs (``--sgl-keep-warm``): ``<lock_dir>/warm-<id>.json``,
what it holds, how it is read without trusting the lock directory, and which records a session may adopt.

Plain Python, no pytest; ``psutil`` is imported lazily. Who writes a record when, and what each state means, is
:mod:`.warm`. A record is written atomically (:func:`~.state.atomic_write`, mode 0600: it names processes and logs)
and read like a GPU holder record (:mod:`.gpus.holders`): never through a symlink, never from a FIFO, at most
:data:`MAX_RECORD_BYTES`, and every field checked against its range (:func:`parse_warm_record`); a record that
fails is *untrusted* (:class:`WarmEntry` says why), never acted on, and removed by the janitor when nobody holds its
claim. A pid a record names is trusted only once proven (:func:`keeper_alive`: pid, start time, marker).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .owned_files import FileId
from .processes import hostname, is_owner_tag, process_alive, prove_process, tag_session
from .retention import POLICIES

__all__ = [
    "DEFAULT_TTL",
    "FORMAT",
    "KEEPER_ENV",
    "KEEPER_GRACE",
    "MAX_TTL",
    "MIN_TTL",
    "Party",
    "WarmEntry",
    "WarmMember",
    "WarmRecord",
    "adopter_alive",
    "claim_path",
    "keeper_alive",
    "matching",
    "parse_warm_record",
    "read_warm_record",
    "record_id",
    "record_path",
    "run_alive",
    "warm_records",
    "write_warm_record",
]

#: v2: a member's log carries its file's identity (``log_id``), and only its owner's records are acted on
FORMAT = "pytest-sglworker/warm/v2"
#: the environment variable that marks a keeper process: the random part of its session id (``<pid>-<random>``),
#: which is also the id of the group it keeps
KEEPER_ENV = "SGLWORKER_WARM_KEEPER"
#: ``--sgl-keep-warm`` without a TTL: 15 minutes after the group's last use
DEFAULT_TTL = 15 * 60.0
#: the longest TTL a record may carry (a record naming more is not one of ours)
MAX_TTL = 7 * 86400.0
#: the shortest TTL (``--sgl-keep-warm`` refuses less, a record naming less is not one of ours)
MIN_TTL = 1.0
STATES = ("handover", "warm", "adopted", "stop")
#: how long past its expiry a group whose keeper still lives is left to that keeper before the janitor acts
KEEPER_GRACE = 5.0
MAX_RECORD_BYTES = 256 * 1024
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_NAME_RE = re.compile(r"^warm-(?P<id>[a-z0-9][a-z0-9-]{0,63})\.json$")
_PRINTABLE_RE = re.compile(r"^[\x21-\x7e]+$")
#: the name of a log file the plugin writes (``sglang-worker-20004.log``, ``sglang-worker-20004-2.log``): an
#: absolute path to a file of that name is all a member's log or link may be
_LOG_NAME_RE = re.compile(r"^sglang-worker-[0-9]{1,5}(?:-[0-9]{1,6})?\.log$")


# ---------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Party:
    """A process a record names (the keeper, the session that kept the group warm, its adopter): its pid, and
    ``since``, its start time (keeper) or the moment it took its part (a session), for :func:`process_alive`."""

    pid: int
    since: float
    session: str = ""
    holder: str = ""


@dataclass(frozen=True)
class WarmMember:
    """One process of a warm group, as its session launched it."""

    role: str
    index: int
    kind: str
    pid: int
    #: the root process's start time (psutil's ``create_time``): with ``pid`` and ``tag``, what proves it
    since: float
    tag: str
    port: int
    ports: tuple[tuple[str, int], ...]
    gpus: str
    #: its log file, and the hard links later sessions made of it in their own log directories
    log: str
    links: tuple[str, ...] = ()
    #: the log file's identity when its session created it: a path is touched only while it is that file
    log_id: FileId | None = None
    #: its argv with secrets masked, for people (the identity compares a digest of the real one)
    argv: str = ""
    started_at: float = 0.0
    startup_seconds: float | None = None
    probe_seconds: float = 0.0


@dataclass(frozen=True)
class WarmRecord:
    """What the lock directory knows of one warm group (``warm-<id>.json``)."""

    id: str
    hostname: str
    state: str
    kept_by: Party
    ttl: float
    created: float
    last_used: float
    expires_at: float
    config_key: str
    label: str
    model: str
    #: part name -> digest: what must be equal for a session to adopt the group (see workers.warm)
    identity: tuple[tuple[str, str], ...]
    namespace: str
    gpus: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    memory_mib: int
    members: tuple[WarmMember, ...]
    keeper: Party | None = None
    adopter: Party | None = None
    #: the session log directory whose ``.lock`` the keeper holds shared (None: an explicit --sgl-log-dir)
    log_dir: str | None = None
    log_policy: str = "all"
    tainted: bool = False
    #: how many sessions adopted it
    uses: int = 0
    #: the pytest run that published it for adoption within the run (its xdist controller, or the session; ``session``:
    #: the run's id): only that run's sessions adopt it, and its keeper ends it once that process is gone
    run: Party | None = None

    @property
    def tags(self) -> frozenset[str]:
        return frozenset(m.tag for m in self.members)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(m.pid for m in self.members)

    def expires_in(self, now: float | None = None) -> float:
        return self.expires_at - (time.time() if now is None else now)

    def describe(self) -> str:
        pids = ", ".join(f"{m.pid} (port {m.port}{', GPU ' + m.gpus if m.gpus else ''})" for m in self.members)
        return f"{self.label}: pid {pids}"

    def as_dict(self) -> dict[str, Any]:
        def party(p: Party | None) -> dict[str, Any] | None:
            return None if p is None else {"pid": p.pid, "since": p.since, "session": p.session, "holder": p.holder}

        return {
            "format": FORMAT, "id": self.id, "hostname": self.hostname, "state": self.state,
            "keeper": party(self.keeper), "kept_by": party(self.kept_by), "adopter": party(self.adopter),
            "ttl": self.ttl, "created": self.created, "last_used": self.last_used, "expires_at": self.expires_at,
            "config": {"key": self.config_key, "label": self.label, "model": self.model},
            "identity": dict(self.identity), "namespace": self.namespace, "gpus": list(self.gpus),
            "gpu_uuids": list(self.gpu_uuids), "memory_mib": self.memory_mib, "log_dir": self.log_dir,
            "log_policy": self.log_policy, "tainted": self.tainted, "uses": self.uses, "run": party(self.run),
            "members": [{"role": m.role, "index": m.index, "kind": m.kind, "pid": m.pid, "since": m.since,
                         "tag": m.tag, "port": m.port, "ports": dict(m.ports), "gpus": m.gpus, "log": m.log,
                         "links": list(m.links), "log_id": m.log_id.as_list() if m.log_id else None,
                         "argv": m.argv, "started_at": m.started_at,
                         "startup_seconds": m.startup_seconds, "probe_seconds": m.probe_seconds}
                        for m in self.members],
        }


class _Fields:
    """Reads one JSON object field by field, each checked against its range; ``ValueError`` names the field."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where} is a JSON {type(data).__name__}, not an object")
        self.data = data
        self.where = where

    def _get(self, key: str) -> Any:
        if key not in self.data:
            raise ValueError(f"{self.where}: missing {key!r}")
        return self.data[key]

    def whole(self, key: str, low: int, high: int) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{self.where}: {key!r} is not a whole number in {low}..{high}")
        return value

    def number(self, key: str, low: float, high: float, *, optional: bool = False) -> float | None:
        value = self.data.get(key) if optional else self._get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"{self.where}: {key!r} is not a number in {low:g}..{high:g}")
        return float(value)

    def stamp(self, key: str, *, ahead: float = 86400.0) -> float:
        return float(self.number(key, 0.0, time.time() + ahead) or 0.0)

    def text(self, key: str, limit: int, *, printable: bool = False, optional: bool = False) -> str:
        value = self.data.get(key, "") if optional else self._get(key)
        if not isinstance(value, str) or len(value) > limit or (printable and not _PRINTABLE_RE.match(value)):
            raise ValueError(f"{self.where}: {key!r} is not {'printable ' if printable else ''}text of at most "
                             f"{limit} characters")
        return value

    def flag(self, key: str) -> bool:
        value = self.data.get(key, False)
        if not isinstance(value, bool):
            raise ValueError(f"{self.where}: {key!r} is not true or false")
        return value

    def items(self, key: str, limit: int) -> list[Any]:
        value = self.data.get(key, [])
        if not isinstance(value, list) or len(value) > limit:
            raise ValueError(f"{self.where}: {key!r} is not a list of at most {limit} entries")
        return value

    def party(self, key: str, *, optional: bool) -> Party | None:
        value = self.data.get(key) if optional else self._get(key)
        if value is None and optional:
            return None
        f = _Fields(value, f"{self.where}: {key!r}")
        return Party(f.whole("pid", 1, 1 << 22), f.stamp("since"), f.text("session", 200, optional=True),
                     f.text("holder", 4096, optional=True))


def _parse_member(raw: Any, i: int) -> WarmMember:
    f = _Fields(raw, f"member {i}")
    ports_raw = f._get("ports")
    if not isinstance(ports_raw, dict) or len(ports_raw) > 16:
        raise ValueError(f"member {i}: 'ports' is not a map of at most 16 ports")
    ports = tuple((_Fields({"n": k}, f"member {i} port").text("n", 32, printable=True),
                   _Fields({"p": v}, f"member {i} port {k!r}").whole("p", 1, 65535)) for k, v in ports_raw.items())
    links = tuple(_Fields({"l": link}, f"member {i} link").text("l", 4096) for link in f.items("links", 16))
    log = f.text("log", 4096)
    for path in (log, *links):
        if not Path(path).is_absolute() or not _LOG_NAME_RE.match(Path(path).name):
            raise ValueError(f"member {i}: {path[:200]!r} is not the path of a worker log")
    ident = f.data.get("log_id")
    if ident is not None:
        if not isinstance(ident, list) or len(ident) != 2:
            raise ValueError(f"member {i}: 'log_id' is not a device and an inode")
        ident = FileId(*(_Fields({"n": n}, f"member {i} log_id").whole("n", 0, (1 << 64) - 1) for n in ident))
    tag = f.text("tag", 200, printable=True)
    if not is_owner_tag(tag):
        raise ValueError(f"member {i}: its tag {tag[:80]!r} is not a whole owner tag")
    return WarmMember(
        role=f.text("role", 32, printable=True), index=f.whole("index", 0, 1 << 16), kind=f.text("kind", 64),
        pid=f.whole("pid", 1, 1 << 22), since=f.stamp("since"), tag=tag, log_id=ident,
        port=f.whole("port", 1, 65535), ports=ports, gpus=f.text("gpus", 200, optional=True), log=log,
        links=links, argv=f.text("argv", 65536, optional=True), started_at=f.stamp("started_at"),
        startup_seconds=f.number("startup_seconds", 0.0, 1e7, optional=True),
        probe_seconds=f.number("probe_seconds", 0.0, 1e4) or 0.0)


def parse_warm_record(raw: bytes, name: str | None = None) -> WarmRecord:
    """The record in ``raw``, validated field by field; ``ValueError`` says what cannot be trusted. ``name``: the
    file name, which must carry the record's id."""
    def no_constant(value: str) -> object:
        raise ValueError(f"{value} is not a number a warm record holds")

    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except RecursionError:
        raise ValueError("nested too deeply to be a warm record") from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({str(exc).splitlines()[0][:80]})") from None
    f = _Fields(data, "the record")
    if f.data.get("format") != FORMAT:
        raise ValueError(f"its format is {str(f.data.get('format'))[:40]!r}, not {FORMAT!r}")
    wid = f.text("id", 64, printable=True)
    if not _ID_RE.match(wid):
        raise ValueError(f"its id {wid!r} is not a warm group id")
    if name is not None:
        named = _NAME_RE.match(name)
        if named is None or named["id"] != wid:
            raise ValueError(f"it names group {wid!r}, not the one its file name says")
    state = f.text("state", 16)
    if state not in STATES:
        raise ValueError(f"its state {state[:20]!r} is not one of {', '.join(STATES)}")
    config = _Fields(f._get("config"), "'config'")
    identity_raw = f._get("identity")
    if not isinstance(identity_raw, dict) or len(identity_raw) > 32:
        raise ValueError("'identity' is not a map of at most 32 digests")
    identity = tuple(sorted((_Fields({"k": k}, "identity").text("k", 32, printable=True),
                             _Fields({"v": v}, f"identity {k!r}").text("v", 128, printable=True))
                            for k, v in identity_raw.items()))
    members = tuple(_parse_member(m, i) for i, m in enumerate(f.items("members", 64)))
    if not members:
        raise ValueError("it names no member")
    strangers = [m.index for m in members if tag_session(m.tag) != wid]
    if strangers:
        raise ValueError(f"member(s) {strangers} carry tags of another session than its keeper's ({wid})")
    gpus = tuple(_Fields({"g": g}, "'gpus'").whole("g", 0, 1 << 16) for g in f.items("gpus", 1024))
    uuids = tuple(_Fields({"u": u}, "'gpu_uuids'").text("u", 256) for u in f.items("gpu_uuids", 1024))
    policy = f.text("log_policy", 16)
    if policy not in POLICIES:
        raise ValueError(f"its log policy {policy[:20]!r} is not one of {', '.join(POLICIES)}")
    log_dir = f.data.get("log_dir")
    if log_dir is not None:
        log_dir = f.text("log_dir", 4096)
    return WarmRecord(
        id=wid, hostname=f.text("hostname", 255, printable=True), state=state,
        kept_by=f.party("kept_by", optional=False) or Party(1, 0.0), keeper=f.party("keeper", optional=True),
        adopter=f.party("adopter", optional=True), ttl=f.number("ttl", MIN_TTL, MAX_TTL) or DEFAULT_TTL,
        created=f.stamp("created"), last_used=f.stamp("last_used"),
        expires_at=f.stamp("expires_at", ahead=MAX_TTL + 86400.0),
        config_key=config.text("key", 512), label=config.text("label", 4096), model=config.text("model", 4096),
        identity=identity, namespace=f.text("namespace", 200, printable=True), gpus=gpus, gpu_uuids=uuids,
        memory_mib=f.whole("memory_mib", 0, 1 << 40), members=members, log_dir=log_dir, log_policy=policy,
        tainted=f.flag("tainted"), uses=f.whole("uses", 0, 1 << 30), run=f.party("run", optional=True))


def record_id(path: Path) -> str | None:
    """The group id a record's file name carries (``warm-<id>.json``), or None for a name that is no record's."""
    named = _NAME_RE.match(path.name)
    return named["id"] if named else None


def record_path(lock_dir: Path, wid: str) -> Path:
    """The warm record of group ``wid``."""
    return Path(lock_dir) / f"warm-{wid}.json"


def claim_path(lock_dir: Path, wid: str) -> Path:
    """The lock file whose flock is the claim on group ``wid`` (:class:`Claim`)."""
    return Path(lock_dir) / f"warm-{wid}.lock"


@dataclass(frozen=True)
class WarmEntry:
    """One ``warm-*.json`` of the lock directory: its record, or why it cannot be trusted, and the uid that owns the
    file (``fstat`` of the descriptor it was read from; None when nothing could be opened). Only a record of this
    user (:attr:`ours`) is ever acted on: another user's says at most that a GPU or a port block is busy."""

    path: Path
    record: WarmRecord | None
    problem: str | None = None
    owner: int | None = None

    @property
    def ours(self) -> bool:
        return self.owner == os.getuid()

    @property
    def mine(self) -> WarmRecord | None:
        """The record, if it is trusted and this user's."""
        return self.record if self.ours else None


def read_warm_record(path: Path) -> WarmEntry:
    from .state import read_bounded_owned

    raw, problem, owner = read_bounded_owned(path, MAX_RECORD_BYTES)
    if raw is None:
        return WarmEntry(path, None, problem or "is gone", owner)
    if not raw.strip():
        return WarmEntry(path, None, "is empty", owner)
    try:
        return WarmEntry(path, parse_warm_record(raw, path.name), None, owner)
    except (ValueError, TypeError, KeyError) as exc:
        return WarmEntry(path, None, str(exc), owner)


def warm_records(lock_dir: Path) -> list[WarmEntry]:
    """Every warm record of ``lock_dir``, trusted or not, oldest first."""
    try:
        paths = sorted(Path(lock_dir).glob("warm-*.json"))
    except OSError:
        return []
    entries = [read_warm_record(p) for p in paths]
    return sorted(entries, key=lambda e: (e.record.created if e.record else 0.0, e.path.name))


def write_warm_record(lock_dir: Path, record: WarmRecord) -> None:
    """Write ``record`` atomically (0600: it names the group's processes and logs)."""
    from .state import atomic_write

    atomic_write(record_path(lock_dir, record.id), json.dumps(record.as_dict(), indent=1), mode=0o600)


def keeper_alive(record: WarmRecord) -> bool:
    """Whether the keeper the record names is provably alive (pid, start time, and its marker naming this
    group)."""
    keeper = record.keeper
    if keeper is None or record.hostname != hostname():
        return False
    pid, _, suffix = record.id.partition("-")
    if pid != str(keeper.pid):
        return False
    return prove_process(keeper.pid, keeper.since, suffix, env_name=KEEPER_ENV) is None


def adopter_alive(record: WarmRecord) -> bool:
    adopter = record.adopter
    return adopter is not None and process_alive(adopter.pid, adopter.since, record.hostname)


def run_alive(record: WarmRecord) -> bool:
    """Whether the run that published the group (:attr:`WarmRecord.run`) still runs; True for a group kept warm
    between runs (it names no run)."""
    run = record.run
    return run is None or process_alive(run.pid, run.since, record.hostname)


def matching(records: Sequence[WarmEntry], *, config_key: str, namespace: str,
             visible: Mapping[int, str], run: str | None = None) -> list[WarmRecord]:
    """The warm records of this host that a session could adopt for ``config_key``: same lease namespace, every
    GPU among those this session sees (``visible``: index -> UUID), newest use first. A group published within a
    run is only for that run's sessions (``run``: this session's run id)."""
    here = hostname()
    found = [e.record for e in records if e.record is not None and e.ours and e.record.hostname == here
             and (e.record.run is None or e.record.run.session == run)
             and e.record.config_key == config_key and e.record.namespace == namespace
             and all(visible.get(i) == u for i, u in zip(e.record.gpus, e.record.gpu_uuids, strict=False))
             and len(e.record.gpus) == len(e.record.gpu_uuids)]
    return sorted(found, key=lambda r: -r.last_used)
