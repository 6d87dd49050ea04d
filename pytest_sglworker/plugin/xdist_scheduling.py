"""An xdist scheduler that knows worker configurations (issue #16): ``--sgl-dist``.

Under ``-n N`` xdist's default ``--dist load`` spreads tests in small batches, so that every xdist worker
launches every configuration it receives a test of; ``--dist loadgroup`` launches each configuration once but
leaves xdist workers idle when configurations are few and large. This scheduler does both jobs, by affinity and
work stealing, and launches ahead on free GPUs (how it chooses: :mod:`.planner`).

The controller does not collect; each xdist worker writes, before it reports its collection, which
configuration each node id needs (and how many GPUs it leases at once) to a file of a private directory
that the controller names in ``workerinput``. A node id that is missing there is read from the
``@sgl-<key>`` suffix that ``--dist loadgroup`` adds; a run whose tests need no worker is scheduled by
xdist's own ``LoadScheduling``, unchanged.

:class:`.planner.Planner` is the plain scheduling logic (no xdist, no pytest); :class:`ConfigScheduling` is
xdist's ``Scheduling`` protocol around it. A pytest-facing module: xdist is imported only when a scheduler is made.
The xdist hooks that install it are in :mod:`.xdist_hooks`; ``--sgl-dist`` itself is parsed in :mod:`.options`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .keys import CONFIG_KEY, MAP_INPUT, RUN_INPUT, distributing, xdist_worker_id
from .launch_hints import write_launch_hint
from .markers import MarkerError, WorkerMarker, WorkersMarker, will_run
from .planner import Actions, Planner, Unit

if TYPE_CHECKING:
    from .options import Settings
    from .session import SglSession

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


# ---------------------------------------------------------------------------------------------- the map


def unit_of(session: SglSession, item: pytest.Item) -> Unit | None:
    """What ``item`` needs from the pool (None: nothing pooled: no worker, a skip, an error, fresh workers)."""
    config = item.stash.get(CONFIG_KEY, None)
    skipped = not will_run(item)
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
            # an attached worker (--sgl-worker-url) leases no GPU: the scheduler keeps none for its tests
            gpus = 0 if session.settings.attached(config.spec.name) else config.gpus_needed(session.choose_kind)
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
    startups: dict[str, float] = {}
    for item in items:
        try:
            unit = unit_of(session, item)
        except Exception:  # the map is an optimisation: a test it cannot place runs anywhere
            unit = None
        if unit is not None:
            tests[item.nodeid] = [unit.key, unit.gpus, unit.stealable]
            config = item.stash.get(CONFIG_KEY, None)
            declared = getattr(getattr(config, "spec", None), "startup_seconds", None)
            if declared is not None and config is not None and unit.key == config.key:
                startups[unit.key] = float(declared)
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
                     json.dumps({"schema": MAP_SCHEMA, "gpus": gpus, "tests": tests,
                                                                     "startups": startups}), mode=0o600)
    except OSError:
        pass


@dataclass
class CollectionMap:
    tests: dict[str, Unit] = field(default_factory=dict)
    gpus: int | None = None
    read: bool = False
    #: configuration key -> the startup its spec declares (``ModelSpec.startup_seconds``)
    startups: dict[str, float] = field(default_factory=dict)


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
    startups = data.get("startups")
    if isinstance(startups, dict):
        result.startups = {str(k): float(v) for k, v in startups.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")}
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

    def __init__(self, config: pytest.Config, log: Any, *, map_dir: Path | None, steal_min: int | None,
                 lease_timeout: float | None = None) -> None:
        from xdist.scheduler import LoadScheduling  # type: ignore[import-untyped]
        from xdist.workermanage import parse_tx_spec_config  # type: ignore[import-untyped]

        self.config = config
        self.log = log.sglworkersched if log is not None else (lambda *args: None)
        self.numnodes = len(parse_tx_spec_config(config))
        self.map_dir = map_dir
        self.steal_min = steal_min
        self.lease_timeout = lease_timeout
        self.node2collection: dict[Any, list[str]] = {}
        self._nodes: list[Any] = []
        self.collection: list[str] | None = None
        self.planner: Planner | None = None
        self.map = CollectionMap()
        self.delegate: Any = None
        self._shadow: Any = LoadScheduling(config, log)
        self._ahead: dict[Any, tuple[str, ...]] = {}  # node -> the configurations it is told to launch ahead
        self._drops: dict[Any, set[str]] = {}  # node -> the configurations its pool is to let go when idle
        self._hand: dict[Any, list[str]] = {}  # node -> the configurations whose group it hands over in the run
        self._adopt: dict[Any, dict[str, str]] = {}  # node -> the groups handed to it: key -> the giver's id
        self._last: dict[Any, dict[str, str]] = {}  # node -> key -> the node id of its last test of that configuration

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
        gone = str(node.gateway.id)  # a group it was to hand over never comes: its takers launch their own
        for taker, handed in self._adopt.items():
            if any(giver == gone for giver in handed.values()):
                self._adopt[taker] = {k: g for k, g in handed.items() if g != gone}
                actions.hints.append((taker, self._ahead.get(taker, ())))
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
        from .plan_model import choose_order

        order, walls = choose_order(units, history, nodes=self.numnodes, gpus=self.map.gpus, steal_min=self.steal_min,
                                    declared=self.map.startups)
        self.planner = Planner(units, gpus_total=self.map.gpus, steal_min=self.steal_min, workers=self.numnodes,
                               history=history, lease_timeout=self.lease_timeout, declared=self.map.startups,
                               order=order)
        if walls:
            self.log("orders played: " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()) + f"; {order} taken")
        for node in self._nodes:
            if node in self.node2collection:
                self.planner.add_node(node)
        self._shadow = None
        self.log(f"{len(collection)} tests, {self.planner.configurations} configurations, {len(self._nodes)} nodes"
                 + (", ordered by earlier runs' durations" if history else "")
                 + (f", {len(self.map.startups)} declared startup(s)" if self.map.startups else ""))
        return True

    def _sync(self) -> None:
        """Nodes xdist itself shut down (``-x``, ``--maxfail``, an interrupt) get nothing more."""
        assert self.planner is not None
        for node in self._nodes:
            if getattr(node, "shutting_down", False):
                self.planner.mark_down(node)

    def _apply(self, actions: Actions) -> None:
        told = {node for node, _ in actions.hints} | {node for node, _ in actions.drops}
        for node, keys in actions.hints:
            self._ahead[node] = keys
        for node, key in actions.drops:
            self._drops.setdefault(node, set()).add(key)
        for giver, taker, key in actions.handovers:
            self._hand.setdefault(giver, []).append(key)
            self._adopt.setdefault(taker, {})[key] = str(giver.gateway.id)  # type: ignore[attr-defined]
            told |= {giver, taker}
        for node, key, index in actions.lasts:
            if self.collection is not None:
                self._last.setdefault(node, {})[key] = self.collection[index]
                told.add(node)
        for node in told:  # before the tests that the xdist worker reads it at
            write_launch_hint(self.map_dir, node.gateway.id, self._ahead.get(node, ()),  # type: ignore[attr-defined]
                              sorted(self._drops.get(node, ())), self._hand.get(node, ()),
                              self._adopt.get(node, {}), self._last.get(node, {}))
        gone: set[Any] = set()
        for node, indices in actions.sends:
            if node in gone:
                continue
            try:
                node.send_runtest_some(indices)  # type: ignore[attr-defined]
            except OSError:  # it died since it last reported (killed): xdist's remove_node requeues what it held
                gone.add(node)
                if self.planner is not None:
                    self.planner.mark_down(node)
                self.log(f"{node.gateway.id} is gone: its tests go back when xdist removes it")  # type: ignore
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
                f"of them extra copies by work stealing ({steal})"
                + (f", {p.handed} group(s) launched ahead handed to another xdist worker" if p.handed else ""))


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
        node.workerinput[RUN_INPUT] = list(run_party())


def run_party() -> tuple[int, float, str]:
    """This controller as the run its xdist workers hand groups over within: pid, start time, session id."""
    import psutil

    from ..resources.processes import SESSION_ID

    return os.getpid(), psutil.Process().create_time(), SESSION_ID


def end_run_groups(session: SglSession) -> None:
    """On the controller, at the end of the run: the groups handed over within it that no xdist worker adopted (or
    that one left) are ended now; their keepers would end them once this process is gone."""
    if _state(session.config).get("map_dir") is None:
        return  # no xdist worker was told of this run
    from ..resources.processes import SESSION_ID
    from ..resources.warm import end_run

    with contextlib.suppress(Exception):  # never fails the run: the keepers end them anyway
        for line in end_run(session.lock_dir(), SESSION_ID):
            session.terminal.note(f"ended a group handed over in this run that no xdist worker took: {line}")


def make_scheduler(session: SglSession, config: pytest.Config, log: Any) -> ConfigScheduling | None:
    decision = decision_for(session)
    if decision is None or not decision.use:
        return None
    scheduler = ConfigScheduling(config, log, map_dir=map_dir_for(session), steal_min=session.settings.dist[1],
                                 lease_timeout=session.settings.lease_timeout)
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
