"""The worker-source protocol: where a test's workers come from.

A **worker source** hands out a :class:`~pytest_sglworker.workers.group.WorkerGroup` for a worker configuration
and takes it back after the test. The fixtures talk to one source, picked by the session when it is configured,
and have no branch per source:

- :class:`~pytest_sglworker.workers.sources.local.LocalSource`: workers launched on this machine, GPUs leased with
  file locks in the lock directory, groups pooled and reused between tests (the default);
- :class:`~pytest_sglworker.workers.sources.ray.RaySource` (``--sgl-cluster ray``): the same pool, with Ray's
  placement groups as the leases and each member started by an actor on its node;
- :class:`~pytest_sglworker.workers.sources.attached.AttachedSource` (``--sgl-worker-url``): workers somebody else
  runs, for the specs they serve; every other spec is handed to the source it wraps.

A new source (a Kubernetes job, say) is one new module here with one class that implements :class:`WorkerSource`,
and the option that selects it (``plugin/session.py``, ``make_source``).

Plain Python, no pytest.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import SglWorkerError

if TYPE_CHECKING:
    from ..config import WorkerConfig
    from ..errors import WorkerError
    from ..group import WorkerGroup
    from ..launcher import LaunchOptions
    from ..records import RunRecords

__all__ = ["GroupRequest", "GroupUse", "Refusal", "SignalSent", "SourceRefusal", "WorkerSource"]


@dataclass(frozen=True)
class GroupRequest:
    """A test's request for the workers of ``config``."""

    config: WorkerConfig
    #: who asks (the test's node id and pid): lease holder records and messages name it
    holder: str
    #: workers of its own, launched for this test and retired after it (``fresh=True``, ``sgl_spawn_worker``)
    fresh: bool = False
    #: this test's own launch options (a startup timeout, a foreign host): its workers are never shared
    options: LaunchOptions | None = None
    #: launched whatever the source (``sgl_spawn_worker``: a fresh process with the test's own args)
    launch: bool = False
    #: the test opted out of the budget check (``@pytest.mark.sgl_budget_opt_out``): workers that break it serve
    budget_opt_out: bool = False
    #: the environment a launched worker inherits, read on the main thread when the request was made (pytest's
    #: per-test variables left out); None: read when the source launches (on the main thread too)
    environ: Mapping[str, str] | None = None


@dataclass(frozen=True)
class SignalSent:
    """A signal the test itself sent during its call (``os.kill(pid, sig)``, or ``os.killpg`` to a group)."""

    pid: int
    signal: int
    group: bool = False


@dataclass(frozen=True)
class GroupUse:
    """How a test used a group, told to the source when the group is given back."""

    nodeid: str
    #: the outcome of the test's call phase: ``passed``, ``failed``, ``skipped``; ``interrupted`` when it has none
    outcome: str
    t_start: float | None = None
    t_end: float | None = None
    #: no later test of this session needs the configuration: its workers are retired, not pooled
    last_use: bool = False
    #: the configuration the next test of this process takes from the pool (None: none, or not known). Its group
    #: stays pooled even while another process waits for a GPU (given back, it would only be launched again for
    #: that test); the other idle groups are given back to that waiter
    next_config: WorkerConfig | None = None
    #: a member that died during a passing test is that test's failure (not for ``sgl_spawn_worker``'s workers,
    #: whose test owns their life)
    check_deaths: bool = True
    #: the signals the test sent through ``os.kill``/``os.killpg`` during its call: a member it killed itself
    #: did not die of a cause of its own
    signals: tuple[SignalSent, ...] = ()

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "error", "interrupted")


@dataclass(frozen=True)
class Refusal:
    """Why a source cannot serve a configuration, said at collection: ``skip`` the test with ``reason``, or an
    ``error`` (a usage error, or the test's own error under xdist)."""

    action: str  # "skip" | "error"
    reason: str


class SourceRefusal(SglWorkerError):
    """Raised by :meth:`WorkerSource.acquire` for a test collection did not see (``request.getfixturevalue``):
    the same verdict as :class:`Refusal`, met at run time."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


class WorkerSource(Protocol):
    """Where a test's workers come from. Every method but :meth:`launch_kit` is called on pytest's main thread; what
    a source does in threads of its own works from what it was handed there."""

    #: the figures and launch records this source writes (the run report reads them)
    records: RunRecords

    def describe(self) -> str:
        """One line for the report header: where workers come from."""

    def refusal(self, config: WorkerConfig, *, opt_out: bool) -> Refusal | None:
        """Why this source can never serve ``config`` here (None when it can), asked at collection before
        anything starts. ``opt_out``: the test opted out of the budget check
        (``@pytest.mark.sgl_budget_opt_out``). May raise the errors of an unreadable inventory
        (:class:`~pytest_sglworker.errors.InventoryUnavailable`, ``ValueError`` for a GPU selection that names
        GPUs that are not visible, :class:`~pytest_sglworker.errors.SglWorkerError` for an unusable lock
        directory); the caller decides how each fails."""

    def acquire(self, request: GroupRequest) -> WorkerGroup:
        """Healthy workers for ``request.config``. Raises :class:`SourceRefusal` when this source cannot serve
        it, a :class:`~pytest_sglworker.errors.SglWorkerError` (a worker error carries its diagnosis) when the
        workers cannot be had."""

    def give_back(self, group: WorkerGroup, use: GroupUse) -> WorkerError | SglWorkerError | None:
        """Take ``group`` back after a test; the error that fails that test (a member died during it, an
        attached worker stopped answering), or None."""

    def launch_ahead(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str],
                     wait_retiring: bool = True) -> bool:
        """Start ``config``'s workers now, in the background, for a test to come, inheriting ``environ`` (the
        snapshot the main thread made); whether it started. ``wait_retiring``: with no GPU free, wait for this
        process's groups being retired (false where a follower thread starts it once their GPUs are free)."""

    def ahead_kit(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str]) -> Any:
        """A launch ahead of ``config`` worked out now, for :meth:`launch_kit` to start from another thread (an xdist
        worker's follower of the controller, while a test runs); None when this source cannot launch ahead that
        way (nothing launched yet, a plugin hook shapes the workers' env, leases that are not this machine's)."""

    def launch_kit(self, kit: Any) -> bool:
        """Start :meth:`ahead_kit`'s launch ahead unless it is there already; whether it started. Called from another
        thread, as :meth:`hand_over_ready` is: it asks nothing of the session."""

    def retire_idle(self, keys: Collection[str]) -> None:
        """Stop the idle workers of the configurations ``keys`` (no later test needs them)."""

    def hand_over_ahead(self) -> None:
        """Hand the groups launched ahead here whose tests the xdist controller sent to another xdist worker of the
        run over to the run (:mod:`..pool_warm`); nothing for a source that launches nothing here."""

    def hand_over_ready(self, keys: Collection[str]) -> None:
        """:meth:`hand_over_ahead` from another thread (the follower of the controller's word, while a test runs), of
        ``keys`` (the word's, read by that thread), for the plain case only: one ready group, idle here
        (:mod:`..pool_warm`). Asks nothing of the session."""

    def gpu_count(self) -> int | None:
        """How many GPUs this source leases from (the xdist scheduler budgets by it); None when unknown. May
        raise the inventory's errors."""

    def close(self) -> None:
        """Stop what this source started and give back what it holds (end of session)."""
