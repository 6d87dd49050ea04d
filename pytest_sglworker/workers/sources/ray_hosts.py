"""The :class:`WorkerHost` actors that run the workers on a Ray cluster, kept for the next worker and started ahead
(issue 33).

A new actor costs its Ray worker process: start, import Ray and the plugin, about 2 s of a worker's launch on a
loaded machine, against milliseconds for the placement group and the engine's start. So the hosts are not the
lease's: a host asks for no resources (``num_cpus=0``, ``num_gpus=0``) and is pinned to a node; a lease (its
placement group) runs a short task in each bundle that returns the node and the GPUs Ray assigned there, takes an
idle host of that node (one started ahead, or one an earlier lease gave back) and has it start the engine with
those GPUs. What Ray guarantees is unchanged: the engine runs only while its lease's bundle reserves its GPUs (the
lease stops every engine of its hosts before it removes its placement group; a host whose engine does not stop
is killed, its watchdog ending the tree), and a host dies with the pytest process that made it (non-detached),
its watchdog ending whatever it runs.

:class:`HostPool` keeps, per node, the idle hosts (at most :data:`IDLE_PER_NODE`) and one more started ahead
whenever a lease takes the last one; the first is started ahead on this process's node when it has GPUs, as the
session connects. :meth:`HostPool.close` (the lease manager's shutdown) ends them all.

Under pytest-xdist an xdist worker connects only at its collection, and its first lease comes right after: the
host it started then, and the Ray worker process for its task in the bundle, were not started in time (beside three
other xdist workers' on a loaded machine: 1-3.5 s of the first launch). And each lease's task waited again for a
Ray worker process of its own: Ray ends idle Ray workers beyond one a CPU after a second, so with every xdist
worker a job of its own, the idle one was gone by the next lease. So the xdist **controller** starts the first
hosts (:class:`ControllerHosts`): it connects in the background as it starts its workers, starts one named host
for each on its node (:func:`ahead_name`) and one Ray worker for their tasks; the xdist worker takes that host as
the first of its node (:meth:`HostPool.start_ahead`), and has it submit every lease's task in a bundle
(:meth:`HostPool.place_by`): one job's tasks, one Ray worker that stays started. The controller owns these hosts
(non-detached: they die with it) and ends them at its session's end; each ends itself, and the engine it runs,
when the xdist worker that took it ends (it watches that process: an xdist worker that crashes leaves nothing
running on GPUs its placement group, removed with it, no longer reserves).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...resources.processes import OWNER_ENV, SESSION_ID, hostname, owner_tag
from ..errors import LaunchError
from .ray_connect import NAMESPACE, RayAuth

#: idle hosts kept per node (more given back are ended)
IDLE_PER_NODE = 4


class WorkerHost:
    """The Ray actor that hosts one worker process on its node (made a Ray actor with ``ray.remote``).

    It runs the plugin's watchdog (keyed to this actor's own owner session), so that the worker's tree dies
    with the actor whatever ends it."""

    def __init__(self, session_id: str, env: dict[str, str] | None = None) -> None:
        # what start() imports, imported as the host starts (ahead): its first start() took a second longer on a
        # loaded machine
        from ...engine.redaction import secret_values  # noqa: F401
        from ...resources.reaper import Watchdog
        from ..process import popen  # noqa: F401

        # The pytest process's forwarded variables, for this process and what it starts (its watchdog, the engines).
        # Set here, not as Ray's runtime_env: a runtime_env needs a Ray worker process of its own, started for the
        # actor (seconds), where an actor with none takes one of the idle workers Ray keeps started. An actor's worker
        # process is its own and ends with it.
        os.environ.update(env or {})
        self.session_id = session_id
        self.process: subprocess.Popen[bytes] | None = None
        self.tag = ""
        self.log_path: Path | None = None
        self.pids_seen: set[int] = set()
        self.watchdog = Watchdog(session_id)
        self._watch: threading.Thread | None = None

    def place(self, pg: Any, bundle: int, gpus: int,
              claimant: tuple[str, int, float] | None = None) -> tuple[str, list[str]]:
        """A lease's task in bundle ``bundle`` of ``pg``, submitted from here: its node and the GPUs Ray assigned
        there. ``claimant`` (hostname, pid, start time): the xdist worker that took this host from the controller
        that made it; from then on this host ends, stopping its engine first, when that process ends."""
        import ray

        if claimant is not None and self._watch is None:
            self._watch_claimant(*claimant)
        return run_place(ray, pg, bundle, gpus)

    def _watch_claimant(self, host: str, pid: int, started: float) -> None:
        import psutil

        try:  # the claimant is alive (it asks): a process it is not means another machine or pid namespace
            proc = psutil.Process(pid)
            if host != hostname() or abs(proc.create_time() - started) > 0.01:
                return
        except psutil.Error:
            return

        def end_with() -> None:
            while True:  # a zombie has ended too (the xdist controller reaps its crashed worker when it will)
                try:
                    if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.Error:
                    break
                time.sleep(0.2)
            self.close()
            os._exit(0)  # the actor's end (its owner, the controller, sees it gone)

        self._watch = threading.Thread(target=end_with, daemon=True, name="sglworker-claimant")
        self._watch.start()

    def node(self) -> dict[str, Any]:
        import ray

        return {"hostname": hostname(), "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def start(self, argv: list[str], env: dict[str, str], log_path: str, gpus: str | None = None) -> dict[str, Any]:
        """Start ``argv`` as the launcher's ``start_process`` does (own session, owner tag, log file, stdin
        closed), on ``gpus`` (the ones Ray assigned the lease's bundle; default: the ones Ray gave this actor)."""
        import ray

        from ...engine.redaction import secret_values
        from ..process import popen, unused_log_path

        if self.process is not None and self.process.poll() is None:
            raise LaunchError("this Ray worker host already runs a worker")
        if gpus is None:
            gpus = ",".join(str(g) for g in ray.get_gpu_ids())
        full_env = dict(os.environ)
        full_env.update(env)
        full_env["CUDA_VISIBLE_DEVICES"] = gpus
        full_env["PYTHONUNBUFFERED"] = "1"
        self.tag = owner_tag(self.session_id)
        full_env[OWNER_ENV] = self.tag
        path = Path(log_path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = unused_log_path(path)
        started = time.time()
        self.process = popen(argv, full_env, path)
        self.log_path = path
        self.pids_seen = {self.process.pid}
        return {"pid": self.process.pid, "log_path": str(path), "tag": self.tag, "gpus": gpus,
                "secrets": secret_values(full_env, argv), "started": started}

    def _runs(self, pid: int | None) -> bool:
        """Whether this host's process is ``pid`` (None: any): a host that moved on to the next worker stopped
        the one before."""
        return self.process is not None and pid in (None, self.process.pid)

    def poll(self, pid: int | None = None) -> int | None:
        if self.process is not None and not self._runs(pid):
            return -signal.SIGKILL
        return None if self.process is None else self.process.poll()

    def signal(self, sig: int, pid: int | None = None) -> None:
        if self.process is not None and self._runs(pid):
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def _tree(self, sweep: bool = True) -> list[Any]:
        from ...resources.processes import process_ref, process_tree

        assert self.process is not None
        procs = process_tree(self.process.pid, self.tag, sweep=sweep, ref=process_ref(self.process))
        self.pids_seen.update(p.pid for p in procs)
        return procs

    def owns_port(self, port: int) -> bool:
        from ...resources.processes import listening_pids

        return self.process is not None and bool(listening_pids(self._tree(sweep=False), port))

    def _log(self, path: str | None) -> Path | None:
        return Path(path) if path else self.log_path  # a worker's own log: the host may have moved on

    def log_tail(self, lines: int, max_bytes: int = 256 * 1024, path: str | None = None) -> str:
        from ..process import read_tail

        log = self._log(path)
        return read_tail(log, lines, max_bytes=max_bytes) if log else ""

    def log_text(self, max_bytes: int, path: str | None = None) -> str:
        from ..process import read_head

        log = self._log(path)
        return read_head(log, max_bytes) if log else ""

    def remove_log(self, path: str | None = None) -> None:
        log = self._log(path)
        if log is not None:
            with contextlib.suppress(OSError):
                log.unlink()

    def stop(self, term_timeout: float = 10.0, kill_timeout: float = 10.0) -> dict[str, Any]:
        """Tear the worker's whole tree down (root first, then its session and its tag, then SIGKILL)."""
        from ...resources.processes import terminate_tree

        if self.process is None:
            return {"killed": [], "pids": [], "returncode": None}
        killed = terminate_tree(self.process, self._tree, term_timeout=term_timeout, kill_timeout=kill_timeout)
        return {"killed": killed, "pids": sorted(self.pids_seen), "returncode": self.process.poll()}

    def close(self) -> None:
        """Stop the worker, then the watchdog (its pipe closed: it sweeps this actor's tag and exits)."""
        with contextlib.suppress(Exception):
            self.stop()
        self.watchdog.close()


def _bundle_place() -> tuple[str, list[str]]:
    """The Ray task run in a lease's bundle: the node it runs on and the GPUs Ray assigned it there."""
    import ray

    return str(ray.get_runtime_context().get_node_id()), [str(g) for g in ray.get_gpu_ids()]


_PLACE_TASK: Any = None


def place_task(ray: Any) -> Any:
    """:func:`_bundle_place` as a Ray remote function (made once per process)."""
    global _PLACE_TASK
    if _PLACE_TASK is None:
        _PLACE_TASK = ray.remote(_bundle_place)
    return _PLACE_TASK


def run_place(ray: Any, pg: Any, bundle: int, gpus: int, timeout: float = 120.0) -> tuple[str, list[str]]:
    """The node of ``bundle`` of placement group ``pg`` and the GPUs Ray assigned there (a task in the bundle)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
    node, ids = ray.get(place_task(ray).options(num_cpus=0, num_gpus=gpus, scheduling_strategy=strategy,
                                                max_retries=0).remote(), timeout=timeout)
    return str(node), [str(i) for i in ids]


def gpu_node_here(ray: Any) -> str | None:
    """This process's Ray node, when it has GPUs."""
    here = str(ray.get_runtime_context().get_node_id())
    return here if any(n.get("NodeID") == here and n.get("Alive") and n.get("Resources", {}).get("GPU")
                       for n in ray.nodes()) else None


def end_hosts(ray: Any, actors: Sequence[Any], *, timeout: float) -> None:
    """Close (stop the engine, then the watchdog) and kill ``actors``."""
    refs = []
    for actor in actors:
        with contextlib.suppress(Exception):
            refs.append(actor.close.remote())
    if refs:
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=max(timeout, 1.0))
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


def ahead_name(controller: str, node: str, worker: str) -> str:
    """The name of the host the xdist controller of session ``controller`` started ahead on Ray node ``node`` for
    xdist worker ``worker``."""
    return f"sglworker-host-{controller}-{node}-{worker}"


class HostPool:
    """Idle :class:`WorkerHost` actors per Ray node: taken by a lease's bundle, given back when the lease is
    released (their engines stopped), started ahead so that a lease seldom waits for one."""

    def __init__(self, ray: Any, make: Callable[[str], Any], *, session: str,
                 ahead: Callable[[str], str] | None = None,
                 claimant: tuple[str, int, float] | None = None) -> None:
        self.ray = ray
        self._make = make  # node id -> a new host actor pinned there
        self.session = session
        #: node id -> the name of the host the xdist controller started ahead there for this process (None: no
        #: controller started one); ``claimant``: this process, as such a host watches it (hostname, pid, start)
        self._ahead = ahead
        self._claimant = claimant
        self._borrowed: set[int] = set()  # id() of the hosts taken from the controller
        self._borrow_later: str | None = None  # the node whose controller's host was not there yet as we joined
        self._placer: Any = None  # the first host taken from the controller: it submits the tasks in bundles
        self._idle: dict[str, list[Any]] = {}
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    def _new(self, node: str) -> Any:
        actor = self._make(node)
        with self._lock:
            self._all.append(actor)
        return actor

    def start_ahead(self, node: str | None = None) -> None:
        """One host started ahead on ``node``; by default on this process's node, when it has GPUs (the one the
        xdist controller started there for this process, when it did), and else the Ray worker process that runs
        :func:`run_place` too (a task of this job run now, whose idle worker a later lease's task then finds
        started)."""
        try:
            if node is None:
                node = gpu_node_here(self.ray)
                actor = self._borrow(node) if node is not None else None
                if actor is None:
                    place_task(self.ray).options(num_cpus=0).remote()
                    if node is None:
                        return
                    if self._ahead is not None:  # the controller may not have made it yet: the first lease asks again
                        self._borrow_later = node
                    actor = self._new(node)
            else:
                actor = self._new(node)
        except Exception:  # ahead is an optimisation: the lease starts its own
            return
        with self._lock:
            self._idle.setdefault(str(node), []).append(actor)

    def _borrow(self, node: str) -> Any:
        """The host the xdist controller started ahead on ``node`` for this process, or None."""
        if self._ahead is None:
            return None
        try:
            actor = self.ray.get_actor(self._ahead(node), namespace=NAMESPACE)
        except Exception:  # none (the controller could not connect, or another node): this process starts its own
            return None
        with self._lock:
            self._all.append(actor)
            self._borrowed.add(id(actor))
            if self._placer is None:
                self._placer = actor
        return actor

    def bundle_node(self, pg: Any, bundle: int) -> str | None:
        """The node of ``bundle`` of the placement group ``pg`` (ready), as the cluster's table says; None if unsaid."""
        try:
            node = self.ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).get(bundle)
        except Exception:
            return None
        return str(node) if node else None

    def place(self, pg: Any, bundle: int, gpus: int, timeout: float = 120.0) -> tuple[str, list[str]]:
        """The node of ``bundle`` of placement group ``pg`` and the GPUs Ray assigned there (a task in the bundle)."""
        return run_place(self.ray, pg, bundle, gpus, timeout)

    def place_by(self, actor: Any, pg: Any, bundle: int, gpus: int, timeout: float = 120.0) -> tuple[str, list[str]]:
        """:meth:`place`, the task submitted by a host: the one this process took from the xdist controller when
        it did (the task then runs in the controller's Ray worker, which stays started: Ray ends idle Ray workers
        beyond one a CPU within a second, so each xdist worker's own would have to start again for its next lease),
        else host ``actor``. A host taken from the controller watches this process from then on."""
        with self._lock:
            submitter = self._placer or actor
            claimant = self._claimant if id(submitter) in self._borrowed else None
        node, ids = self.ray.get(submitter.place.remote(pg, bundle, gpus, claimant), timeout=timeout)
        return str(node), [str(i) for i in ids]

    def take(self, node: str) -> Any:
        """An idle host of ``node`` (a new one when none is idle); another is started ahead when it was the last."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the Ray host pool is closed")
            later = self._borrow_later == node
            if later:
                self._borrow_later = None
        actor = self._borrow(node) if later else None  # started longer ago than this process's own
        with self._lock:
            idle = self._idle.setdefault(node, [])
            if actor is None:
                actor = idle.pop(0) if idle else None
            last = not idle
        if actor is None:
            actor = self._new(node)
        if last:  # in the background: making an actor (its class exported first) took 0.4 s of a loaded launch
            threading.Thread(target=self.start_ahead, args=(node,), name="sglworker-ray-ahead", daemon=True).start()
        return actor

    def give_back(self, hosts: Sequence[tuple[str, Any]], *, timeout: float) -> None:
        """Stop each host's engine (its whole tree), then keep the host idle for the next lease; a host whose
        engine did not stop in time, or that is gone, is ended (its watchdog ends the tree)."""
        keep = self.stop_engines(hosts, timeout=timeout)
        end: list[Any] = []
        with self._lock:
            for node, actor in keep:
                idle = self._idle.setdefault(node, [])
                if self._closed or len(idle) >= IDLE_PER_NODE:
                    end.append(actor)
                else:
                    idle.append(actor)
        self.end(end, timeout=timeout)

    def stop_engines(self, hosts: Sequence[tuple[str, Any]], *, timeout: float) -> list[tuple[str, Any]]:
        """Stop each host's engine (its whole tree); the hosts whose engine stopped, as ``(node, host)``. A host
        whose engine did not stop in time, or that is gone, is ended (its watchdog ends the tree)."""
        refs = []
        for node, actor in hosts:
            try:
                refs.append((node, actor, actor.stop.remote()))
            except Exception:
                refs.append((node, actor, None))
        keep: list[tuple[str, Any]] = []
        end: list[Any] = []
        for node, actor, ref in refs:
            try:
                if ref is None:
                    raise RuntimeError("no stop")
                self.ray.get(ref, timeout=max(timeout, 1.0))
                keep.append((node, actor))
            except Exception:
                end.append(actor)
        self.end(end, timeout=timeout)
        return keep

    def end(self, actors: Sequence[Any], *, timeout: float) -> None:
        """Close (stop the engine, then the watchdog) and kill ``actors``."""
        end_hosts(self.ray, actors, timeout=timeout)
        with self._lock:
            ended = {id(a) for a in actors}
            self._all = [a for a in self._all if id(a) not in ended]

    def close(self, timeout: float = 30.0) -> None:
        """End every host this pool made or took from the controller (idle or not)."""
        with self._lock:
            self._closed = True
            actors = list(self._all)
            self._idle.clear()
        self.end(actors, timeout=timeout)


class ControllerHosts:
    """The xdist controller's hosts started ahead: it joins the cluster in the background and starts one named host
    on its node (when the node has GPUs) for each xdist worker it starts (:meth:`add`, as xdist sets the worker up),
    and a Ray worker process of its own for the tasks those hosts submit. The thread gets everything it needs from
    the main thread (the address, the credentials, the actors' environment). :meth:`close` ends the hosts (the
    session's end)."""

    def __init__(self, cluster: Any, *, address: str, actor_env: Mapping[str, str], session: str,
                 timeout: float, auth: RayAuth) -> None:
        self.session = session
        self._cluster = cluster
        self._address = address
        self._auth = auth
        self._actor_env = dict(actor_env)
        self._timeout = timeout
        self._wanted: list[str] = []
        self._made: dict[str, Any] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._ray: Any = None
        self._thread = threading.Thread(target=self._run, name="sglworker-ray-ahead", daemon=True)
        self._thread.start()

    def add(self, worker: str) -> None:
        """Start a host for xdist worker ``worker`` (once the cluster is joined)."""
        with self._cond:
            self._wanted.append(worker)
            self._cond.notify_all()

    def _run(self) -> None:
        from .ray_connect import _import_ray, connect

        try:
            ray = _import_ray()
            connect(ray, self._cluster, self._address, self._timeout, self._auth)
            node = gpu_node_here(ray)
            if node is None:
                return
            place_task(ray).options(num_cpus=0).remote()  # the hosts' tasks then find a Ray worker started
        except Exception:  # an optimisation: each xdist worker starts its own hosts, and says why it cannot
            return
        with self._cond:
            self._ray = ray
        while True:
            with self._cond:
                while not self._wanted and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                name = ahead_name(self.session, node, self._wanted.pop(0))
                if name in self._made:
                    continue
            try:
                actor = new_host(ray, node, self._actor_env, name=name)
            except Exception:
                continue
            with self._cond:
                closed = self._closed
                if not closed:
                    self._made[name] = actor
            if closed:
                end_hosts(ray, [actor], timeout=5.0)
                return

    def names(self) -> list[str]:
        with self._cond:
            return list(self._made)

    def close(self, timeout: float = 30.0) -> None:
        """End every host made (an xdist worker may have ended its own already), then leave the cluster."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            ray, actors = self._ray, list(self._made.values())
            self._made.clear()
        if ray is None:
            return  # never joined (or still joining: the thread then ends, making nothing)
        end_hosts(ray, actors, timeout=timeout)
        with contextlib.suppress(Exception):
            ray.shutdown()


def new_host(ray: Any, node: str, actor_env: Mapping[str, str], name: str | None = None) -> Any:
    """A new :class:`WorkerHost` on Ray node ``node``, asking for no resources (a lease's bundle holds the GPUs its
    engine runs on: :mod:`.ray_hosts`); ``name``: a named one (the xdist controller's, for one of its workers)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    global _HOST_CLASS
    if _HOST_CLASS is None:
        _HOST_CLASS = ray.remote(WorkerHost)
    options: dict[str, Any] = {"name": name, "namespace": NAMESPACE} if name else {}
    return _HOST_CLASS.options(
        num_cpus=0, num_gpus=0, max_restarts=0, max_task_retries=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False), **options,
    ).remote(host_session(SESSION_ID), dict(actor_env))


_HOST_CLASS: Any = None


def host_session(session_id: str) -> str:
    """A host's own owner session: its watchdog ends only what it ran."""
    return f"{session_id}r{uuid.uuid4().hex[:8]}"
