"""Started :class:`~.ray.WorkerHost` actors kept for the next worker, and started ahead (issue 33).

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
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

#: idle hosts kept per node (more given back are ended)
IDLE_PER_NODE = 4


def _bundle_place() -> tuple[str, list[str]]:
    """The Ray task run in a lease's bundle: the node it runs on and the GPUs Ray assigned it there."""
    import ray

    return str(ray.get_runtime_context().get_node_id()), [str(g) for g in ray.get_gpu_ids()]


class HostPool:
    """Idle :class:`~.ray.WorkerHost` actors per Ray node: taken by a lease's bundle, given back when the lease is
    released (their engines stopped), started ahead so that a lease seldom waits for one."""

    def __init__(self, ray: Any, make: Callable[[str], Any], *, session: str) -> None:
        self.ray = ray
        self._make = make  # node id -> a new host actor pinned there
        self.session = session
        self._idle: dict[str, list[Any]] = {}
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False
        self._place: Any = None

    def _new(self, node: str) -> Any:
        actor = self._make(node)
        with self._lock:
            self._all.append(actor)
        return actor

    def start_ahead(self, node: str | None = None) -> None:
        """One host started ahead on ``node``; by default on this process's node, when it has GPUs, and the Ray
        worker process that runs :meth:`place` too (a task of this job run now, whose idle worker the first lease's
        task then finds started)."""
        try:
            if node is None:
                self._place_task().options(num_cpus=0).remote()
                here = str(self.ray.get_runtime_context().get_node_id())
                if not any(n.get("NodeID") == here and n.get("Alive") and n.get("Resources", {}).get("GPU")
                           for n in self.ray.nodes()):
                    return
                node = here
            actor = self._new(node)
        except Exception:  # ahead is an optimisation: the lease starts its own
            return
        with self._lock:
            self._idle.setdefault(node, []).append(actor)

    def place(self, pg: Any, bundle: int, gpus: int, timeout: float = 120.0) -> tuple[str, list[str]]:
        """The node of ``bundle`` of placement group ``pg`` and the GPUs Ray assigned there (a task in the bundle)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        node, ids = self.ray.get(self._place_task().options(num_cpus=0, num_gpus=gpus, scheduling_strategy=strategy,
                                                     max_retries=0).remote(), timeout=timeout)
        return str(node), [str(i) for i in ids]

    def _place_task(self) -> Any:
        if self._place is None:
            self._place = self.ray.remote(_bundle_place)
        return self._place

    def take(self, node: str) -> Any:
        """An idle host of ``node`` (a new one when none is idle); another is started ahead when it was the last."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the Ray host pool is closed")
            idle = self._idle.setdefault(node, [])
            actor = idle.pop(0) if idle else None
            last = not idle
        if actor is None:
            actor = self._new(node)
        if last:
            self.start_ahead(node)
        return actor

    def give_back(self, hosts: Sequence[tuple[str, Any]], *, timeout: float) -> None:
        """Stop each host's engine (its whole tree), then keep the host idle for the next lease; a host whose
        engine did not stop in time, or that is gone, is ended (its watchdog ends the tree)."""
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
        with self._lock:
            for node, actor in keep:
                idle = self._idle.setdefault(node, [])
                if self._closed or len(idle) >= IDLE_PER_NODE:
                    end.append(actor)
                else:
                    idle.append(actor)
        self.end(end, timeout=timeout)

    def end(self, actors: Sequence[Any], *, timeout: float) -> None:
        """Close (stop the engine, then the watchdog) and kill ``actors``."""
        refs = []
        for actor in actors:
            with contextlib.suppress(Exception):
                refs.append(actor.close.remote())
        if refs:
            with contextlib.suppress(Exception):
                self.ray.wait(refs, num_returns=len(refs), timeout=max(timeout, 1.0))
        for actor in actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        with self._lock:
            ended = {id(a) for a in actors}
            self._all = [a for a in self._all if id(a) not in ended]

    def close(self, timeout: float = 30.0) -> None:
        """End every host this pool made (idle or not)."""
        with self._lock:
            self._closed = True
            actors = list(self._all)
            self._idle.clear()
        self.end(actors, timeout=timeout)


def host_session(session_id: str) -> str:
    """A host's own owner session: its watchdog ends only what it ran."""
    return f"{session_id}r{uuid.uuid4().hex[:8]}"
