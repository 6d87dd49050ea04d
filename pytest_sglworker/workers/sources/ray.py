"""``--sgl-cluster ray``: workers placed on a Ray cluster, Ray's scheduler in place of the file-lock GPU leases
(:class:`RaySource`, the worker source of this mode).

Plain Python: no pytest here; ``ray`` is imported only in this mode (lazily, inside functions), so the plugin
stays cheap in every other run.

How it fits the pool
--------------------
- :class:`RaySource` is a :class:`~pytest_sglworker.workers.sources.local.PoolSource` whose lease manager is a
  :class:`RayLeaseManager`: the pool, its reuse, its launch records and its teardown are the local source's.
- :class:`RayLeaseManager` stands where :class:`~pytest_sglworker.resources.gpus.LeaseManager` stands: a worker group's
  lease is one Ray **placement group** with one bundle ``{"GPU": tp x dp}`` per member, reserved atomically
  (two groups never each hold half of what the other needs, as with local leases). A cluster that is full
  leaves the placement group pending; the wait has the local lease's timeout (``--sgl-lease-timeout``), its
  progress messages and a :class:`~pytest_sglworker.errors.LeaseTimeout`; the pending group is then removed.
  The inventory (collection-time skips) is the cluster's ``GPU`` resource.
- Each member runs in a :class:`WorkerHost` actor on its bundle's node, taken from :mod:`.ray_hosts` (hosts are
  kept from one lease to the next and started ahead: a new actor costs seconds; a short task in the bundle tells
  the node and the GPUs Ray assigned it). The actor starts the engine there with those GPUs as
  ``CUDA_VISIBLE_DEVICES``, the plugin's owner tag and a log file on the node, and runs the plugin's watchdog there
  (:class:`~pytest_sglworker.resources.reaper.Watchdog`, its pipe held by the actor): when the actor dies by any means
  (``ray.kill``, the driver pytest SIGKILLed, which makes Ray end its non-detached actors), the engine's whole
  tree on that node is killed.
- :class:`RayWorker` is the pytest side of such a worker: a
  :class:`~pytest_sglworker.workers.launcher.ModelInstance` whose process handle (:class:`RemoteProcess`), port check,
  log tail and teardown go through its actor. Releasing the lease stops the trees (a host whose tree does not
  stop is killed), gives the hosts back, removes the placement group.

Why one module of this size: the pytest side of a worker on the cluster (:class:`RemoteProcess`, ``RayWorker``,
:meth:`RayLeaseManager.starter`) reads the dicts that the actor's ``node``, ``start`` and ``stop`` return, and the
lease manager, its leases and their workers share one connection to the cluster (the manager's ``ray``). The actor
itself is in :mod:`.ray_hosts`, with the hosts kept and started ahead; joining the cluster in :mod:`.ray_connect`.
Starting a process, tearing its tree down and reading its log are the launcher's and the process module's, called
here, not copied; the local leases are in :mod:`pytest_sglworker.resources.gpus`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ...errors import LeaseImpossible, LeaseTimeout
from ...resources.gpus import GpuInfo, Inventory, ReleaseReport
from ...resources.processes import OWNER_ENV, SESSION_ID, hostname
from ..errors import LaunchError
from .local import PoolSource
from .ray_connect import (
    CLIENT_CONNECT_TIMEOUT,
    CONNECT_TIMEOUT,
    INSTALL_HINT,
    ClusterSpec,
    ClusterUnavailable,
    _import_ray,
    cluster_address,
    connect,
    parse_cluster,
    ray_auth,
)
from .ray_hosts import WorkerHost

if TYPE_CHECKING:
    from ...engine.specs import ModelSpec
    from ..config import WorkerConfig
    from ..kinds import WorkerKind
    from ..launcher import LaunchOptions, ModelInstance

__all__ = [
    "INSTALL_HINT",
    "ClusterSpec",
    "ClusterUnavailable",
    "RayLease",
    "RayLeaseManager",
    "RaySource",
    "RemoteProcess",
    "WorkerHost",
    "parse_cluster",
]

#: placement groups the plugin makes are named ``<prefix><session>-<n>``: others' pending ones mean waiters
PG_PREFIX = "sglworker-"
#: Environment variables of the pytest process that reach the engine on the node (the rest of the engine's
#: environment is the node's): the plugin's and the simulated engine's, sglang's, Hugging Face's, NCCL's.
FORWARDED_PREFIXES = ("SGL", "HF_", "HUGGING", "NCCL_", "TRANSFORMERS_", "TOKENIZERS_")
#: A memory size for Ray's GPUs, which Ray does not know: the budget check, not the lease, judges memory.
RAY_GPU_MIB = 80 * 1024
#: How long a non-blocking attempt waits for a placement group that fitted the free GPUs when it was asked for.
TRY_WAIT_SECONDS = 30.0
_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) and k != OWNER_ENV}





def _started() -> float:
    import psutil

    return float(psutil.Process().create_time())


# ---------------------------------------------------------------------------------------------- pytest side


class RemoteProcess:
    """A ``subprocess.Popen``-like handle on a worker process that lives in a :class:`WorkerHost` actor: what
    the health wait and the pool need (``pid``, ``poll()``, ``returncode``, ``send_signal``). An actor that
    died reads as an exit (``-SIGKILL``)."""

    POLL_CACHE_SECONDS = 0.05

    def __init__(self, actor: Any, pid: int, ray: Any) -> None:
        self.actor = actor
        self.pid = pid
        self._ray = ray
        self._code: int | None = None
        self._asked = 0.0
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self._code is not None:
                return self._code
            now = time.monotonic()
            if now - self._asked < self.POLL_CACHE_SECONDS:
                return None
            self._asked = now
            try:
                self._code = self._ray.get(self.actor.poll.remote(self.pid), timeout=30)
            except Exception:  # the actor (its node) is gone: so is the process
                self._code = -signal.SIGKILL
            return self._code

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(Exception):
            self._ray.get(self.actor.signal.remote(int(sig), self.pid), timeout=30)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("<ray worker>", timeout or 0.0)
            time.sleep(self.POLL_CACHE_SECONDS)

    def forget(self, code: int | None) -> None:
        with self._lock:
            self._code = code if code is not None else -signal.SIGKILL


def _worker_class() -> type[ModelInstance]:
    """:class:`RayWorker`, made on first use (it subclasses the launcher's ``ModelInstance``)."""
    global _RAY_WORKER
    if _RAY_WORKER is None:
        from ..launcher import ModelInstance

        @dataclass(kw_only=True)
        class RayWorker(ModelInstance):
            """A worker started by a :class:`WorkerHost` actor: its process handle, port check, log and
            teardown go through the actor; its lease (the placement group) is the pool's."""

            ray_node: str = ""
            #: the actor process's node, as its hostname says (the log is local when it is this machine's)
            log_local: bool = True
            _ray: Any = field(default=None, repr=False)
            _actor: Any = field(default=None, repr=False)

            def describe(self) -> str:
                return super().describe().replace(" on ", f" on Ray node {self.ray_node} at ", 1)

            def owns_port(self) -> bool:
                try:
                    return bool(self._ray.get(self._actor.owns_port.remote(self.port), timeout=30))
                except Exception:
                    return False

            def log_tail(self, lines: int = 40) -> str:
                from ...engine.redaction import redact

                if self.log_local and self.log_path.exists():
                    return super().log_tail(lines)
                try:
                    text = str(self._ray.get(self._actor.log_tail.remote(lines, path=str(self.log_path)), timeout=30))
                except Exception as exc:
                    text = f"<log on Ray node {self.ray_node} unreadable: {type(exc).__name__}>"
                return redact(text, self.secrets)

            def log_end(self) -> tuple[list[str], int]:
                if self.log_local and self.log_path.exists():
                    return super().log_end()
                return self.log_tail(2000).splitlines(), -1  # another node's log: where it starts is unknown

            def log_text(self, max_bytes: int = 4 * 1024 * 1024) -> str:
                from ...engine.redaction import redact

                if self.log_local and self.log_path.exists():
                    return super().log_text(max_bytes)
                try:
                    return redact(str(self._ray.get(self._actor.log_text.remote(max_bytes, path=str(self.log_path)),
                                                    timeout=30)),
                                  self.secrets)
                except Exception:
                    return ""

            def remove_log(self) -> None:
                super().remove_log()
                with contextlib.suppress(Exception):
                    self._ray.get(self._actor.remove_log.remote(str(self.log_path)), timeout=30)

            def _tree(self, *, sweep: bool = True) -> list[Any]:
                return []

            def _terminate(self, term_timeout: float, kill_timeout: float) -> list[int]:
                """The tree's teardown on its node, through the actor."""
                killed: list[int] = []
                try:
                    result = self._ray.get(self._actor.stop.remote(term_timeout, kill_timeout),
                                           timeout=term_timeout + 2 * kill_timeout + 30)
                    killed = list(result["killed"])
                    self.pids_seen.update(result["pids"])
                    cast(RemoteProcess, self.process).forget(result["returncode"])
                except Exception as exc:  # the actor is gone: its watchdog ended the tree
                    self.warnings.append(f"the Ray actor of {self.describe()} was gone at teardown "
                                         f"({type(exc).__name__}); its node's watchdog ends the worker's tree")
                    cast(RemoteProcess, self.process).forget(None)
                return killed

            def _clear_ports(self) -> bool:
                # Another node's listeners cannot be seen from here: its block is released as it is.
                return not self.log_local or super()._clear_ports()

        _RAY_WORKER = RayWorker
    return _RAY_WORKER


_RAY_WORKER: type[ModelInstance] | None = None


def __getattr__(name: str) -> Any:  # ``ray_cluster.RayWorker`` without importing the launcher at import time
    if name == "RayWorker":
        return _worker_class()
    raise AttributeError(name)


class RayInventory(Inventory):
    """The cluster's GPUs, as Ray counts them (``cluster_resources()["GPU"]``)."""

    source = "ray"
    namespace = "ray"

    def __init__(self, manager: RayLeaseManager) -> None:
        self._manager = manager

    def snapshot(self) -> list[GpuInfo]:
        total = int(self._manager.ray.cluster_resources().get("GPU", 0))
        return [GpuInfo(index=i, uuid=f"GPU-ray-{i:012d}", name=f"ray-gpu-{i}", total_mib=RAY_GPU_MIB,
                        free_mib=RAY_GPU_MIB) for i in range(total)]

    def visible_devices_value(self, gpus: Sequence[GpuInfo]) -> str:
        return ""  # Ray assigns CUDA_VISIBLE_DEVICES on the node

    def describe(self) -> str:
        return self._manager.describe()

    def can_ever_fit(self, tp: int, memory_mib: int) -> str | None:
        if tp < 1:
            return f"tp={tp}: a lease needs at least one GPU"
        total = len(self.static_gpus())
        if tp > total:
            return f"tp={tp} needs {tp} GPUs but the inventory has {total} ({self.describe()})"
        largest = self._manager.largest_node_gpus()
        if tp > largest:
            return (f"tp={tp} needs {tp} GPUs on one node but the largest node of the {self.describe()} has "
                    f"{largest}")
        return None

    def close(self) -> None:
        self._manager.shutdown()


class RayLease:
    """A worker group's placement group: one bundle per member, held until :meth:`release`."""

    def __init__(self, manager: RayLeaseManager, pg: Any, counts: Sequence[int], holder: str, name: str) -> None:
        self._manager = manager
        self.pg = pg
        self.counts = list(counts)
        self.holder = holder
        self.name = name
        self.memory_mib = 0
        self.namespace = "ray"
        self.acquired_at = time.time()
        self.cuda_visible_devices = ""
        total = sum(self.counts)
        self.gpus = tuple(GpuInfo(index=i, uuid=f"GPU-ray-{name}-{i}", name=f"ray GPU {i + 1}/{total} of {name}",
                                  total_mib=RAY_GPU_MIB, free_mib=RAY_GPU_MIB) for i in range(total))
        self.actors: dict[int, tuple[str, Any]] = {}  # bundle -> (node, host)
        self.gpu_ids: dict[int, str] = {}  # bundle -> the GPUs Ray assigned it, as CUDA_VISIBLE_DEVICES
        self._lock = threading.Lock()
        self._report: ReleaseReport | None = None

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    @property
    def released(self) -> bool:
        return self._report is not None

    def env(self) -> dict[str, str]:
        return {}

    def host(self, bundle: int) -> Any:
        """The host actor of bundle ``bundle``: on first use, the bundle's node and GPUs are asked for (a task in
        the bundle), and an idle host of that node taken (:mod:`.ray_hosts`)."""
        with self._lock:
            if self._report is not None:
                raise LaunchError(f"the Ray lease {self.name} was released")
            if bundle not in self.actors:
                hosts = self._manager.hosts
                node = hosts.bundle_node(self.pg, bundle)
                if node is None:  # not in the cluster's table: a task in the bundle says where it is
                    node, ids = hosts.place(self.pg, bundle, self.counts[bundle])
                    self.actors[bundle] = (node, hosts.take(node))
                else:  # the host runs that task (given back with the lease if it fails)
                    self.actors[bundle] = (node, hosts.take(node))
                    _, ids = hosts.place_by(self.actors[bundle][1], self.pg, bundle, self.counts[bundle])
                self.gpu_ids[bundle] = ",".join(ids)
            return self.actors[bundle][1]

    def spawner(self, bundle: int) -> Callable[..., ModelInstance]:
        """A ``spawn_worker`` that starts a member in bundle ``bundle`` of this lease (the member's place in
        the group, as the pool split the lease)."""
        from ..launcher import spawn_worker

        def spawn(spec: ModelSpec, **kwargs: Any) -> ModelInstance:
            return spawn_worker(spec, starter=self._manager.starter(self, bundle), **kwargs)

        return spawn

    def hand_over(self, holder: str, *, wait_timeout: float = 60.0) -> RayLease | None:
        """This lease's placement group as a new lease for ``holder``, never removed in between: the engines of
        its hosts stopped, each host kept in its bundle (one whose engine did not stop is ended, and the bundle
        takes another when it starts its next member). None when this lease was released."""
        with self._lock:
            if self._report is not None:
                return None
            self._report = ReleaseReport(gpus=self.indices, source="ray", memory_back=True, waited_s=0.0)
            actors = dict(self.actors)
            self.actors.clear()
        start = time.monotonic()
        kept = self._manager.hosts.stop_engines(list(actors.values()), timeout=wait_timeout)
        successor = RayLease(self._manager, self.pg, self.counts, holder, self.name)
        successor.actors = {b: a for b, a in actors.items() if any(a[1] is k for _, k in kept)}
        successor.gpu_ids = {b: ids for b, ids in self.gpu_ids.items() if b in successor.actors}
        self._report = ReleaseReport(gpus=self.indices, source="ray", memory_back=True,
                                     waited_s=time.monotonic() - start)
        return successor

    def release(self, *, worker_pids: Collection[int] = (), wait_timeout: float = 60.0) -> ReleaseReport:
        """Stop what still runs on the hosts (which go back to the pool), then remove the placement group.
        Idempotent."""
        with self._lock:
            if self._report is not None:
                return self._report
            self._report = ReleaseReport(gpus=self.indices, source="ray", memory_back=True, waited_s=0.0)
            actors = list(self.actors.values())
            self.actors.clear()
        start = time.monotonic()
        self._manager.hosts.give_back(actors, timeout=wait_timeout)
        self._manager.remove_pg(self.pg)
        self._report = ReleaseReport(gpus=self.indices, source="ray", memory_back=True,
                                     waited_s=time.monotonic() - start)
        return self._report

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<RayLease {self.name} bundles {self.counts} for {self.holder!r} ({state})>"


class RayLeaseManager:
    """GPU leases from a Ray cluster, with the :class:`~pytest_sglworker.resources.gpus.LeaseManager` surface the pool
    and collection use (``try_acquire``, ``acquire``, ``others_waiting``, ``can_ever_fit``, ``inventory``,
    ``lock_dir``: the local lock directory, still used for port blocks)."""

    #: a lease is asked for with each member's GPU count (one bundle per member)
    per_member = True

    def __init__(self, cluster: ClusterSpec, lock_dir: Path, *, connect_timeout: float | None = None,
                 notice_interval: float = 30.0, poll_interval: float = 0.2,
                 on_message: Callable[[str], None] | None = None, controller: str | None = None,
                 xdist_worker: str | None = None) -> None:
        self.cluster = cluster
        self.lock_dir = Path(lock_dir)
        self.namespace = "ray"
        self.notice_interval = notice_interval
        self.poll_interval = poll_interval
        self.on_message = on_message
        self.notices: list[str] = []
        self.ray = _import_ray()
        #: what the actors' own environment gets (read here, on the main thread: actors start from launch threads)
        self.actor_env = forwarded_env()
        if connect_timeout is None:
            connect_timeout = CLIENT_CONNECT_TIMEOUT if cluster.address.startswith("ray://") else CONNECT_TIMEOUT
        self._connect(connect_timeout)
        self.inventory = RayInventory(self)
        self._pgs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._address = self._cluster_address()
        from .ray_hosts import HostPool, ahead_name

        ahead = None
        if controller is not None and xdist_worker is not None:
            def ahead(node: str) -> str:
                return ahead_name(controller, node, xdist_worker)
        self.hosts = HostPool(self.ray, self.make_host, session=SESSION_ID, ahead=ahead,
                              claimant=(hostname(), os.getpid(), _started()))
        self.hosts.start_ahead()

    # -- connection ---------------------------------------------------------------------------------------
    def _connect(self, timeout: float) -> None:
        connect(self.ray, self.cluster, cluster_address(self.cluster), timeout, ray_auth())

    def _cluster_address(self) -> str:
        with contextlib.suppress(Exception):
            return str(self.ray.get_runtime_context().gcs_address)
        return self.cluster.address

    def describe(self) -> str:
        try:
            total = int(self.ray.cluster_resources().get("GPU", 0))
            free = int(self.ray.available_resources().get("GPU", 0))
        except Exception:
            return f"Ray cluster at {self._address}"
        return f"Ray cluster at {self._address}: {total} GPU(s), {free} free now"

    def largest_node_gpus(self) -> int:
        try:
            return max((int(n.get("Resources", {}).get("GPU", 0)) for n in self.ray.nodes() if n.get("Alive")),
                       default=0)
        except Exception:
            return len(self.inventory.static_gpus())

    def shutdown(self) -> None:
        self.hosts.close()
        with self._lock:
            pgs = list(self._pgs.values())
            self._pgs.clear()
        for pg in pgs:
            self.remove_pg(pg)
        with contextlib.suppress(Exception):
            if self.ray.is_initialized():
                self.ray.shutdown()

    # -- the lease surface --------------------------------------------------------------------------------
    def can_ever_fit(self, tp: int, memory_mib: int) -> str | None:
        return self.inventory.can_ever_fit(tp, memory_mib)

    def try_acquire(self, gpus: int | Sequence[int], memory_mib: int, *, holder: str) -> RayLease | None:
        counts = _counts(gpus)
        reason = self.can_ever_fit(max(counts), memory_mib) or self.can_ever_fit(sum(counts), memory_mib)
        if reason is not None:
            raise LeaseImpossible(reason)
        if not self._fits_now(counts):
            return None  # no placement group made: one removed while Ray is placing it can leak its GPUs
        pg, name = self._create_pg(counts)
        if self._ready(pg, TRY_WAIT_SECONDS):  # it fitted a moment ago: only a race makes it wait
            return RayLease(self, pg, counts, holder, name)
        self.remove_pg(pg)
        return None

    def _fits_now(self, counts: Sequence[int]) -> bool:
        """Whether the bundles fit the GPUs free on the cluster's nodes now (largest first, greedily)."""
        try:
            from ray._private import state

            free = sorted((int(r.get("GPU", 0)) for r in state.available_resources_per_node().values()),  # type: ignore[no-untyped-call]
                          reverse=True)
        except Exception:
            free = [int(self.ray.available_resources().get("GPU", 0))]
        for count in sorted(counts, reverse=True):
            free.sort(reverse=True)
            if not free or free[0] < count:
                return False
            free[0] -= count
        return True

    def acquire(self, gpus: int | Sequence[int], memory_mib: int, *, holder: str, timeout: float,
                poll_interval: float | None = None, on_wait: Callable[[str], None] | None = None) -> RayLease:
        counts = _counts(gpus)
        total = sum(counts)
        reason = self.can_ever_fit(max(counts), memory_mib) or self.can_ever_fit(total, memory_mib)
        if reason is not None:
            raise LeaseImpossible(reason)
        pg, name = self._create_pg(counts)
        start = time.monotonic()
        next_notice: float | None = None
        try:
            while True:
                waited = time.monotonic() - start
                if self._ready(pg, max(0.0, min(poll_interval or self.poll_interval, timeout - waited))):
                    return RayLease(self, pg, counts, holder, name)
                waited = time.monotonic() - start
                if waited >= timeout:
                    raise LeaseTimeout(f"no lease of {total} GPU(s) with {memory_mib} MiB free each for {holder!r} "
                                       f"within {timeout:g} s ({self.describe()}): " + self._explain())
                now = time.monotonic()
                if on_wait is not None and (next_notice is None or now >= next_notice):
                    on_wait(f"waiting for {total} GPU(s) with {memory_mib} MiB free each for {holder!r} "
                            f"({waited:.0f} s of {timeout:g} s): " + self._explain())
                    next_notice = now + self.notice_interval
        except BaseException:
            self.remove_pg(pg)
            raise

    def hand_over(self, lease: RayLease, gpus: int | Sequence[int], *, holder: str) -> RayLease | None:
        """``lease`` (whose group is being stopped) passed on as it is to the next lease of this process, for
        ``holder``, when it asks for the same bundles: removing a placement group and making one again waits for
        the cluster to see the GPUs free and place it (0.4-0.8 s of a launch on a loaded machine). None when the
        bundles differ, or another session waits for GPUs on the cluster (they go back to it): the caller then
        releases ``lease``."""
        if not isinstance(lease, RayLease) or _counts(gpus) != lease.counts or self.others_waiting():
            return None
        return lease.hand_over(holder)

    def others_waiting(self) -> bool:
        """Whether another session's placement group waits (pending) on the cluster."""
        try:
            table = self.ray.util.placement_group_table()
        except Exception:
            return False
        mine = f"{PG_PREFIX}{SESSION_ID}-"
        return any(str(info.get("name", "")).startswith(PG_PREFIX) and not str(info.get("name")).startswith(mine)
                   and info.get("state") == "PENDING" for info in table.values())

    def _explain(self) -> str:
        try:
            table = self.ray.util.placement_group_table()
        except Exception:
            return "the cluster's GPUs are in use"
        held = [f"{info.get('name')} ({sum(int(b.get('GPU', 0)) for b in info.get('bundles', {}).values())} GPU(s))"
                for info in table.values()
                if info.get("state") == "CREATED" and str(info.get("name", "")).startswith(PG_PREFIX)]
        return "leased by " + ", ".join(held) if held else "the cluster's GPUs are in use by other Ray work"

    # -- placement groups and actors ----------------------------------------------------------------------
    def _create_pg(self, counts: Sequence[int]) -> tuple[Any, str]:
        from ray.util.placement_group import placement_group

        with _ids_lock:
            name = f"{PG_PREFIX}{SESSION_ID}-{next(_ids)}"
        pg = placement_group([{"GPU": float(c)} for c in counts], strategy="PACK", name=name)
        with self._lock:
            self._pgs[name] = pg
        return pg, name

    def _ready(self, pg: Any, timeout: float) -> bool:
        try:
            return bool(pg.wait(timeout_seconds=max(timeout, 0.0)))
        except Exception:
            return False

    def remove_pg(self, pg: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            for name, value in list(self._pgs.items()):
                if value is pg:
                    del self._pgs[name]
        with contextlib.suppress(Exception):
            remove_placement_group(pg)

    def make_host(self, node: str) -> Any:
        """A new :class:`WorkerHost` on Ray node ``node`` (:func:`.ray_hosts.new_host`)."""
        from .ray_hosts import new_host

        return new_host(self.ray, node, self.actor_env)

    def starter(self, lease: RayLease, bundle: int) -> Callable[..., ModelInstance]:
        """The launcher's ``_start`` for a member in ``bundle``: the argv built here, the process started by
        the bundle's actor, bound to the node's address (loopback when the node is this machine)."""

        def start(spec: ModelSpec, ports: Mapping[str, int], extra_args: Sequence[str],
                  env: Mapping[str, str] | None, options: LaunchOptions, log_dir: Path, gpus: str | None,
                  kind: WorkerKind, index: int, *, environ: Mapping[str, str]) -> ModelInstance:
            from ...engine.sglang_facts import LOOPBACK_HOST
            from ..launcher import build_argv, worker_env
            from ..process import log_name

            ray = self.ray
            try:
                actor = lease.host(bundle)
                node = ray.get(actor.node.remote(), timeout=120)
            except Exception as exc:
                raise LaunchError(f"the Ray actor for {spec.name} (lease {lease.name}, bundle {bundle}) did not "
                                  f"start: {_first_line(exc)}") from None
            local = node["hostname"] == hostname()
            host = LOOPBACK_HOST if local else str(node["ip"])
            port = ports[kind.port_names[0]]
            argv = build_argv(spec, port=port, nccl_port=ports.get("nccl"), launcher=options.launcher,
                              extra_args=extra_args, allow_foreign_host=options.allow_foreign_host,
                              role_args=kind.role_args(ports), environ=environ)
            if not local:
                argv[argv.index("--host") + 1] = host
            child_env = {**forwarded_env(environ), **worker_env(spec, env, argv=argv, environ=environ)}
            child_env.pop("CUDA_VISIBLE_DEVICES", None)  # Ray's assignment, set on the node
            try:
                started = ray.get(actor.start.remote(argv, child_env, str(log_dir / log_name("sglang-worker", port)),
                                                     lease.gpu_ids.get(bundle)), timeout=120)
            except Exception as exc:
                raise LaunchError(f"the Ray actor for {spec.name} could not start {shlex.join(argv[:3])} ...: "
                                  f"{_first_line(exc)}") from None
            cls = _worker_class()
            process = RemoteProcess(actor, int(started["pid"]), ray)
            return cls(spec=spec, host=host, port=port, tail_lines=options.tail_lines, kind=kind, index=index,
                       ports=dict(ports), gpus=started["gpus"], argv=argv, log_path=Path(started["log_path"]),
                       process=cast("subprocess.Popen[bytes]", process), owner_tag=started["tag"],
                       secrets=list(started["secrets"]), times={"started": float(started["started"])},
                       ray_node=f"{node['hostname']} ({node['ip']})", log_local=local, _ray=ray,
                       _actor=actor)  # type: ignore[call-arg]

        return start


def _counts(gpus: int | Sequence[int]) -> list[int]:
    counts = [gpus] if isinstance(gpus, int) else [int(g) for g in gpus]
    if not counts or min(counts) < 1:
        raise LeaseImpossible(f"a Ray lease needs at least one GPU per member, not {counts}")
    return counts


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


class RaySource(PoolSource):
    """Workers on a Ray cluster (``--sgl-cluster ray``): a worker group's lease is a placement group, each member
    is started by an actor in its bundle; the local lock directory still holds the port blocks."""

    name = "ray"

    def ahead_kit(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str]) -> None:
        """None: a placement group is asked for on the main thread only (launches ahead start between tests)."""
        return None

    def make_leases(self) -> RayLeaseManager:
        return RayLeaseManager(self.settings.cluster, self.settings.lock_dir, on_message=self.hooks.on_message,
                               controller=self.settings.ray_ahead, xdist_worker=self.hooks.xdist_worker)

    def describe(self) -> str:
        return str(self.settings.cluster.describe())

