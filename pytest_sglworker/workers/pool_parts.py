"""The session pool's own records (:mod:`.pool`): an entry per group it holds, a launch ahead in its thread, the
lease times and the main thread's preparation a launch is handed, and the small functions that split a lease among
a group's members and record a group's failed start. Plain Python: no pytest here."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import MemberPlan, WorkerConfig
from .errors import LaunchCancelled, WorkerStartupTimeout
from .group import WorkerGroup
from .launcher import ModelInstance
from .records import LaunchRecord
from .reset import Snapshot

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..engine.specs import ModelSpec
    from ..resources.gpus import Lease
    from ..resources.warm import BorrowedLease
    from ..resources.warm_keeper import KeeperHandle


@dataclass
class Ahead:
    """A group being launched ahead of the test that needs it, in a thread of its own."""

    config: WorkerConfig
    cancel: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class LeaseTimes:
    """When a lease taken on the main thread for a launch ahead was asked for and granted (wall clock), and
    the monotonic time it was granted (the start of its GPU-seconds): the launch's records carry the main
    thread's times, not those of the moment its thread ran."""

    requested: float
    leased: float | None  # None: no lease manager (attached or unbudgeted workers)
    leased_monotonic: float

    @classmethod
    def taken_now(cls, requested: float, lease: object | None) -> LeaseTimes:
        """The times of a lease asked for at ``requested`` and taken now (``lease`` None: none was needed)."""
        return cls(requested, time.time() if lease is not None else None, time.monotonic())


@dataclass(frozen=True)
class Prepared:
    """What a launch needs that only the main thread may work out (the kind hook, the env hook, the environment):
    made before the launch's threads start, read by them."""

    plans: list[MemberPlan]
    counts: list[int]
    environ: Mapping[str, str]


@dataclass(frozen=True)
class AheadKit:
    """A launch ahead worked out on the main thread, to be started from another (the xdist worker's follower of the
    controller's word, while a test runs): the members' plans and environment (:class:`Prepared`), the holder, and
    each member's env for a lease as a plain function (made only when no plugin hook may change it)."""

    config: WorkerConfig
    holder: str
    prepared: Prepared
    member_envs: Callable[[Lease | None], list[dict[str, str]]]


@dataclass
class Entry:
    group: WorkerGroup
    lease: Lease | BorrowedLease | None
    leased_at: float
    records: list[LaunchRecord]
    tainted: bool = False  # a test that used it failed: keep its logs
    poolable: bool = True  # False for a fresh, unshared group
    last_used: float = field(default_factory=time.monotonic)
    launched_ahead: bool = False  # its first test is not a reuse
    #: each member's run-time state as first handed out (what a reuse must find again); None: not read yet
    states: list[Snapshot] | None = None
    #: what it was launched with, for its identity should it be kept warm (None: adopted, or not known)
    envs: list[dict[str, str]] | None = None
    environ: Mapping[str, str] | None = None
    #: the keeper it was launched with (``--sgl-keep-warm``): it takes the group over at the session's end
    keeper: KeeperHandle | None = None

    @property
    def config(self) -> WorkerConfig:
        return self.group.config


def split_env(lease: Lease | BorrowedLease | None, counts: Sequence[int]) -> list[dict[str, str]]:
    """Each member's share of the group's lease, in order, as its ``CUDA_VISIBLE_DEVICES``."""
    if lease is None:
        return [{} for _ in counts]
    env = lease.env()
    if not lease.cuda_visible_devices:  # the cluster assigns the devices on the node (--sgl-cluster ray)
        return [dict(env) for _ in counts]
    devices = lease.cuda_visible_devices.split(",")
    out, start = [], 0
    for count in counts:
        out.append({**env, "CUDA_VISIBLE_DEVICES": ",".join(devices[start:start + count])})
        start += count
    return out


def member_envs(config: WorkerConfig, prepared: Prepared, lease: Lease | BorrowedLease | None,
                worker_env: Callable[[ModelSpec, dict[str, str]], dict[str, str]] | None) -> list[dict[str, str]]:
    """Each member's env, in order: the configuration's, then its plan's, then its share of the lease, which
    ``worker_env`` (``(spec, lease_env) -> env``) may shape."""
    return [{**dict(config.env), **dict(plan.env), **(worker_env(config.spec, env) if worker_env else env)}
            for env, plan in zip(split_env(lease, prepared.counts), prepared.plans, strict=True)]


CALLED_OFF = "launch ahead called off (another test needed its GPUs, or the session ended)"


def failed_outcome(exc: BaseException) -> str:
    return "startup_timeout" if isinstance(exc, WorkerStartupTimeout) else "startup_failed"


def nodeid_of(holder: str) -> str:
    """The test of a lease holder (``<nodeid> (pid N)``, as the fixtures name it)."""
    return re.sub(r" \(pid \d+\)$", "", holder)


def record_group_failure(records: Sequence[LaunchRecord], plans: Sequence[MemberPlan],
                         results: Sequence[ModelInstance | BaseException | None], first: int) -> None:
    """Each member's own end when a group fails to start: a member that failed, its own failure (its diagnosis,
    its log); a member stopped because member ``first`` failed (called off while starting, or stopped once
    ready), ``cancelled``, saying why."""
    culprit = f"{plans[first].role} {plans[first].index}"
    for record, result in zip(records, results, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, LaunchCancelled):
            record.failed(failed_outcome(result), result)
        elif isinstance(result, ModelInstance):
            record.failed("cancelled", failure=f"ready, then stopped: member {culprit} of its group failed to start")
        else:
            record.failed("cancelled", failure=f"stopped while starting: member {culprit} of its group failed to "
                                               "start")
