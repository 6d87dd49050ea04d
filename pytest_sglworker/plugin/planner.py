"""The plain logic of the xdist scheduler that knows worker configurations (:mod:`.xdist_scheduling`, which is
xdist's ``Scheduling`` protocol around it): which tests (collection indices) go to which xdist worker (a node),
what a node launches ahead, and what it lets go. No xdist, no pytest: a discrete-event model of xdist workers
drives it in the tests.

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
- **Launch ahead**: with fewer xdist workers than GPUs, every GPU no node's pool holds starts a configuration:
  the unstarted ones with the most work that fit, each told to the node that will take its tests soonest (once
  its own tests and its earlier launches ahead are done, no sooner than the new one has started), which takes
  them once its own are done: the one ready soonest where the startups are known (launched when, and its startup),
  else in the order told; a node sent the first test of a configuration behind tests of another launches it at
  once when its GPUs are free, not at that test (issue 43: startups queued behind tests left GPUs idle), and one
  that holds two tests already is sent no such test while the GPUs are not free (it would wait behind them, while
  another node may be free first); the test that empties a configuration's queue is named to the node it is sent
  to as its last of that configuration (its pool lets the group go as that test ends, not a test later, when the node
  has heard it ran), and once a configuration's tests have all run, the node that ran them is told to let its idle
  workers go. A node that holds nothing and must wait for its own launch starts the one ready soonest (the
  shortest startup; the launches ahead take the most work). A first test a node was sent behind its running test
  while the GPUs were not free (it would launch only at that test) is launched ahead as soon as the GPUs the pools
  hold leave room for it. A launch ahead whose tests a node now takes stays in that node's word until one of them
  has run (its pool may not have read the word yet). The xdist worker follows its word between tests and, while
  it waits for a launch of its own, about every 0.1 s.
- **Startups**: what this run measured, else earlier runs (history), else what the spec declares
  (``ModelSpec.startup_seconds``, read from the collection map), else the others' figures.
- **Handing over**: a node that runs its last test and finds nothing new that fits takes the tests of a
  configuration another node launched ahead and would take only later (not the one it takes next, the one ready
  soonest where the startups are known, unless that node is busy for longer than it takes to be ready), and adopts
  that node's group, which is handed over to it
  (:mod:`..workers.pool_warm`): a ready group no longer waits for its own xdist worker while another sits idle
  (issue 43). So does a node whose own launches ahead would keep it waiting, when another node's is ready sooner by
  more than :data:`HANDOVER_SECONDS`, and a node that would start a configuration of its own, when another node's
  launch ahead is ready sooner than that startup by more than it (it would wait for its own launch while the ready
  group waits for a busy node).
- **Waiting for GPUs**: the first node that waits for GPUs for a test has the GPUs of the configuration with the
  most work kept for it; a node that holds its last test and finds nothing that fits takes that configuration
  anyway when there are fewer xdist workers than GPUs (one that leaves is missed), else it leaves.

Why one module of this size: every rule above reads and changes the same nodes, queues and hints, and the tests drive
it whole as a discrete-event model.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

#: tests a node holds at once (the one it runs, the next one xdist needs to know, one more in flight)
WINDOW = 3
#: what a hand-over within the run may cost (the giver's follower thread hands a ready group over while a test runs, or
#: its main thread between tests where a plugin hook or Ray keeps the follower away): a node takes over another's launch
#: ahead instead of its own only when that one is ready sooner by more than this
HANDOVER_SECONDS = 1.0


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
    #: every configuration it launched and was not yet told to let go, in launch order: ``residents`` leaves out
    #: those the planner reckons its pool evicted, which the pool may still hold (it evicts only when it must)
    pooled: dict[str, None] = field(default_factory=dict)
    probes: set[int] = field(default_factory=set)  # tests whose duration includes a launch
    launched_at: float = 0.0  # when the planner started its current configuration (its clock)
    down: bool = False


@dataclass
class Actions:
    """What the planner asks of the xdist workers: tests to send (collection indices), and shutdowns."""

    sends: list[tuple[Hashable, list[int]]] = field(default_factory=list)
    shutdowns: list[Hashable] = field(default_factory=list)
    #: the configurations a node is to launch ahead now, on GPUs no node holds, while it runs its own, in the
    #: order it takes their tests once its own are done: its whole list each time it changes (empty: none)
    hints: list[tuple[Hashable, tuple[str, ...]]] = field(default_factory=list)
    #: configurations whose tests are all handed out: a node's pool lets their idle workers go (with hints only)
    drops: list[tuple[Hashable, str]] = field(default_factory=list)
    #: groups handed over within the run: ``(giver, taker, key)``, the giver launched ``key`` ahead, the taker runs
    #: its tests and adopts the group (with hints only)
    handovers: list[tuple[Hashable, Hashable, str]] = field(default_factory=list)
    #: ``(node, key, index)``: test ``index`` is the node's last of ``key``, whose tests are all handed out; its pool
    #: lets the group go right after that test, not a test later when the node has heard it ran (with hints only)
    lasts: list[tuple[Hashable, str, int]] = field(default_factory=list)


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
                 clock: Callable[[], float] = time.monotonic, hints: bool = True,
                 lease_timeout: float | None = None, declared: Mapping[str, float] | None = None,
                 order: str = "work") -> None:
        self.units = list(units)
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}; known: {', '.join(ORDERS)}")
        #: which configurations start first (:data:`ORDERS`)
        self.order = order
        #: the startups the specs declare (``ModelSpec.startup_seconds``): what a launch costs before any run measured
        self.declared = dict(declared or {})
        #: when each configuration launched ahead was launched (the planner's clock), to tell when it is ready
        self._ahead_at: dict[str, float] = {}
        #: node id -> the configurations it was told to launch ahead and has not started taking tests of, in the
        #: order it takes them (the run's plan: the order they start in)
        self.hints: dict[Hashable, list[str]] | None = {} if hints else None
        #: node id -> its launches ahead whose tests it now takes, until one of them has run: they stay in its word
        #: (:meth:`_word`), so that a pool that has not read the word yet still launches them ahead, not at their test
        self._taking: dict[Hashable, list[str]] = {}
        self.clock = clock
        #: how long an xdist worker's pool waits for a lease (``--sgl-lease-timeout``; None: unknown)
        self.lease_timeout = lease_timeout
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
        #: the first node that waits for GPUs for a test (it holds none), and the configuration with the most work
        #: that it waits for: no other node starts a configuration on those GPUs (without it, configurations of one
        #: GPU took each GPU as it came free, and one of two GPUs waited to the end); it takes the first that fits
        self._waiter: tuple[Hashable, str] | None = None
        self.launches = 0
        self.steals = 0
        #: groups handed over from the node that launched them ahead to the one that runs their tests
        self.handed = 0
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
        for value in (self._run_startup(key), history.get(key), self.declared.get(key),
                      _median([s for k in self._startups if (s := self._run_startup(k)) is not None]),
                      self._startup_fill, _median(list(self.declared.values()))):
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
        return startups.get(key, self.declared.get(key, self._startup_fill or 0.0)) + sum(
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
        """Seconds from now until ``node`` takes a queued test: what is left of its launch (``startup``: its current
        configuration's; a launch of another one it holds a test of, that one's), then its pending tests."""
        probing = [u.key for i in node.pending if i in node.probes and (u := self.units[i]) is not None]
        if probing and probing[0] != node.current:
            startup = self.startup_seconds(probing[0]) or startup
        if probing or self._starting(node):
            left = max(0.0, node.launched_at + startup - self.clock())
        else:  # a launch ahead it now takes the tests of may not be ready yet
            left = (self._ready_in(node.current) or 0.0) if node.current is not None else 0.0
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
        self._taking.pop(node_id, None)
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
        told = False
        if unit is not None:
            samples = self._startups if index in node.probes else self._seconds
            samples.setdefault(unit.key, []).append(max(0.0, duration))
            if unit.key in self._taking.get(node_id, ()):
                self._taking[node_id].remove(unit.key)  # its pool has the group by now
                told = True
            if self.hints is not None and unit.key in self.hints.get(node_id, ()):
                self.hints[node_id].remove(unit.key)  # it runs: no longer a launch ahead
                told = True
        node.probes.discard(index)
        actions = self._fill_nodes([node, *(other for other in self.nodes.values() if other is not node)])
        if told and not any(n == node_id for n, _ in actions.hints) and self.hints is not None:
            actions.hints.append((node_id, self._word(node_id)))
        return actions

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
    def _choose(self, node: _Node, holds: int) -> tuple[tuple[str, str | None] | None, bool]:
        """``((kind, key), blocked)``: what ``node``, holding ``holds`` tests, takes next (kind ``same``,
        ``resident``, ``new``, ``unkeyed`` or ``steal``), and whether something was left only because its GPUs are
        not free."""
        current = node.current
        if current is not None and self.queues.get(current):
            return ("same", current), False
        ahead = self.hints.get(node.id, []) if self.hints is not None else []
        mine = [k for k in [*ahead, *(k for k in node.residents if k not in ahead)]  # its launches ahead, plan order
                if k != current and self.queues.get(k) and (self.info[k].stealable or not self.copies(k))]
        if mine:
            own = self._soonest(mine)
            wait = self._ready_in(own)
            if wait and holds <= 1:  # it would wait for its own: another's launch ahead, ready sooner, is taken over
                other = self._sooner_than(node, wait)
                if other is not None:
                    return ("adopt", other), False
            return ("resident", own), False
        free = self._free_for(node)
        blocked = False
        unstarted = self._most_work_first(self._unstarted(node))
        if holds == 0 and self.hints is not None and self.total is not None and self.workers < self.total:
            # it will wait for the launch: the one ready soonest (the launches ahead take the most work first)
            unstarted.sort(key=lambda k: self.startup_seconds(k) or 0.0)
        waiter = self._waiting()
        if waiter is not None and waiter[0] is not node and free is not None:
            free -= self._gpus(waiter[1])  # the GPUs it waits for are kept for it
        for key in unstarted:
            if free is None or self._gpus(key) <= free:
                if waiter is not None and waiter[0] is node:
                    self._waiter = None
                if holds <= 1 and (adopted := self._sooner_than(node, self.startup_seconds(key))) is not None:
                    return ("adopt", adopted), False
                return ("new", key), False
            blocked = True
        handed = self._to_take_over(node) if holds <= 1 else None
        if handed is not None:
            return ("adopt", handed), False
        if blocked and holds == 0 and waiter is None:
            self._waiter = (node.id, unstarted[0])
        if self.queues.get(None):
            return ("unkeyed", None), False
        stolen = self._steal_for(free)
        if stolen is not None:
            return ("steal", stolen), False
        if blocked and holds == 1 and self.total is not None and self.workers < self.total and self._short_wait(
                node, unstarted[0]):
            # It would have to leave (it holds one test), and with fewer xdist workers than GPUs one that leaves
            # is missed: it takes the configuration with the most work, whose lease its pool waits for
            return ("new", unstarted[0]), False
        # A copy that lacks GPUs is not waited for: a node that waits keeps its idle workers' GPUs (its pool lets
        # them go only between its own tests), which the configurations still to start may need
        return None, blocked

    def _word(self, node_id: Hashable) -> tuple[str, ...]:
        """What ``node_id`` is told to launch ahead, in order: the launches ahead whose tests it takes now (until one
        has run) and those it takes later."""
        later = self.hints.get(node_id, []) if self.hints is not None else []
        return (*(k for k in self._taking.get(node_id, ()) if k not in later), *later)

    def _ready_in(self, key: str) -> float | None:
        """Seconds until ``key``, launched ahead, is ready (0: ready, or not launched ahead; None: its startup is
        unknown)."""
        at = self._ahead_at.get(key)
        if at is None:
            return 0.0
        startup = self.startup_seconds(key)
        return None if startup is None else max(0.0, at + startup - self.clock())

    def _soonest(self, keys: Sequence[str]) -> str:
        """Of ``keys`` (in plan order), the one ready soonest; the first where that is not known."""
        known = [(ready, i) for i, k in enumerate(keys) if (ready := self._ready_in(k)) is not None]
        return keys[min(known)[1]] if len(known) == len(keys) else keys[0]

    def _sooner_than(self, node: _Node, seconds: float | None) -> str | None:
        """Another node's launch ahead for ``node`` to take over instead of waiting ``seconds`` for a launch of its
        own (its launch ahead, or a new one's startup): one ready sooner by more than :data:`HANDOVER_SECONDS` (else
        None, and None when ``seconds`` is not known)."""
        other = self._to_take_over(node) if seconds is not None else None
        ready = self._ready_in(other) if other is not None else None
        return other if ready is not None and seconds is not None and ready + HANDOVER_SECONDS < seconds else None

    def _to_take_over(self, node: _Node) -> str | None:
        """A configuration another node launched ahead and has not started, for ``node`` to take over (it has
        nothing else to do), not the one that node takes next: the one ready soonest where every startup is known,
        else the last of the node with the most launched ahead."""
        if self.hints is None:
            return None
        best: tuple[int, str] | None = None
        candidates: list[str] = []
        for other in self.nodes.values():
            if other is node or other.down:
                continue
            keys = [k for k in self.hints.get(other.id, ()) if self.queues.get(k) and self.info[k].stealable
                    and not self.copies(k)]
            if keys and not self.queues.get(str(other.current)):
                soonest = self._soonest(keys)
                unknown, busy = self._done_in(other)
                soon = self._ready_in(soonest)
                if unknown or soon is None or busy <= soon + HANDOVER_SECONDS:
                    keys.remove(soonest)  # it takes that one next, as soon as it is ready
            candidates += keys
            if keys and (best is None or len(keys) > best[0]):
                best = (len(keys), keys[-1])
        ready = [(r, k) for k in candidates if (r := self._ready_in(k)) is not None]
        if candidates and len(ready) == len(candidates):
            return min(ready)[1]
        return best[1] if best is not None else None

    def _take_over(self, node: _Node, key: str, actions: Actions) -> None:
        """``node`` takes ``key``'s tests, and the group the node that launched it ahead hands over."""
        assert self.hints is not None
        giver = next(n for n in self.nodes.values() if key in self.hints.get(n.id, ()))
        self.hints[giver.id].remove(key)
        giver.pooled.pop(key, None)
        if key in giver.residents:
            giver.residents.remove(key)
        actions.hints.append((giver.id, self._word(giver.id)))
        node.residents = [key, *(k for k in node.residents if k != key)]
        node.pooled[key] = None
        self.handed += 1
        actions.handovers.append((giver.id, node.id, key))

    def _short_wait(self, node: _Node, key: str) -> bool:
        """Whether ``key``'s GPUs come free for ``node`` well within the lease timeout (half of it), as the other
        nodes' seconds left (:meth:`_done_in`) tell: sooner done, sooner their GPUs are free. With no timeout
        known, yes; with one, no when a node that holds what it needs has unknown seconds left."""
        if self.lease_timeout is None or self.total is None:
            return True
        free, need = self._free_for(node) or 0, self._gpus(key)
        holders = sorted(((self._done_in(n), n) for n in self.nodes.values() if n is not node and self._held(n)),
                         key=lambda pair: pair[0])
        for (unknown, seconds), other in holders:
            if unknown or seconds > self.lease_timeout / 2:
                return False
            free += self._held(other)
            if free >= need:
                return True
        return free >= need

    def _waiting(self) -> tuple[_Node, str] | None:
        """The node that waits for GPUs, and for which configuration (None: none, or it no longer waits)."""
        if self._waiter is None:
            return None
        node, key = self.nodes.get(self._waiter[0]), self._waiter[1]
        if node is None or node.down or node.pending or key not in self._unstarted(node):
            self._waiter = None
            return None
        return node, key

    def _most_work_first(self, keys: list[str]) -> list[str]:
        """``keys`` in the order configurations start (:data:`ORDERS`, ``self.order``; ties in collection order)."""
        return sorted(keys, key=lambda k: ORDERS[self.order](self, k))

    def _unstarted(self, node: _Node | None = None) -> list[str]:
        """Configurations no node takes tests of, less those launched ahead by another node than ``node``."""
        hinted = {key for nid, keys in (self.hints or {}).items()
                  if (node is None or nid != node.id) and nid in self.nodes and not self.nodes[nid].down
                  for key in keys}
        return [k for k, q in self.queues.items() if k is not None and q and not self.copies(k) and k not in hinted]

    def _hint(self, actions: Actions) -> None:
        """Launch ahead: on GPUs no node's pool holds, the unstarted configurations with the most work that fit,
        each to the node that runs a configuration and will take its tests soonest (:meth:`_free_at`); it takes
        their tests once its own are done (its pool holds them: residents), in the order told. An xdist worker sees
        its tests only one ahead, so without this a configuration started only as its first test came, and with
        fewer xdist workers than GPUs, GPUs sat idle while startups queued behind tests. Never while a node waits
        for GPUs for its first test."""
        if self.hints is None or self.total is None:
            return
        for node in self.nodes.values():
            self._let_go(node, actions)
        nodes = [n for n in self.nodes.values() if not n.down]
        if any(not n.pending for n in nodes):
            return  # a node waits for GPUs (or is about to leave): they are its
        self._launch_queued([n for n in self.nodes.values() if n.pending], actions)  # leaving ones' too
        # not a node whose next configuration, after a test of its current one, is a launch it has yet to start:
        # the launch ahead would take GPUs that launch needs, and the node would run the one after it first
        busy = [n for n in nodes if n.current is not None and not any(i in n.probes for i in n.pending[1:])]
        if not busy:
            return
        told: list[_Node] = []
        while True:
            free = self.total - sum(self._held(n) for n in self.nodes.values())
            fits = self._most_work_first([k for k in self._unstarted() if self._gpus(k) <= free])
            if not fits:
                break
            key = fits[0]
            node = min(busy, key=lambda n: self._free_at(n, key))
            node.residents = [key, *(k for k in node.residents if k != key)]
            node.pooled[key] = None
            self.hints.setdefault(node.id, []).append(key)
            self.launches += 1
            self._ahead_at[key] = self.clock()
            if node not in told:
                told.append(node)
        for node in told:
            actions.hints.append((node.id, self._word(node.id)))

    def _launch_queued(self, nodes: Sequence[_Node], actions: Actions) -> None:
        """A launch a node holds a first test of behind its running test (sent when its GPUs were not free: it
        would start only at that test) starts now, as a launch ahead, once the GPUs the pools hold leave room for it:
        its startup overlaps the node's tests before it (issue 43: two such launches queued one behind the other on
        one node while the GPUs that came free stood idle)."""
        assert self.hints is not None and self.total is not None
        queued = [(node, i, unit.key) for node in nodes for i in node.pending[1:]
                  if i in node.probes and (unit := self.units[i]) is not None]
        if not queued:
            return
        waiting = {(node.id, key) for node, _, key in queued}
        # what the pools hold (a launch ahead never evicts: a node's idle workers count until they are let go)
        held = sum(self._gpus(k) for n in self.nodes.values() for k in n.pooled if (n.id, k) not in waiting)
        for node, index, key in queued:
            if held + self._gpus(key) > self.total:
                break  # in the order sent: a later one does not overtake an earlier one
            held += self._gpus(key)
            node.probes.discard(index)
            self.hints.setdefault(node.id, []).append(key)
            self._ahead_at[key] = self.clock()
            actions.hints.append((node.id, self._word(node.id)))

    def _let_go(self, node: _Node, actions: Actions, batch: Sequence[int] = ()) -> None:
        """What no test will take again is let go, and no longer counted, once the node has run its last test of it
        (told earlier, its pool would stop the workers between two of their own tests); ``batch``: tests it is being
        sent now."""
        if self.hints is None:
            return
        pending = {u.key for i in (*node.pending, *batch) if (u := self.units[i]) is not None}
        for key in [k for k in node.pooled if k != node.current and k not in self.hints.get(node.id, ())
                    and not self.queues.get(k) and k not in pending]:
            del node.pooled[key]
            if key in node.residents:
                node.residents.remove(key)
            actions.drops.append((node.id, key))

    def _free_at(self, node: _Node, key: str) -> tuple[bool, float]:
        """When ``node`` would take ``key``'s tests, launched ahead now, to sort by: once its own are done and those
        of the configurations it launches ahead already (each no sooner than its startup), and ``key``'s startup;
        by test counts where a test's seconds are not known yet (no history, nothing measured)."""
        unknown, at = self._done_in(node)
        for ahead in [*self.hints.get(node.id, ()), key] if self.hints is not None else [key]:
            startup, queued = self.startup_seconds(ahead), self.queued_seconds(ahead)
            if unknown or startup is None or queued is None:
                unknown = True
                at += len(self.queues.get(ahead) or ()) if ahead != key else 0
            else:
                at = max(at, startup) + (queued if ahead != key else 0.0)
        return unknown, at

    def _done_in(self, node: _Node) -> tuple[bool, float]:
        """How soon ``node`` is done with its current configuration, to sort by: the seconds of what is left of its
        launch, its pending tests and its share of the configuration's queue; by the queue's test count where a
        test's seconds are not known yet (no history, nothing measured)."""
        key = str(node.current)
        share = max(1, self.copies(key))
        startup, queued = self.startup_seconds(key), self.queued_seconds(key)
        if startup is None or queued is None:
            return True, len(self.queues.get(key) or ()) / share
        return False, self._busy_for(node, startup) + queued / share

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
        node.pooled[key] = None
        if self.total is not None:
            while len(node.residents) > 1 and sum(self._held(n) for n in self.nodes.values()) > self.total:
                node.residents.pop()  # the pool evicts its least recently used idle worker (reckoned so)

    def _fill(self, node: _Node, actions: Actions, window: int | None = None) -> None:
        if node.down:
            return
        batch: list[int] = []
        choice: tuple[str, str | None] | None = None
        blocked = False
        while len(node.pending) + len(batch) < (window or self.window):
            choice, blocked = self._choose(node, len(node.pending) + len(batch))
            if choice is None:
                break
            kind, key = choice
            probe = False
            if kind in ("new", "steal") and key is not None:
                # A look-ahead (the node holds tests before it) on GPUs no pool holds is launched ahead now, not at
                # its first test: its startup overlaps the tests before it (without, a node's startups queued behind
                # its own tests while their GPUs stood idle); what it has run its last test of is let go first
                self._let_go(node, actions, batch)
                ahead = (kind == "new" and self.hints is not None and self.total is not None
                         and bool(node.pending or batch) and self._gpus(key) <= self.total - sum(
                             self._held(n) for n in self.nodes.values()))
                if kind == "new" and not ahead and len(node.pending) + len(batch) >= 2:
                    # a look-ahead it cannot launch now would wait behind its tests: decided at its next test, when
                    # another node may be free for it
                    break
                self._launch(node, key)
                node.launched_at = self.clock()
                self.launches += 1
                self.steals += kind == "steal"
                probe = not ahead
                if ahead and self.hints is not None:
                    self.hints.setdefault(node.id, []).append(key)
                    self._ahead_at[key] = self.clock()
                    actions.hints.append((node.id, self._word(node.id)))
            elif kind == "adopt" and key is not None:
                self._take_over(node, key, actions)
            elif kind == "resident" and key is not None:
                node.residents = [key, *(k for k in node.residents if k != key)]
                if self.hints is not None and key in self.hints.get(node.id, ()):
                    self.hints[node.id].remove(key)  # its launch ahead is now its current configuration
                    self._taking.setdefault(node.id, []).append(key)  # still in its word until a test of it ran
                    actions.hints.append((node.id, self._word(node.id)))
            if key is not None:
                node.current = key
            index = self.queues[key].popleft()
            if probe:
                node.probes.add(index)
            batch.append(index)
        if batch:
            node.pending.extend(batch)
            actions.sends.append((node.id, batch))
            self._last_of(node, batch, actions)
        if not self.left():
            self._down(node, actions)
        elif choice is None and len(node.pending) < 2 and (node.pending or not blocked):
            # Nothing for it now: it runs what it holds and leaves, so that its pool's GPUs are given back. A node
            # that holds a test cannot wait (xdist runs a test only once it knows the next one, or the shutdown);
            # one that holds none waits when only GPUs are missing (the others free theirs as they finish).
            self._down(node, actions)

    def _last_of(self, node: _Node, batch: Sequence[int], actions: Actions) -> None:
        """For each configuration of ``batch`` whose queue it emptied: the node's last pending test of it (told with
        the tests, so that the group goes as that test ends, while the node's next test runs; issue 43)."""
        if self.hints is None:
            return
        for key in dict.fromkeys(u.key for i in batch if (u := self.units[i]) is not None):
            if not self.queues.get(key):
                last = next(i for i in reversed(node.pending) if (u := self.units[i]) is not None and u.key == key)
                actions.lasts.append((node.id, key, last))

    def _down(self, node: _Node, actions: Actions) -> None:
        node.down = True
        actions.shutdowns.append(node.id)


def _by_work(p: Planner, key: str) -> tuple[float, ...]:
    """The most work (longest processing time: from history), else the most GPU-tests (tests times GPUs: a
    configuration of two GPUs is the harder to place late, issue 43's generated suites), then the longest declared
    startup, then the most tests."""
    queued = len(p.queues[key])
    return -(p.work(key) or 0.0), -p._gpus(key) * queued, -p.declared.get(key, 0.0), -queued


def _by_area(p: Planner, key: str) -> tuple[float, ...]:
    """The most GPU-seconds (work times GPUs), then as :func:`_by_work`."""
    return -(p.work(key) or 0.0) * max(1, p._gpus(key)), *_by_work(p, key)[1:]


def _by_gpus(p: Planner, key: str) -> tuple[float, ...]:
    """The most GPUs first (they are the harder to place late), then as :func:`_by_work`."""
    return -float(p._gpus(key)), *_by_work(p, key)


def _by_startup(p: Planner, key: str) -> tuple[float, ...]:
    """The longest startup first (it keeps its GPUs longest before a test can use them), then as :func:`_by_work`."""
    return -(p.startup_seconds(key) or 0.0), *_by_work(p, key)


def _by_gpus_startup(p: Planner, key: str) -> tuple[float, ...]:
    """The most GPUs, then the longest startup, then as :func:`_by_work`."""
    return -float(p._gpus(key)), *_by_startup(p, key)


#: the orders in which unstarted configurations start (launches ahead, a node's next): ``work`` unless the run's plan
#: (:mod:`.plan_model`) predicts another one ends sooner
ORDERS: dict[str, Callable[[Planner, str], tuple[float, ...]]] = {
    "work": _by_work, "area": _by_area, "gpus": _by_gpus, "startup": _by_startup, "gpus-startup": _by_gpus_startup}

