"""Warm worker groups between runs, the session's side (``--sgl-keep-warm``): what identifies a group's
configuration, how a session adopts a warm group the lock directory holds, and how it keeps its own groups warm
at its end.

Plain Python, no pytest. The records, the claims, the keeper and the ends of a warm group are
:mod:`pytest_sglworker.resources.warm` (its docstring tells who holds which lock when); the pool calls
:class:`Warm` on the main thread (:meth:`Warm.adopt` from ``acquire`` and ``launch_ahead``, :meth:`Warm.keep` from
``close``).

**Identity.** A warm group is adopted only when everything that makes its engine behave is what this session would
launch (:func:`identity`): the model spec and the test's configuration; every member's argv as this session would
build it on the group's ports (the launcher included); every member's environment (the spec's, the test's, the
lease's, the ``pytest_sglworker_worker_env`` hook's, and the inherited variables an engine reads:
:data:`ENGINE_ENV_PREFIXES`); the engine install (sglang's install fingerprint, else the launcher's files); the
model's files when the model is a local path (size and mtime of each); and the members' kinds. The record keeps a
digest per part, so a refusal names what changed. The GPUs must be among those this session sees (same lease
namespace, same UUIDs): a group on GPUs this session cannot see is no candidate and is left alone.

**Adoption.** For the first candidate of the configuration: its claim (a group in use by another session is left
to it), its state and keeper, then the budget (the spec's memory against the lease, sglang's args against the
budget rules as they are now), the identity, the proof that each member is the process the record names
(:func:`~pytest_sglworker.resources.processes.prove_process`), and its readiness check (a frozen or dead worker
fails it). A candidate that fails is ended at once (its GPUs come back before this session's own launch) and the
reason goes to the terminal, the summary and the run report. An adopted member's log is hard-linked into this
session's log directory (the same file, which the engine keeps writing), or, where a link cannot be made, named
where it is.

**Within a run.** Under xdist a group one xdist worker launched ahead for tests the controller then sent to another
is handed to its keeper as a record naming the run (:meth:`Warm.publish`), and the other adopts it as above: only a
session of that run matches it, and its keeper ends it when the run's controller is gone.

Why one module of this size: identity, adoption, keeping warm and handing over within a run all write or read the
same record from the same group state.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine import budget
from ..engine.redaction import mask_argv, secret_values
from ..engine.sglang_facts import LOOPBACK_HOST
from ..resources.owned_files import link_owned, why_not_ours
from ..resources.processes import SESSION_ID, AdoptedProcess, hostname, prove_process
from ..resources.warm import BorrowedLease, Claim, claim_blocked, dup_lock_fd, end_warm, forget_lock, note_in_logs
from ..resources.warm_records import (
    DEFAULT_TTL,
    Party,
    WarmMember,
    WarmRecord,
    adopter_alive,
    keeper_alive,
    matching,
    read_warm_record,
    record_path,
    warm_records,
    write_warm_record,
)
from .config import MemberPlan
from .group import WorkerGroup
from .health import log_size
from .launcher import LaunchOptions, ModelInstance, build_argv, environment_launcher, worker_env
from .process import log_name, unused_log_path

if TYPE_CHECKING:
    from ..engine.specs import ModelSpec
    from ..resources.gpus import Lease
    from ..resources.warm_keeper import KeeperHandle
    from .config import WorkerConfig
    from .records import LaunchRecord, RunRecords

__all__ = ["ENGINE_ENV_PREFIXES", "Adopted", "KeepRequest", "Warm", "WarmSettings", "identity", "not_kept_reason"]

#: Inherited environment variables that change what an engine does: part of a warm group's identity. The rest of
#: the environment (a shell's, the CI's, pytest's own, the plugin's ``SGLWORKER_*`` options) is not.
ENGINE_ENV_PREFIXES = ("SGLANG_", "SGL_", "SGLSIM_", "CUDA_", "NCCL_", "NVIDIA_", "TORCH", "PYTORCH_", "HF_",
                       "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "TRITON_", "FLASHINFER_",
                       "LD_", "PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "PATH")
#: what each identity part means, for a refusal
PART_WORDS = {
    "spec": "the model spec or the test's configuration changed",
    "argv": "its argv differs from what this session would launch",
    "env": "its environment differs (the spec's, the test's, the lease's, or engine variables such as SGLANG_*, "
           "CUDA_*, SGLSIM_*, PYTHONPATH)",
    "engine": "the engine changed (the launcher, or the files of its install)",
    "model": "the model's files changed (size or mtime)",
    "kinds": "its members' kinds or roles differ",
}
#: at most this many files of a model directory or of an engine package are looked at (their size and mtime)
_MAX_FILES = 20000


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _tree_stats(root: Path) -> list[Any]:
    """``[relative path, size, mtime_ns]`` of every file under ``root`` (bounded by :data:`_MAX_FILES`)."""
    out: list[Any] = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            out.append([os.path.relpath(path, root), _stat(path)])
            if len(out) >= _MAX_FILES:
                return out
    return out


def model_identity(model_path: str) -> Any:
    """A local model (a file or a directory): the size and mtime of its files; a hub id: its name (what the hub
    serves under it cannot be told without downloading)."""
    path = Path(model_path)
    if path.is_file():
        return ["file", model_path, _stat(model_path)]
    if path.is_dir():
        return ["dir", model_path, _tree_stats(path)]
    return ["name", model_path]


def engine_identity(launcher: Sequence[str], environ: Mapping[str, str]) -> Any:
    """The engine a launcher runs: sglang's install fingerprint (its version and files) when the launcher is
    sglang's in a venv, else the launcher executable's size and mtime and, for ``<this python> -m MODULE``, the
    files of the module's top-level package."""
    from ..engine.engine_args import find_sglang_python, install_fingerprint, python_module

    parts: list[Any] = [list(launcher)]
    python = find_sglang_python(launcher)
    fingerprint = install_fingerprint(python, environ) if python else None
    if fingerprint is not None:
        return [*parts, fingerprint]
    exe = shutil.which(launcher[0], path=environ.get("PATH", os.defpath)) or launcher[0]
    parts.append([os.path.realpath(exe), _stat(os.path.realpath(exe))])
    module = python_module(launcher)
    if module and os.path.realpath(exe) == os.path.realpath(sys.executable):
        with contextlib.suppress(Exception):
            spec = importlib.util.find_spec(module.split(".")[0])
            if spec is not None and spec.submodule_search_locations:
                parts.append(_tree_stats(Path(next(iter(spec.submodule_search_locations)))))
            elif spec is not None and spec.origin:
                parts.append([spec.origin, _stat(spec.origin)])
    return parts


def engine_environ(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(ENGINE_ENV_PREFIXES)}


def spec_identity(config: WorkerConfig) -> Any:
    spec = config.spec
    group = config.group
    shape = None if group is None else [group.count, group.prefill, group.decode, group.role_args,
                                        group.member_args, group.member_env]
    return [spec.name, spec.model, spec.memory_gb, spec.tp, sorted(spec.features), list(spec.worker_args),
            sorted(spec.env.items()), list(config.extra_args), list(config.env), shape]


def identity(config: WorkerConfig, plans: Sequence[MemberPlan], argvs: Sequence[Sequence[str]],
             envs: Sequence[Mapping[str, str]], launcher: Sequence[str], environ: Mapping[str, str],
             engine: Any | None = None) -> dict[str, str]:
    """The digest of each part of a group's identity (see the module docstring). ``argvs``: each member's full
    argv; ``envs``: what each member's environment gets beyond the inherited one (as the pool passes it to the
    launch); ``environ``: the inherited environment snapshot; ``engine``: :func:`engine_identity`, if known."""
    inherited = engine_environ(environ)
    spec = config.spec
    return {
        "spec": _digest(spec_identity(config)),
        "argv": _digest([list(a) for a in argvs]),
        "env": _digest([sorted({**inherited, **worker_env(spec, env, argv=argv, environ=environ)}.items())
                        for argv, env in zip(argvs, envs, strict=True)]),
        "engine": _digest(engine if engine is not None else engine_identity(launcher, environ)),
        "model": _digest(model_identity(spec.resolve_model_path(environ))),
        "kinds": _digest([[p.role, p.index, type(p.kind).__name__] for p in plans]),
    }


def running_differs(pid: int, argv: Sequence[str], env: Mapping[str, str], environ: Mapping[str, str]) -> str | None:
    """Why the running process ``pid`` is not what this session would launch with ``argv`` and ``env`` over the
    inherited ``environ`` (None: it is), read from the process itself (``/proc/<pid>/cmdline`` and ``environ``),
    never from a record. The arguments after the launcher's first word must be the process's last arguments (a
    launcher script's interpreter may stand before them); every variable the member's env sets, and every engine
    variable (:data:`ENGINE_ENV_PREFIXES`) of either side, must be equal."""
    import psutil

    from .process import PER_TEST_VARIABLES

    try:
        proc = psutil.Process(pid)
        cmdline, running = proc.cmdline(), proc.environ()
    except (psutil.Error, OSError) as exc:
        return f"pid {pid} cannot be read ({type(exc).__name__})"
    args = list(argv[1:])
    if len(cmdline) < len(args) or (args and cmdline[-len(args):] != args):
        diff = _first_difference(" ".join(mask_argv(cmdline)), " ".join(mask_argv(list(argv))))
        return f"pid {pid} runs other arguments than this session would launch ({diff or 'they differ'})"
    inherited = {k: v for k, v in environ.items() if k not in PER_TEST_VARIABLES}
    expected = {**engine_environ(inherited), **env, "PYTHONUNBUFFERED": "1"}
    for key in sorted(set(expected) | set(engine_environ(running))):
        if expected.get(key) != running.get(key):
            return f"pid {pid} runs with another environment than this session would give it ({key} differs)"
    return None


def _first_difference(old: str, new: str) -> str:
    a, b = old.split(), new.split()
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"at {' '.join(b[max(0, i - 1):i + 2])!r} (warm: {' '.join(a[max(0, i - 1):i + 2])!r})"
    if len(a) != len(b):
        longer, which = (a, "warm") if len(a) > len(b) else (b, "now")
        return f"{which} has {' '.join(longer[min(len(a), len(b)):])!r} more"
    return ""


@dataclass(frozen=True)
class WarmSettings:
    """What the session decided, read on the main thread."""

    lock_dir: Path
    #: this session's log directory (adopted members' logs are linked into it)
    log_dir: Path
    options: LaunchOptions
    #: ``--sgl-keep-warm``: the TTL in seconds, None when the session keeps nothing warm
    ttl: float | None = None
    #: the session log directory whose ``.lock`` a keeper holds (None: an explicit --sgl-log-dir)
    session_log_dir: Path | None = None
    log_policy: str = "all"
    #: who this session is, for the records and the messages
    holder: str = ""
    #: the run this session is part of (an xdist worker's controller: pid, start time, run id), when groups launched
    #: ahead are handed over within the run (:meth:`Warm.publish`); None: no in-run adoption
    run: Party | None = None


@dataclass
class KeepRequest:
    """A pooled group the pool would keep warm: what :meth:`Warm.keep` needs of it."""

    group: WorkerGroup
    lease: Any  # Lease | BorrowedLease | None
    records: list[LaunchRecord]
    envs: list[dict[str, str]] | None
    environ: Mapping[str, str] | None
    tainted: bool
    #: the keeper it was launched with (None: adopted, or launched by a session that keeps nothing warm)
    keeper: KeeperHandle | None = None


@dataclass
class Adopted:
    group: WorkerGroup
    lease: BorrowedLease
    records: list[LaunchRecord]


@dataclass
class Warm:
    """One pool's warm groups: those it adopted, kept warm, refused, and the engine identities it worked out."""

    settings: WarmSettings
    leases: Any  # LeaseManager
    records: RunRecords
    on_message: Callable[[str], None] = field(default=lambda text: None)
    xdist_worker: str | None = None
    #: what happened, for the summary and the run report: {"adopted": [...], "kept": [...], "refused": [...]}
    events: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"adopted": [], "kept": [], "refused": []})
    _engines: dict[str, Any] = field(default_factory=dict)
    #: the events and the engine identities are written by the main thread and by an xdist worker's follower thread
    #: (:meth:`publish` while a test runs)
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _engine(self, launcher: Sequence[str], environ: Mapping[str, str]) -> Any:
        key = _digest([list(launcher), engine_environ(environ)])
        with self._guard:
            known = self._engines.get(key)
        if known is None:
            known = engine_identity(launcher, environ)
            with self._guard:
                self._engines.setdefault(key, known)
        return known

    def _launcher(self, environ: Mapping[str, str]) -> list[str]:
        return list(self.settings.options.launcher or environment_launcher(environ))

    # -- adoption ---------------------------------------------------------------------------------------------
    def may_have(self, config_key: str) -> bool:
        """Whether a warm record of ``config_key`` lies in the lock directory, trusted or not: a launch ahead from
        another thread leaves that configuration to the main thread, which adopts (any thread: it reads files)."""
        return any(e.record is not None and e.record.config_key == config_key
                   for e in warm_records(self.settings.lock_dir))

    def adopt(self, config: WorkerConfig, plans: Sequence[MemberPlan], *, holder: str, environ: Mapping[str, str],
              member_envs: Callable[[Any], list[dict[str, str]]]) -> Adopted | None:
        """A warm group of ``config`` this session may have, adopted (claimed, recorded as ours), or None.
        ``member_envs(lease)``: each member's env on that lease, as the pool would launch it (main thread)."""
        entries = warm_records(self.settings.lock_dir)
        if not entries or self.leases is None:
            return None
        visible = {g.index: g.uuid for g in self.leases.inventory.static_gpus()}
        run = self.settings.run.session if self.settings.run is not None else None
        for record in matching(entries, config_key=config.key, namespace=self.leases.namespace, visible=visible,
                               run=run):
            adopted = self._try(record, config, plans, holder, environ, member_envs)
            if adopted is not None:
                return adopted
        return None

    def _try(self, record: WarmRecord, config: WorkerConfig, plans: Sequence[MemberPlan], holder: str,
             environ: Mapping[str, str], member_envs: Callable[[Any], list[dict[str, str]]]) -> Adopted | None:
        claim = Claim.take(self.settings.lock_dir, record.id)
        if claim is None:
            if (blocked := claim_blocked(self.settings.lock_dir, record.id)) is not None:  # no use waiting for it
                self._event("refused", record, f"{blocked} (its keeper ends it for a waiter, at its TTL)", ended=False)
                return None
            claim = Claim.take(self.settings.lock_dir, record.id, wait=1.0) if not (
                record.state == "adopted" and adopter_alive(record)) else None
            if claim is None:
                who = record.adopter
                self._event("refused", record, "in use by another session" + (
                    f" (pytest pid {who.pid}: {who.holder})" if who else ""), ended=False)
                return None
        current = claim.read()
        if current is None or current.state != "warm":
            claim.release()  # ended, or being handed over, meanwhile
            return None
        lease = self._borrowed(claim, current, holder)
        try:
            why, instances = self._check(current, config, plans, environ, member_envs, lease)
        except Exception as exc:  # a check must never leave the claim held or the group half-adopted
            why, instances = f"it could not be checked ({type(exc).__name__}: {exc})", []
        if why is not None:
            for instance in instances:
                with contextlib.suppress(Exception):
                    instance.close_client()
            self.on_message(f"warm {current.label} (kept by pid {current.kept_by.pid} since "
                            f"{time.strftime('%H:%M:%S', time.localtime(current.created))}) not adopted: {why}; "
                            "ending it, a fresh one starts")
            end_warm(claim, current, f"not adopted by pytest pid {os.getpid()}: {why}")
            self._event("refused", current, why, ended=True)
            return None
        now = time.time()
        links = [Path(i.log_path) for i in instances]
        members = tuple(replace(m, links=(*m.links, str(link)) if str(link) != m.log else m.links)
                        for m, link in zip(current.members, links, strict=True))
        adopted = replace(current, state="adopted", members=members, uses=current.uses + 1,
                          adopter=Party(os.getpid(), now, SESSION_ID, holder))
        claim.write(adopted)
        lease.record = adopted
        lease.own_logs = tuple(str(link) for link in links)
        note_in_logs(adopted, f"adopted by pytest pid {os.getpid()} ({holder})")
        group = WorkerGroup(config, instances, f"{self.xdist_worker or 'main'}-{os.getpid()}-warm-{current.id}")
        launch_records = [self._record(config, plan, group.id if len(plans) > 1 else None, instance, now)
                          for plan, instance in zip(plans, instances, strict=True)]
        self._event("adopted", adopted, None, ended=False, log=[str(i.log_path) for i in instances])
        return Adopted(group, lease, launch_records)

    def _borrowed(self, claim: Claim, record: WarmRecord, holder: str) -> BorrowedLease:
        by_index = {g.index: g for g in self.leases.inventory.static_gpus()}
        gpus = tuple(by_index[i] for i in record.gpus if i in by_index)
        return BorrowedLease(claim, record, gpus, self.leases.inventory.visible_devices_value(gpus), holder)

    def _check(self, record: WarmRecord, config: WorkerConfig, plans: Sequence[MemberPlan],
               environ: Mapping[str, str], member_envs: Callable[[Any], list[dict[str, str]]],
               lease: BorrowedLease) -> tuple[str | None, list[ModelInstance]]:
        """Why ``record`` cannot be adopted for ``config`` (None: it can), and its members as instances."""
        if not keeper_alive(record):
            return "its keeper is gone", []
        if time.time() >= record.expires_at:
            return "it expired", []
        spec = config.spec
        if record.memory_mib < spec.memory_mib:
            return (f"its GPUs were leased with {record.memory_mib} MiB each; the spec now needs "
                    f"{spec.memory_mib} MiB"), []
        why_never = self.leases.can_ever_fit(len(record.gpus), spec.memory_mib)
        if why_never:
            return f"this session's inventory cannot hold it: {why_never}", []
        for plan in plans:
            problems = budget.check_argv([*spec.worker_args, *plan.extra_args])
            if problems and not config.opt_out:
                return f"the budget check fails now: {'; '.join(map(str, problems))}", []
        if len(plans) != len(record.members) or len(lease.gpus) != len(record.gpus):
            return PART_WORDS["kinds"], []
        launcher = self._launcher(environ)
        options = self.settings.options
        argvs = [build_argv(spec, port=m.port, nccl_port=dict(m.ports).get("nccl"), launcher=launcher,
                            extra_args=plan.extra_args, allow_foreign_host=options.allow_foreign_host,
                            role_args=plan.kind.role_args(dict(m.ports)), environ=environ)
                 for plan, m in zip(plans, record.members, strict=True)]
        envs = member_envs(lease)
        mine = identity(config, plans, argvs, envs, launcher, environ, self._engine(launcher, environ))
        theirs = dict(record.identity)
        changed = [part for part in mine if theirs.get(part) != mine[part]]
        if changed:
            words = "; ".join(PART_WORDS.get(p, p) for p in changed)
            if "argv" in changed:
                for m, argv in zip(record.members, argvs, strict=True):
                    diff = _first_difference(m.argv, " ".join(mask_argv(argv)))
                    if diff:
                        words += f" ({m.role} {m.index}: {diff})"
                        break
            return words, []
        for m, argv, env in zip(record.members, argvs, envs, strict=True):
            why = prove_process(m.pid, m.since, m.tag) or running_differs(
                m.pid, argv, worker_env(config.spec, env, argv=argv, environ=environ), environ)
            if why is not None:
                return f"member {m.role} {m.index} is not the process its record names: {why}", []
            why = why_not_ours(m.log, m.log_id)
            if why is not None:
                return f"member {m.role} {m.index}'s log {m.log} {why}", []
        instances = [self._instance(config.spec, plan, m, argv, env, environ)
                     for plan, m, argv, env in zip(plans, record.members, argvs, envs, strict=True)]
        for instance, m in zip(instances, record.members, strict=True):
            if not instance.responds():  # its ready probe's time is the record's
                state = "died" if not instance.is_alive() else "does not answer its readiness check (frozen or wedged)"
                return f"member pid {m.pid} {state}", instances
        return None, instances

    def _instance(self, spec: ModelSpec, plan: MemberPlan, member: WarmMember, argv: list[str],
                  env: Mapping[str, str], environ: Mapping[str, str]) -> ModelInstance:
        now = time.time()
        instance = ModelInstance(
            spec=spec, host=LOOPBACK_HOST, port=member.port, tail_lines=self.settings.options.tail_lines,
            kind=plan.kind, index=plan.index, ports=dict(member.ports), gpus=member.gpus or None, argv=argv,
            log_path=self._link_log(member), process=AdoptedProcess(member.pid, member.since, tag=member.tag),
            owner_tag=member.tag,
            secrets=secret_values({**environ, **worker_env(spec, env, argv=argv, environ=environ)}, argv),
            times={"started": now, "ready": now}, ready_probe_seconds=member.probe_seconds)
        instance.ready_at = instance.started_at
        instance.ready_log_offset = log_size(instance.log_path)  # what it serves this session
        instance.remember_tree()
        return instance

    def _link_log(self, member: WarmMember) -> Path:
        """The member's log in this session's log directory: a hard link of its log file (the engine keeps
        writing the same file), or, when no link can be made there (another file system), the file where it is."""
        source = Path(member.log)
        target = self.settings.log_dir / log_name("sglang-worker", member.port)
        if why_not_ours(target, member.log_id) is None:
            return target  # linked already (this session adopted it before)
        target = unused_log_path(target)
        if link_owned(source, member.log_id, target) is None:
            return target
        return source  # checked by _check: the very file its session created

    def _record(self, config: WorkerConfig, plan: MemberPlan, group: str | None, instance: ModelInstance,
                now: float) -> LaunchRecord:
        record = self.records.new_launch(
            config=config.key, label=config.label, model=config.spec.model, role=plan.role, group=group,
            xdist_worker=self.xdist_worker, node=hostname(), t_lease_requested=now, t_leased=now)
        record.take_times(instance)
        record.port, record.pid, record.log_path = instance.port, instance.pid, str(instance.log_path)
        record.argv = " ".join(mask_argv(instance.argv))
        record.gpus = [int(g) for g in (instance.gpus or "").split(",") if g.strip().isdigit()]
        record.outcome = "adopted"
        return record

    # -- keeping warm -----------------------------------------------------------------------------------------
    def keep(self, requests: Sequence[KeepRequest], *, still: Callable[[], bool] | None = None) -> set[str]:
        """Keep each group warm (when every member still answers its readiness check): an adopted one goes back
        to its keeper with a new expiry; a group of this session goes to the keeper it was launched with, which
        takes over its lock files. ``still()``, asked before each group: whether to go on (an interrupt during the
        session's end says no: the groups not handed over yet are retired). Returns the ids of the groups kept; the
        pool retires the rest as usual."""
        ttl = self.settings.ttl
        kept: set[str] = set()
        if ttl is None:
            return kept
        for request in requests:
            if still is not None and not still():
                break
            if not all(m.is_alive() and not m.stopped and m.responds() for m in request.group):
                continue
            try:
                if isinstance(request.lease, BorrowedLease):
                    self._keep_adopted(request, ttl)
                elif not self._hand_over(request, ttl):
                    continue
            except Exception as exc:  # keeping warm is an optimisation: the group is torn down instead
                self.on_message(f"could not keep {request.group.config.label} warm: {type(exc).__name__}: {exc}")
                continue
            kept.add(request.group.id)
        return kept

    def _kept(self, request: KeepRequest, record: WarmRecord) -> None:
        """The group left this session: kept warm, or handed over within the run (the record names the run)."""
        now = time.time()
        for member in request.group:
            member.close_client()
            member.times["stop_requested"] = member.times["stopped"] = now
        for launch, member in zip(request.records, request.group, strict=False):
            launch.take_times(member)
            launch.outcome = "kept_warm" if record.run is None else "handed_over"
        self._event("kept" if record.run is None else "handed", record, None, ended=False)

    def _keep_adopted(self, request: KeepRequest, ttl: float) -> None:
        lease: BorrowedLease = request.lease
        now = time.time()
        record = replace(lease.record, state="warm", adopter=None, ttl=ttl, run=None, last_used=now,
                         expires_at=now + ttl,
                         tainted=lease.record.tainted or request.tainted,
                         kept_by=Party(os.getpid(), now, SESSION_ID, self.settings.holder))
        lease.keep_warm(record)
        self._kept(request, record)

    def publish(self, request: KeepRequest, *, say: Callable[[str], None] | None = None) -> bool:
        """Hand an idle group launched ahead to its keeper during the session, as a record of this session's run
        (:attr:`WarmSettings.run`): only a session of the run adopts it (the xdist worker the controller sent its
        tests to), and its keeper ends it when the run ends. Whether it was handed over (else the pool retires it).
        ``say``: where what went wrong is said (default ``on_message``; from another thread, a queue of its own)."""
        say = self.on_message if say is None else say
        try:
            return self._hand_over(request, DEFAULT_TTL, run=self.settings.run, say=say)
        except Exception as exc:  # handing over is an optimisation: the group is torn down instead
            say(f"could not hand {request.group.config.label} over: {type(exc).__name__}: {exc}")
            return False

    def _hand_over(self, request: KeepRequest, ttl: float, *, run: Party | None = None,
                   say: Callable[[str], None] | None = None) -> bool:
        """Write the group's record and hand its keeper duplicates of its lock descriptors; once the keeper has
        taken them, forget this process's own (the flocks stay held all along)."""
        say = self.on_message if say is None else say
        lease: Lease | None = request.lease
        group = request.group
        keeper = request.keeper
        if keeper is None or lease is None or request.envs is None or request.environ is None or \
                any(m.port_block is None or m.port_block.held_lock() is None for m in group):
            return False  # a group not launched to be kept warm, or without a file lease of this machine
        locks: list[Any] = [*lease.held_locks(), *(m.port_block.held_lock() for m in group if m.port_block)]
        fds: list[int] = []
        try:
            for lock in locks:
                fds.append(dup_lock_fd(lock))
            record = replace(self._new_record(request, ttl, keeper.session_id), run=run)
            write_warm_record(self.settings.lock_dir, record)
            why = keeper.hand_over(fds)
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
        finally:
            for fd in fds:
                os.close(fd)
        if why is not None:
            with contextlib.suppress(OSError):
                record_path(self.settings.lock_dir, keeper.session_id).unlink()
            say(f"could not keep {group.config.label} warm: {why}; it is torn down instead")
            return False
        for lock in locks:
            forget_lock(lock)
        lease.handed_over()
        for member in group:
            if member.port_block is not None:
                member.port_block.handed_over()
                member.port_block = None
        acked = read_warm_record(record_path(self.settings.lock_dir, keeper.session_id)).mine or record
        keeper.close()  # its socket: the keeper is warm now and ignores it
        self._kept(request, acked)
        return True

    def _new_record(self, request: KeepRequest, ttl: float, wid: str) -> WarmRecord:
        group = request.group
        config = group.config
        lease = request.lease
        environ = request.environ or {}
        member_plans = [MemberPlan(m.role, m.index, m.kind, ()) for m in group]
        launcher = self._launcher(environ)
        parts = identity(config, member_plans, [m.argv for m in group], request.envs or [], launcher, environ,
                         self._engine(launcher, environ))
        now = time.time()
        members = tuple(WarmMember(
            role=m.role, index=m.index, kind=type(m.kind).__name__, pid=m.pid,
            since=_create_time(m.pid), tag=m.owner_tag, port=m.port,
            ports=tuple(sorted(m.ports.items())), gpus=m.gpus or "", log=str(m.log_path), log_id=m.log_id,
            argv=" ".join(mask_argv(m.argv)), started_at=m.times.get("started", now),
            startup_seconds=m.startup_seconds, probe_seconds=m.ready_probe_seconds) for m in group)
        session_dir = self.settings.session_log_dir
        return WarmRecord(
            id=wid, hostname=hostname(), state="handover",
            kept_by=Party(os.getpid(), now, SESSION_ID, self.settings.holder), ttl=ttl, created=now, last_used=now,
            expires_at=now + ttl, config_key=config.key, label=config.label, model=config.spec.model,
            identity=tuple(sorted(parts.items())), namespace=lease.namespace, gpus=tuple(lease.indices),
            gpu_uuids=tuple(g.uuid for g in lease.gpus), memory_mib=lease.memory_mib, members=members,
            log_dir=str(session_dir) if session_dir is not None else None, log_policy=self.settings.log_policy,
            tainted=request.tainted)

    # -- the record of the run --------------------------------------------------------------------------------
    def _event(self, kind: str, record: WarmRecord, why: str | None, *, ended: bool,
               log: list[str] | None = None) -> None:
        event: dict[str, Any] = {
            "id": record.id, "config": record.config_key, "label": record.label, "model": record.model,
            "pids": list(record.pids), "ports": [m.port for m in record.members], "gpus": list(record.gpus),
            "logs": log or [m.log for m in record.members], "kept_since": round(record.created, 3),
            "kept_by_pid": record.kept_by.pid,
        }
        if kind == "kept":
            event.update(until=ms_below(record.expires_at), ttl=record.ttl,
                         keeper_pid=record.keeper.pid if record.keeper else None)
        if kind == "refused":
            event.update(why=why, ended=ended)
        if kind == "adopted":
            event.update(uses=record.uses, run=record.run is not None, adopter_pid=os.getpid())
        with self._guard:
            self.events.setdefault(kind, []).append(event)  # "handed": only in a run that hands groups over


def ms_below(moment: float) -> float:
    """``moment`` (epoch seconds) to the millisecond below, never above (``round`` took 12:00:20.9996 to 12:00:21.000):
    its second is the one a line that names the unrounded moment shows."""
    return math.floor(moment * 1000) / 1000


def _create_time(pid: int) -> float:
    """The start time of our child ``pid`` (what a record's proof compares)."""
    import psutil

    return float(psutil.Process(pid).create_time())


def not_kept_reason(dead: bool, stopped: bool, poolable: bool, closing: str | None) -> str:
    """Why a retired group of a ``--sgl-keep-warm`` session was not kept warm, for the summary (``closing``: None
    during the session, ``"keep"`` or ``"stop"`` once the pool closes)."""
    if dead:
        return "a member died during the session"
    if stopped:
        return "a member was stopped on purpose (worker.kill(), or an exit it expected)"
    if not poolable:
        return "its workers were fresh, each for one test"
    if closing == "stop":
        return "the session was interrupted: nothing is kept warm then"
    if closing:
        return ("not taken by its keeper at the session's end (a member did not answer, or the keeper could not take "
                "it: see the messages above)")
    return "retired during the session (its GPUs were wanted, or what a test changed could not be set back)"
