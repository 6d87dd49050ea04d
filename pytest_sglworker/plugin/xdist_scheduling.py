"""An xdist scheduler that knows worker configurations (issue #16): ``--sgl-dist``.

Under ``-n N`` xdist's default ``--dist load`` spreads tests in small batches, so that every xdist worker
launches every configuration it receives a test of; ``--dist loadgroup`` launches each configuration once but
leaves xdist workers idle when configurations are few and large. This scheduler does both jobs:

- **Affinity**: an xdist worker keeps receiving the tests of the configuration it already runs (then of a
  configuration still in its pool), and starts an unstarted configuration (the largest that fits the free
  GPUs) only when its own is done.
- **Work stealing**: an xdist worker with nothing else to do starts a copy of its own of a configuration
  that another one runs, and takes part of its tests, only when (1) a GPU for it is free (the inventory
  less what the other xdist workers' pools hold, as this scheduler placed them; it does not wait for one: its
  pool would keep its idle workers' GPUs meanwhile), (2) at least ``K`` of its tests are left for each copy
  (``--sgl-dist auto,steal=K``, default 4), (3) once a startup and a test
  duration are known, the copy brings the end of the configuration's queue forward by more than its startup's
  share of the inventory (``startup x its GPUs / all GPUs``: the GPU-seconds it spends starting are fewer than
  the whole inventory's it gives back), and (4) the run has started fewer than ``xdist workers - 1`` extra
  copies, which bounds the launches by ``configurations + xdist workers - 1``. For (3) the running copies take
  the queue's tests once they are free: a copy still starting is busy for what is left of its startup, then
  each copy for its pending tests; the durations are the run's own measurements of the configuration, else
  what earlier runs measured of it (:mod:`.durations`), else the run's measurements of the others (a
  configuration that still starts has measured nothing of its own, and its startup can be many times the
  others').

The controller does not collect; each xdist worker writes, before it reports its collection, which
configuration each node id needs (and how many GPUs it leases at once) to a file of a private directory
that the controller names in ``workerinput``. A node id that is missing there is read from the
``@sgl-<key>`` suffix that ``--dist loadgroup`` adds; a run whose tests need no worker is scheduled by
xdist's own ``LoadScheduling``, unchanged.

:class:`Planner` is the plain scheduling logic (no xdist, no pytest); :class:`ConfigScheduling` is xdist's
``Scheduling`` protocol around it. A pytest-facing module: xdist is imported only when a scheduler is made.

Why one module of this size: xdist's scheduler protocol (``add_node``, ``schedule``, ``mark_test_complete``,
``remove_node``) and the planner it calls share one model of units, nodes and their queues; the xdist hooks that
install it are in :mod:`.xdist_hooks`; ``--sgl-dist`` itself is parsed in :mod:`.options`.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .keys import CONFIG_KEY, ITEM_ERROR_KEY, MAP_INPUT, distributing, xdist_worker_id
from .launch_hints import write_launch_hint
from .markers import MarkerError, WorkerMarker, WorkersMarker

if TYPE_CHECKING:
    from .options import Settings
    from .session import SglSession

#: tests a node holds at once (the one it runs, the next one xdist needs to know, one more in flight)
WINDOW = 3
MAP_SCHEMA = "pytest-sglworker/xdist-collection/v1"
#: ``--dist`` modes that this scheduler replaces under ``--sgl-dist on`` (``each`` runs every test everywhere)
REPLACEABLE = ("load", "loadscope", "loadfile", "loadgroup", "worksteal")
_STATE = pytest.StashKey[dict[str, Any]]()


def explicit_dist(config: pytest.Config) -> str | None:
    """The ``--dist`` mode the user gave (command line, ``PYTEST_ADDOPTS``, ini ``addopts``), or None when
    xdist's mode comes from its ``-n`` default. ``-d`` counts as ``--dist load``. The last one wins."""
    args: list[str] = []
    try:
        args += [str(a) for a in config.getini("addopts") or ()]
    except (ValueError, KeyError):
        pass
    try:
        args += shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))
    except ValueError:
        pass
    args += [str(a) for a in config.invocation_params.args]
    found: str | None = None
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            break
        if token == "--dist":
            found = next(tokens, found)
        elif token.startswith("--dist="):
            found = token.split("=", 1)[1]
        elif token == "-d":
            found = "load"
    return found


@dataclass(frozen=True)
class Decision:
    """Whether this run's tests are handed out by :class:`ConfigScheduling`, and the header line saying so
    (``line`` None: nothing to say)."""

    use: bool
    line: str | None


def decide(config: pytest.Config, settings: Settings) -> Decision | None:
    """``--sgl-dist``: None when xdist does not distribute here; else whether ours is used, and why."""
    if not distributing(config):
        return None
    mode, steal = settings.dist
    source = settings.sources.get("dist", "default")
    given = explicit_dist(config)
    dist = str(config.getoption("dist"))
    selects = bool(settings.models)
    stealing = f"work stealing while {steal}+ tests are left per copy" if steal else "no work stealing"
    switch = {"default": f"--sgl-dist {mode}", "--sgl-dist": f"--sgl-dist {mode}"}.get(
        source, f"{source}={mode}" if source.startswith("SGLWORKER_") else f"{source} = {mode}")
    if mode == "off":
        line = f"sglworker: xdist's own --dist {dist} hands out the tests ({switch})" if selects else None
        return Decision(False, line)
    if mode == "auto" and given is not None:
        line = (f"sglworker: xdist's --dist {given} hands out the tests, as given (--sgl-dist on schedules them by "
                "worker configuration)") if selects else None
        return Decision(False, line)
    if dist not in REPLACEABLE:
        return Decision(False, f"sglworker: --dist {dist} runs every test on every xdist worker: --sgl-dist {mode} "
                               "does not apply")
    why = "" if mode == "on" else ", as no --dist was given"
    over = f" instead of --dist {given}" if given is not None else ""
    line = (f"sglworker: xdist tests scheduled by worker configuration{over} ({switch}{why}): affinity, "
            f"{stealing}; --sgl-dist off for xdist's --dist load")
    return Decision(True, line if selects or mode == "on" else None)


# ---------------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Unit:
    """What a test needs: a worker configuration (``key``, ``gpus`` leased at once) whose tests an xdist
    worker should keep, and whether other xdist workers may start copies of it (False for a user's own
    ``xdist_group``: its tests stay on one xdist worker, as under ``--dist loadgroup``)."""

    key: str
    gpus: int = 1
    stealable: bool = True


@dataclass
class _Node:
    id: Hashable
    pending: list[int] = field(default_factory=list)
    current: str | None = None
    residents: list[str] = field(default_factory=list)  # configurations its pool holds, most recent first
    probes: set[int] = field(default_factory=set)  # tests whose duration includes a launch
    launched_at: float = 0.0  # when the planner started its current configuration (its clock)
    down: bool = False


@dataclass
class Actions:
    """What the planner asks of the xdist workers: tests to send (collection indices), and shutdowns."""

    sends: list[tuple[Hashable, list[int]]] = field(default_factory=list)
    shutdowns: list[Hashable] = field(default_factory=list)
    #: a configuration a node is to launch ahead, on GPUs no node holds, while it runs its own (it takes that
    #: configuration's tests once its own are done)
    hints: list[tuple[Hashable, str | None]] = field(default_factory=list)  # None: nothing now (it took it)
    #: configurations whose tests are all handed out: a node's pool lets their idle workers go (with hints only)
    drops: list[tuple[Hashable, str]] = field(default_factory=list)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _finish(busy: Sequence[float], work: float) -> float:
    """When copies free after ``busy`` seconds each finish ``work`` seconds of tests between them."""
    free = sorted(busy)
    for k in range(1, len(free) + 1):
        end = (work + sum(free[:k])) / k
        if k == len(free) or end <= free[k]:
            return end
    return float("inf")


class Planner:
    """Hands tests (collection indices) to nodes by configuration: affinity first, then work stealing.

    ``units[i]`` is what test ``i`` needs (None: no pooled worker; any node runs it). ``gpus_total`` is the
    inventory's size (None: unknown, no GPU check), ``steal_min`` the ``K`` of work stealing (None: off),
    ``workers`` the number of xdist workers (``workers - 1`` extra copies at most). ``history``: what earlier
    runs measured (:func:`.durations.estimates`: each test's seconds by index, each configuration's startup), by
    which an unstarted configuration with more work (startup plus tests) starts first; without it, more tests;
    and, with the run's own measurements, by which work stealing judges a copy (``clock``: the seconds by which
    it tells what is left of a copy's startup)."""

    def __init__(self, units: Sequence[Unit | None], *, gpus_total: int | None, steal_min: int | None,
                 workers: int, window: int = WINDOW,
                 history: tuple[Sequence[float | None], Mapping[str, float]] | None = None,
                 clock: Callable[[], float] = time.monotonic, hints: bool = True) -> None:
        self.units = list(units)
        #: node id -> the configuration it was told to launch ahead and has not started taking tests of
        self.hints: dict[Hashable, str] | None = {} if hints else None
        self.clock = clock
        self.history = history
        self._fills: dict[str, float] = {}
        self._test_fill: float | None = None
        self._startup_fill: float | None = None
        if history is not None:
            tests, startups = history
            own: dict[str, list[float]] = {}
            for unit, seconds in zip(self.units, tests, strict=True):
                if unit is not None and seconds is not None:
                    own.setdefault(unit.key, []).append(seconds)
            self._fills = {k: statistics.median(v) for k, v in own.items()}
            self._test_fill = _median([s for s in tests if s is not None])
            self._startup_fill = _median(list(startups.values()))
        self.queues: dict[str | None, deque[int]] = {}
        self.info: dict[str, Unit] = {}
        for index, unit in enumerate(self.units):
            if unit is not None:
                self.info.setdefault(unit.key, unit)
            self.queues.setdefault(unit.key if unit else None, deque()).append(index)
        self.total = gpus_total
        self.steal_min = steal_min
        self.workers = workers
        self.steal_budget = max(0, workers - 1)
        self.window = max(2, window)
        self.nodes: dict[Hashable, _Node] = {}
        self.launches = 0
        self.steals = 0
        self._seconds: dict[str, list[float]] = {}
        self._startups: dict[str, list[float]] = {}

    # -- state --------------------------------------------------------------------------------------------
    @property
    def configurations(self) -> int:
        return len(self.info)

    def left(self) -> int:
        return sum(len(q) for q in self.queues.values())

    @property
    def finished(self) -> bool:
        return not self.left() and all(len(n.pending) < 2 for n in self.nodes.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.left()) or any(n.pending for n in self.nodes.values())

    def copies(self, key: str) -> int:
        """Nodes that take tests of ``key`` from its queue."""
        return sum(1 for n in self.nodes.values() if n.current == key and not n.down)

    def _gpus(self, key: str) -> int:
        return max(0, self.info[key].gpus)

    def _held(self, node: _Node) -> int:
        return sum(self._gpus(k) for k in node.residents)

    def _free_for(self, node: _Node) -> int | None:
        """GPUs ``node`` could lease now: the inventory less what the others' pools hold (its own idle
        workers are evicted when it needs their GPUs, as the pool does)."""
        if self.total is None:
            return None
        return self.total - sum(self._held(n) for n in self.nodes.values() if n is not node)

    # -- durations ----------------------------------------------------------------------------------------
    def test_seconds(self, key: str) -> float | None:
        """A test of ``key``: what this run measured of it, else what earlier runs did (history), else any
        configuration's test, this run's first."""
        for value in (_median(self._seconds.get(key, ())), self._fills.get(key),
                      _median([s for v in self._seconds.values() for s in v]), self._test_fill):
            if value is not None:
                return value
        return None

    def _run_startup(self, key: str) -> float | None:
        """A launch of ``key`` as this run measured it: its first test on a node (whose setup starts the worker)
        less a test."""
        first, t = _median(self._startups.get(key, ())), self.test_seconds(key)
        return None if first is None or t is None else max(0.0, first - t)

    def startup_seconds(self, key: str) -> float | None:
        """A launch's cost: what this run measured of ``key``'s, else what earlier runs did (history), else any
        configuration's launch, this run's first. Another configuration's figure is a guess: a configuration
        that is still starting has measured nothing, and its startup may be many times the others'."""
        history = self.history[1] if self.history is not None else {}
        for value in (self._run_startup(key), history.get(key),
                      _median([s for k in self._startups if (s := self._run_startup(k)) is not None]),
                      self._startup_fill):
            if value is not None:
                return value
        return None

    def queued_seconds(self, key: str) -> float | None:
        """The seconds ``key``'s queued tests take (None: a test's is unknown)."""
        seconds = [self._seconds_of(i) for i in self.queues.get(key, ())]
        return None if None in seconds else sum(s or 0.0 for s in seconds)

    def work(self, key: str) -> float | None:
        """The seconds ``key``'s queued tests and a startup take, from history (None: no history). A test or a
        startup history lacks counts as the median of the configuration's known tests (else of all) and of all
        known startups."""
        if self.history is None:
            return None
        tests, startups = self.history
        fill = self._fills.get(key, self._test_fill or 0.0)
        return startups.get(key, self._startup_fill or 0.0) + sum(
            fill if tests[i] is None else float(tests[i] or 0.0) for i in self.queues.get(key, ()))

    def _seconds_of(self, index: int) -> float | None:
        """Test ``index``: what earlier runs measured of it, else as :meth:`test_seconds`."""
        known = self.history[0][index] if self.history is not None else None
        unit = self.units[index]
        return known if known is not None or unit is None else self.test_seconds(unit.key)

    def _starting(self, node: _Node) -> bool:
        """``node`` still starts its current configuration (the test that launches it has not completed)."""
        return any((unit := self.units[i]) is not None and unit.key == node.current for i in node.probes)

    def _busy_for(self, node: _Node, startup: float) -> float:
        """Seconds from now until ``node`` takes a queued test: what is left of its launch, then its pending tests."""
        left = max(0.0, node.launched_at + startup - self.clock()) if self._starting(node) else 0.0
        return left + sum(self._seconds_of(i) or 0.0 for i in node.pending)

    def worth_a_copy(self, key: str) -> bool:
        """A copy started now would end ``key``'s queue sooner by more than its startup's share of the inventory
        (of the xdist workers where the inventory is unknown): the running copies take the queue's tests once
        they are free, the new one once it has started (unmeasured: assumed so, K decides)."""
        copies = [n for n in self.nodes.values() if n.current == key and not n.down]
        left, startup = self.queued_seconds(key), self.startup_seconds(key)
        if left is None or startup is None:
            return True
        busy = [self._busy_for(n, startup) for n in copies]
        share = max(1, self._gpus(key)) / max(1, self.total or self.workers)
        return _finish(busy, left) - _finish([*busy, startup], left) > share * startup

    # -- nodes --------------------------------------------------------------------------------------------
    def add_node(self, node_id: Hashable) -> None:
        self.nodes.setdefault(node_id, _Node(node_id))

    def mark_down(self, node_id: Hashable) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.down = True

    def remove_node(self, node_id: Hashable) -> tuple[int | None, Actions]:
        """The node is gone: its first pending test is the one it crashed in (returned), the others go back
        to the front of their queues."""
        node = self.nodes.pop(node_id, None)
        if self.hints:
            self.hints.pop(node_id, None)
        if node is None or not node.pending:
            return None, self.fill_all()
        crashed, rest = node.pending[0], node.pending[1:]
        for index in reversed(rest):
            self._requeue(index)
        return crashed, self.fill_all()

    def requeue(self, index: int) -> Actions:
        """Run ``index`` again (``mark_test_pending``, e.g. a rerun after a crash)."""
        self._requeue(index)
        return self.fill_all()

    def _requeue(self, index: int) -> None:
        unit = self.units[index]
        self.queues.setdefault(unit.key if unit else None, deque()).appendleft(index)

    def complete(self, node_id: Hashable, index: int, duration: float = 0.0) -> Actions:
        node = self.nodes.get(node_id)
        if node is None:
            return Actions()
        if index in node.pending:
            node.pending.remove(index)
        unit = self.units[index]
        if unit is not None:
            samples = self._startups if index in node.probes else self._seconds
            samples.setdefault(unit.key, []).append(max(0.0, duration))
        node.probes.discard(index)
        return self._fill_nodes([node, *(other for other in self.nodes.values() if other is not node)])

    def fill_all(self) -> Actions:
        return self._fill_nodes(sorted(self.nodes.values(), key=lambda n: not n.pending))  # busy ones keep theirs

    def _fill_nodes(self, nodes: Sequence[_Node]) -> Actions:
        """A first test for each node that runs nothing, then each node's window: a node's look-ahead into its
        next configuration never takes the GPUs another node waits for its first test on."""
        actions = Actions()
        for node in nodes:
            if not node.pending:
                self._fill(node, actions, window=1)
        for node in nodes:
            self._fill(node, actions)
        self._hint(actions)
        return actions

    # -- choosing -----------------------------------------------------------------------------------------
    def _choose(self, node: _Node) -> tuple[tuple[str, str | None] | None, bool]:
        """``((kind, key), blocked)``: what ``node`` takes next (kind ``same``, ``resident``, ``new``,
        ``unkeyed`` or ``steal``), and whether something was left only because its GPUs are not free."""
        current = node.current
        if current is not None and self.queues.get(current):
            return ("same", current), False
        for key in node.residents:
            if key != current and self.queues.get(key) and (self.info[key].stealable or not self.copies(key)):
                return ("resident", key), False
        free = self._free_for(node)
        blocked = False
        unstarted = self._unstarted(node)
        # most work first (longest processing time: from history), else most tests; ties in collection order
        unstarted.sort(key=lambda k: (-(self.work(k) or 0.0), -len(self.queues[k])))
        for key in unstarted:
            if free is None or self._gpus(key) <= free:
                return ("new", key), False
            blocked = True
        if self.queues.get(None):
            return ("unkeyed", None), False
        stolen = self._steal_for(free)
        if stolen is not None:
            return ("steal", stolen), False
        # A copy that lacks GPUs is not waited for: a node that waits keeps its idle workers' GPUs (its pool lets
        # them go only between its own tests), which the configurations still to start may need
        return None, blocked

    def _unstarted(self, node: _Node | None = None) -> list[str]:
        """Configurations no node takes tests of, less those launched ahead by another node than ``node``."""
        hinted = {key for nid, key in (self.hints or {}).items()
                  if (node is None or nid != node.id) and nid in self.nodes and not self.nodes[nid].down}
        return [k for k, q in self.queues.items() if k is not None and q and not self.copies(k) and k not in hinted]

    def _hint(self, actions: Actions) -> None:
        """Launch ahead: on GPUs no node's pool holds, a node that runs a configuration (soonest done first) is
        told to start the unstarted configuration with the most work that fits, and takes its tests once its own
        are done (its pool holds it: a resident). An xdist worker sees its tests only one ahead, so without this
        a configuration started only as its first test came, and with fewer xdist workers than GPUs, GPUs sat
        idle while startups queued behind tests. Never while a node waits for GPUs for its first test."""
        if self.hints is None or self.total is None:
            return
        for node in self.nodes.values():
            # What no test will take again is let go, and no longer counted, once the node has run its last test of
            # it (told earlier, its pool would stop the workers between two of their own tests)
            pending = {self.units[i].key for i in node.pending if self.units[i] is not None}  # type: ignore[union-attr]
            for key in [k for k in node.residents if k != node.current and k != self.hints.get(node.id)
                        and not self.queues.get(k) and k not in pending]:
                node.residents.remove(key)
                actions.drops.append((node.id, key))
        nodes = [n for n in self.nodes.values() if not n.down]
        if any(not n.pending for n in nodes):
            return  # a node waits for GPUs (or is about to leave): they are its
        busy = [n for n in nodes if n.id not in self.hints and n.current is not None]
        busy.sort(key=lambda n: (len(self.queues.get(n.current) or ()) / max(1, self.copies(str(n.current)))))
        for node in busy:
            free = self.total - sum(self._held(n) for n in self.nodes.values())
            fits = [k for k in self._unstarted() if self._gpus(k) <= free]
            if not fits:
                return
            fits.sort(key=lambda k: (-(self.work(k) or 0.0), -len(self.queues[k])))
            key = fits[0]
            node.residents = [key, *(k for k in node.residents if k != key)]
            self.hints[node.id] = key
            self.launches += 1
            actions.hints.append((node.id, key))

    def _steal_for(self, free: int | None) -> str | None:
        if self.steal_min is None or self.steals >= self.steal_budget:
            return None
        running = [k for k, q in self.queues.items()
                   if k is not None and q and self.info[k].stealable and self.copies(k)]
        running.sort(key=lambda k: -len(self.queues[k]) / (self.copies(k) + 1))
        for key in running:
            left, copies, gpus = len(self.queues[key]), self.copies(key), self._gpus(key)
            if left < self.steal_min * (copies + 1):
                continue
            if self.total is not None and gpus and copies + 1 > self.total // gpus:
                continue
            if (free is None or gpus <= free) and self.worth_a_copy(key):
                return key
        return None

    def _launch(self, node: _Node, key: str) -> None:
        node.residents = [key, *(k for k in node.residents if k != key)]
        if self.total is not None:
            while len(node.residents) > 1 and sum(self._held(n) for n in self.nodes.values()) > self.total:
                node.residents.pop()  # the pool evicts its least recently used idle worker

    def _fill(self, node: _Node, actions: Actions, window: int | None = None) -> None:
        if node.down:
            return
        batch: list[int] = []
        choice: tuple[str, str | None] | None = None
        blocked = False
        while len(node.pending) + len(batch) < (window or self.window):
            choice, blocked = self._choose(node)
            if choice is None:
                break
            kind, key = choice
            probe = False
            if kind in ("new", "steal") and key is not None:
                self._launch(node, key)
                node.launched_at = self.clock()
                self.launches += 1
                self.steals += kind == "steal"
                probe = True
            elif kind == "resident" and key is not None:
                node.residents = [key, *(k for k in node.residents if k != key)]
                if self.hints is not None and self.hints.get(node.id) == key:
                    del self.hints[node.id]  # its launch ahead is now its current configuration
                    actions.hints.append((node.id, None))
            if key is not None:
                node.current = key
            index = self.queues[key].popleft()
            if probe:
                node.probes.add(index)
            batch.append(index)
        if batch:
            node.pending.extend(batch)
            actions.sends.append((node.id, batch))
        if not self.left():
            self._down(node, actions)
        elif choice is None and len(node.pending) < 2 and (node.pending or not blocked):
            # Nothing for it now: it runs what it holds and leaves, so that its pool's GPUs are given back. A node
            # that holds a test cannot wait (xdist runs a test only once it knows the next one, or the shutdown);
            # one that holds none waits when only GPUs are missing (the others free theirs as they finish).
            self._down(node, actions)

    def _down(self, node: _Node, actions: Actions) -> None:
        node.down = True
        actions.shutdowns.append(node.id)


# ---------------------------------------------------------------------------------------------- the map


def unit_of(session: SglSession, item: pytest.Item) -> Unit | None:
    """What ``item`` needs from the pool (None: nothing pooled: no worker, a skip, an error, fresh workers)."""
    config = item.stash.get(CONFIG_KEY, None)
    skipped = item.get_closest_marker("skip") is not None or ITEM_ERROR_KEY in item.stash
    groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                     for m in item.iter_markers("xdist_group")})
    pooled = False
    gpus = 0
    if config is not None and not skipped:
        try:
            if config.group is None:
                worker = WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
                pooled = not (worker.fresh or worker.startup_timeout is not None
                              or worker.allow_foreign_host is not None)
            else:
                workers = WorkersMarker.from_mark(item.get_closest_marker("sgl_workers"))
                pooled = not (workers.fresh or workers.startup_timeout is not None)
            gpus = config.gpus_needed(session.choose_kind)
        except (MarkerError, ValueError, TypeError):
            pooled = False
    if groups and not all(g.startswith("sgl-") for g in groups):
        return Unit("xdist_group:" + "_".join(groups), gpus if pooled else 0, stealable=False)
    if config is None or skipped or not pooled:
        return None
    return Unit(config.key, gpus)


def write_collection_map(session: SglSession, items: Sequence[pytest.Item]) -> None:
    """On an xdist worker: which unit each collected node id needs, for the controller's scheduler."""
    workerinput = getattr(session.config, "workerinput", None)
    if not isinstance(workerinput, dict) or not workerinput.get(MAP_INPUT):
        return
    directory = Path(workerinput[MAP_INPUT])
    tests: dict[str, list[Any]] = {}
    for item in items:
        try:
            unit = unit_of(session, item)
        except Exception:  # the map is an optimisation: a test it cannot place runs anywhere
            unit = None
        if unit is not None:
            tests[item.nodeid] = [unit.key, unit.gpus, unit.stealable]
    gpus: int | None = None
    if tests:
        try:
            gpus = session.source.gpu_count()
        except Exception:  # no inventory: the workers skip or fail those tests; nothing to budget
            gpus = None
    if not directory.is_dir():
        return
    from ..resources.state import atomic_write

    try:
        atomic_write(directory / f"{xdist_worker_id(session.config)}.json",
                     json.dumps({"schema": MAP_SCHEMA, "gpus": gpus, "tests": tests}), mode=0o600)
    except OSError:
        pass


@dataclass
class CollectionMap:
    tests: dict[str, Unit] = field(default_factory=dict)
    gpus: int | None = None
    read: bool = False


def read_collection_map(path: Path) -> CollectionMap | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != MAP_SCHEMA or not isinstance(data.get("tests"), dict):
        return None
    gpus = data.get("gpus")
    result = CollectionMap(gpus=gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 0 else None,
                           read=True)
    for nodeid, entry in data["tests"].items():
        if (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[1], int)
                and isinstance(entry[2], bool)):
            result.tests[str(nodeid)] = Unit(entry[0], max(0, entry[1]), entry[2])
    return result


def unit_from_suffix(nodeid: str) -> Unit | None:
    """The ``@<group>`` suffix ``--dist loadgroup`` adds (``@sgl-<key>`` for a worker configuration)."""
    if nodeid.rfind("@") <= nodeid.rfind("]"):
        return None
    group = nodeid.rsplit("@", 1)[1]
    if group.startswith("sgl-") and len(group) > 4:
        return Unit(group[4:], 1)
    return Unit("xdist_group:" + group, 0, stealable=False) if group else None


# ---------------------------------------------------------------------------------------------- xdist


class ConfigScheduling:
    """xdist's ``Scheduling`` protocol over :class:`Planner`. Until the collection is complete it also feeds
    an xdist ``LoadScheduling``, which takes over, unchanged, when no collected test needs a pooled worker
    (or the xdist workers collected different tests: it reports that as xdist does)."""

    def __init__(self, config: pytest.Config, log: Any, *, map_dir: Path | None, steal_min: int | None) -> None:
        from xdist.scheduler import LoadScheduling  # type: ignore[import-untyped]
        from xdist.workermanage import parse_tx_spec_config  # type: ignore[import-untyped]

        self.config = config
        self.log = log.sglworkersched if log is not None else (lambda *args: None)
        self.numnodes = len(parse_tx_spec_config(config))
        self.map_dir = map_dir
        self.steal_min = steal_min
        self.node2collection: dict[Any, list[str]] = {}
        self._nodes: list[Any] = []
        self.collection: list[str] | None = None
        self.planner: Planner | None = None
        self.map = CollectionMap()
        self.delegate: Any = None
        self._shadow: Any = LoadScheduling(config, log)
        self._ahead: dict[Any, str | None] = {}  # node -> the configuration it is told to launch ahead
        self._drops: dict[Any, set[str]] = {}  # node -> the configurations its pool is to let go when idle

    # -- the protocol -------------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Any]:
        return self.delegate.nodes if self.delegate is not None else list(self._nodes)

    @property
    def collection_is_completed(self) -> bool:
        if self.delegate is not None:
            return bool(self.delegate.collection_is_completed)
        return len(self.node2collection) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        if self.delegate is not None:
            return bool(self.delegate.tests_finished)
        return self.collection_is_completed and self.planner is not None and self.planner.finished

    @property
    def has_pending(self) -> bool:
        if self.delegate is not None:
            return bool(self.delegate.has_pending)
        return self.planner is not None and self.planner.has_pending

    def add_node(self, node: Any) -> None:
        if self.delegate is not None:
            self.delegate.add_node(node)
            return
        if self._shadow is not None:  # until the plan is made
            self._shadow.add_node(node)
        self._nodes.append(node)

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        if self.delegate is not None:
            self.delegate.add_node_collection(node, collection)
            return
        if self.planner is None:
            self._shadow.add_node_collection(node, collection)
        if self.collection is not None and list(collection) != self.collection:
            from xdist.report import report_collection_diff  # type: ignore[import-untyped]

            other = next(iter(self.node2collection))
            self.log(report_collection_diff(self.collection, list(collection), other.gateway.id, node.gateway.id))
            return
        self.node2collection[node] = list(collection)
        if self.planner is None:
            self._read_map(node)
        else:
            self.planner.add_node(node)

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        if self.delegate is not None:
            self.delegate.mark_test_complete(node, item_index, duration)
            return
        assert self.planner is not None
        self._sync()
        self._apply(self.planner.complete(node, item_index, duration))

    def mark_test_pending(self, item: str) -> None:
        if self.delegate is not None:
            self.delegate.mark_test_pending(item)
            return
        assert self.planner is not None and self.collection is not None
        self._sync()
        self._apply(self.planner.requeue(self.collection.index(item)))

    def remove_pending_tests_from_node(self, node: Any, indices: Sequence[int]) -> None:
        if self.delegate is not None:
            self.delegate.remove_pending_tests_from_node(node, indices)
            return
        raise NotImplementedError  # only answers to a "steal" command, which this scheduler never sends

    def remove_node(self, node: Any) -> str | None:
        if self.delegate is not None:
            return self.delegate.remove_node(node)  # type: ignore[no-any-return]
        if node in self._nodes:
            self._nodes.remove(node)
        if self.planner is None:
            self.node2collection.pop(node, None)
            return self._shadow.remove_node(node)  # type: ignore[no-any-return]
        self._sync()
        crashed, actions = self.planner.remove_node(node)
        self._apply(actions)
        return self.collection[crashed] if crashed is not None and self.collection is not None else None

    def schedule(self) -> None:
        if self.delegate is not None:
            self.delegate.schedule()
            return
        assert self.collection_is_completed
        if self.planner is not None:
            self._sync()
            self._apply(self.planner.fill_all())
            return
        collections = list(self.node2collection.values())
        first = collections[0]
        if any(c != first for c in collections[1:]) or not self._plan(first):
            self.delegate, self._shadow = self._shadow, None
            self.delegate.schedule()
            return
        assert self.planner is not None
        self._apply(self.planner.fill_all())

    # -- helpers ------------------------------------------------------------------------------------------
    def _read_map(self, node: Any) -> None:
        if self.map_dir is None or self.map.read:
            return
        found = read_collection_map(self.map_dir / f"{node.gateway.id}.json")
        if found is not None:
            self.map = found

    def _plan(self, collection: list[str]) -> bool:
        units = [self.map.tests.get(nodeid) or unit_from_suffix(nodeid) for nodeid in collection]
        if not any(units):
            return False
        self.collection = collection
        from .durations import estimates, load_history

        history = estimates(collection, [u.key if u else None for u in units], load_history(self.config))
        self.planner = Planner(units, gpus_total=self.map.gpus, steal_min=self.steal_min, workers=self.numnodes,
                               history=history)
        for node in self._nodes:
            if node in self.node2collection:
                self.planner.add_node(node)
        self._shadow = None
        self.log(f"{len(collection)} tests, {self.planner.configurations} configurations, {len(self._nodes)} nodes"
                 + (", ordered by earlier runs' durations" if history else ""))
        return True

    def _sync(self) -> None:
        """Nodes xdist itself shut down (``-x``, ``--maxfail``, an interrupt) get nothing more."""
        assert self.planner is not None
        for node in self._nodes:
            if getattr(node, "shutting_down", False):
                self.planner.mark_down(node)

    def _apply(self, actions: Actions) -> None:
        told = {node for node, _ in actions.hints} | {node for node, _ in actions.drops}
        for node, key in actions.hints:
            self._ahead[node] = key
        for node, key in actions.drops:
            self._drops.setdefault(node, set()).add(key)
        for node in told:  # before the tests that the xdist worker reads it at
            write_launch_hint(self.map_dir, node.gateway.id, self._ahead.get(node),  # type: ignore[attr-defined]
                              sorted(self._drops.get(node, ())))
        for node, indices in actions.sends:
            node.send_runtest_some(indices)  # type: ignore[attr-defined]
        for node in actions.shutdowns:
            node.shutdown()  # type: ignore[attr-defined]

    def summary(self) -> str | None:
        """One line for the terminal summary."""
        if self.planner is None:
            if self.delegate is None:
                return None
            return "sglworker: no collected test needs a pooled worker: xdist's load scheduling handed them out"
        p = self.planner
        steal = f"steal={self.steal_min}" if self.steal_min else "stealing off"
        return (f"sglworker: xdist scheduled {len(p.units)} tests by worker configuration: {p.configurations} "
                f"configuration(s) on {self.numnodes} xdist worker(s), {p.launches} launch(es) planned, {p.steals} "
                f"of them extra copies by work stealing ({steal})")


# ---------------------------------------------------------------------------------------------- the hooks


def _state(config: pytest.Config) -> dict[str, Any]:
    return config.stash.setdefault(_STATE, {})


def decision_for(session: SglSession) -> Decision | None:
    state = _state(session.config)
    if "decision" not in state:
        state["decision"] = decide(session.config, session.settings)
    result: Decision | None = state["decision"]
    return result


def header_line(session: SglSession) -> str | None:
    decision = decision_for(session)
    return decision.line if decision is not None else None


def map_dir_for(session: SglSession) -> Path | None:
    """The private directory the xdist workers write their collection maps to (made once, removed at the
    end of the run)."""
    decision = decision_for(session)
    if decision is None or not decision.use:
        return None
    state = _state(session.config)
    if "map_dir" not in state:
        import shutil
        import tempfile

        try:
            path: Path | None = Path(tempfile.mkdtemp(prefix="pytest-sglworker-xdist-"))
        except OSError:
            path = None
        if path is not None:
            session.config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
        state["map_dir"] = path
    result: Path | None = state["map_dir"]
    return result


def configure_node(session: SglSession, node: Any) -> None:
    path = map_dir_for(session)
    if path is not None:
        node.workerinput[MAP_INPUT] = str(path)


def make_scheduler(session: SglSession, config: pytest.Config, log: Any) -> ConfigScheduling | None:
    decision = decision_for(session)
    if decision is None or not decision.use:
        return None
    scheduler = ConfigScheduling(config, log, map_dir=map_dir_for(session), steal_min=session.settings.dist[1])
    _state(config)["scheduler"] = scheduler
    return scheduler


def summary_line(session: SglSession) -> str | None:
    scheduler = _state(session.config).get("scheduler")
    if not isinstance(scheduler, ConfigScheduling):
        return None
    line = scheduler.summary()
    return line if line and (session.settings.models or scheduler.planner is not None) else None


def save_history(session: SglSession) -> None:
    """On the controller, at the end: the tests' durations and the startups this run's launch records hold into
    pytest's cache, for the next run's order (:mod:`.durations`)."""
    scheduler = _state(session.config).get("scheduler")
    if not isinstance(scheduler, ConfigScheduling) or scheduler.planner is None:
        return
    from .durations import save_history as save

    save(session.config, [r for source in session.worker_launches for r in source])
