"""What the plugin does at collection, before any worker starts: :class:`Collection`, registered beside the
session object, runs after ``-k``/``-m``/``--deselect``.

Every test that needs a worker gets its configuration resolved once (``CONFIG_KEY`` in its stash), and every
problem is said before GPU time is spent: a broken budget or a flag sglang's parser refuses (a usage error; on
an xdist worker, an error of each test concerned), a fault the simulated engine would refuse. Then
``--sgl-shard`` selects this runner's part (:mod:`.sharding`), the worker source says which configurations it can
never serve here (a test the inventory can never hold, a shape attached workers cannot take: skipped with the
reason; an attached worker that breaks the budget: an error), tests the router or the gRPC packages are missing
for are skipped (a selected spec that runs ``--grpc-mode`` is then a usage error), and tests are reordered so that
one configuration's tests run together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from ..errors import BudgetViolation, InventoryUnavailable, SglWorkerError
from .keys import (
    CONFIG_KEY,
    ITEM_ERROR_KEY,
    WORKER_FIXTURES,
    is_xdist_worker,
    item_spec,
    router_group_fixture,
    uses_plugin,
)
from .markers import MarkerError, RouterMarker, WorkerMarker, WorkersMarker, opt_out_reason, required_features

if TYPE_CHECKING:
    from ..engine.specs import ModelSpec
    from ..workers.config import KindChooser, WorkerConfig
    from .session import SglSession

__all__ = ["Collection", "modify_items"]


class Collection:
    """The plugin's collection hook, as a plugin object of its own."""

    def __init__(self, session: SglSession) -> None:
        self.session = session

    @pytest.hookimpl(trylast=True)  # after -k/-m/--deselect: deselected tests are neither checked nor counted
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        s = self.session.settings
        # A test's configuration may come from a drop-in's own fixtures (pytest_sglworker.compat.gateway resolves it
        # in its collection hook, which runs first): it is then ordered, refused and scheduled as the plugin's are.
        if not (s.shard or s.worker_urls or any(uses_plugin(item) or CONFIG_KEY in item.stash for item in items)):
            # A run that asks for no worker: nothing to order or launch; the specs registered by conftests found
            # during collection are still checked.
            problems = self.session.spec_problems()
            if problems and not is_xdist_worker(config):
                raise pytest.UsageError("\n".join(problems.values()))
            return
        modify_items(self.session, config, items)
        from .run_hooks import enable_run_hooks  # a run that uses no worker never needs them

        enable_run_hooks(self.session)


def modify_items(session: SglSession, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The collection-time work, in order: markers and budgets checked, each test's worker configuration
    resolved, fault settings checked, sglang's parser asked about extra args, problems raised (or, on an xdist
    worker, given to each test), the shard selected, what the worker source refuses skipped or failed, tests
    without their router or gRPC packages skipped, tests reordered by configuration, and the queue the launch
    ahead reads set."""
    # A usage error stops the session; an xdist worker cannot stop it cleanly (xdist would report an
    # INTERNALERROR), so there each offending test fails on its own with the same message instead.
    problems: dict[str, str] = {}  # nodeid -> message
    spec_problems = session.spec_problems()  # also specs of conftests loaded during collection
    for item in items:
        if "sgl_model" in getattr(item, "fixturenames", ()):
            try:
                required_features(item)
            except MarkerError as exc:
                item.stash[ITEM_ERROR_KEY] = str(exc)
    inventory = _GpuBound(session)
    for item in items:
        fixturenames = getattr(item, "fixturenames", ())
        fixture = next((f for f in WORKER_FIXTURES if f in fixturenames), None)
        if fixture == "sgl_router":
            fixture = router_group_fixture(fixturenames)
        if fixture is None and "sgl_spawn_worker" not in fixturenames:
            continue
        try:
            WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
            opt_out_reason(item)
            if fixture is None:
                continue
            router = RouterMarker.from_mark(item.get_closest_marker("sgl_router"))
            spec = item_spec(item)
            if spec is None:
                continue
            if spec.name in spec_problems:
                problems[item.nodeid] = spec_problems[spec.name]
                continue
            size = 1 if fixture == "sgl_worker" else group_size(item)
            beyond = inventory.refusal(spec, size) if size > 1 else None
            if beyond:  # said before the group's members are planned (work in proportion to its size)
                item.add_marker(pytest.mark.skip(reason=beyond))
                continue
            worker_config = session.resolve_config(item, spec, fixture)
            if "sgl_router" in fixturenames:
                router.members(range(size))
            item.stash[CONFIG_KEY] = worker_config
            fault = sim_fault_problem(session, item.stash[CONFIG_KEY])
            if fault:
                problems[item.nodeid] = f"test {item.nodeid}: {fault}"
        except MarkerError as exc:
            item.stash[ITEM_ERROR_KEY] = str(exc)
        except (BudgetViolation, ValueError) as exc:
            problems[item.nodeid] = str(exc)
    check_attached_names(session)
    with_args = {item.nodeid: item.stash[CONFIG_KEY] for item in items
                 if CONFIG_KEY in item.stash and item.stash[CONFIG_KEY].members()[0].extra_args}
    flagged = session.check_flags({f"test {nodeid}": (c.spec, m.extra_args)
                                   for nodeid, c in with_args.items() for m in c.members()[:1]})
    for nodeid in with_args:
        if f"test {nodeid}" in flagged:
            problems[nodeid] = flagged[f"test {nodeid}"]
    if spec_problems and not is_xdist_worker(config):
        raise pytest.UsageError("\n".join(spec_problems.values()))
    raise_or_give(session, config, items, problems)
    apply_shard(session, config, items)
    apply_refusals(session, config, items)
    skip_without_router(session, items)
    skip_without_grpc(session, items)
    if session.settings.reorder:
        reorder(items)
    session.queue = list(items)
    session.queue_index = {item.nodeid: i for i, item in enumerate(items)}
    if not is_xdist_worker(config):  # an xdist worker does not know which tests it will get
        last_users: dict[Any, str] = {}  # WorkerConfig -> node id
        for item in items:
            if CONFIG_KEY in item.stash:
                last_users[item.stash[CONFIG_KEY]] = item.nodeid
        session.last_users = set(last_users.values())


def group_size(item: pytest.Item) -> int:
    """How many members the ``sgl_workers`` group of ``item`` has, read from its marker alone."""
    marker = WorkersMarker.from_mark(item.get_closest_marker("sgl_workers"))
    return marker.count or marker.prefill + marker.decode


class _GpuBound:
    """The GPUs the session's worker source leases from, read once, when a group first asks: every member of a
    launched group leases one GPU or more, so a group of more members than that can never start here."""

    def __init__(self, session: SglSession) -> None:
        self.session = session
        self._count: int | None = None
        self._read = False

    def refusal(self, spec: ModelSpec, members: int) -> str | None:
        """Why a group of ``members`` of ``spec`` can never be leased here (None: it may be; the source's own
        refusal says more once the group is planned)."""
        if self.session.settings.attached(spec.name):
            return None  # attached workers: the attached source counts them
        if not self._read:
            self._read = True
            try:
                self._count = self.session.source.gpu_count()
            except (SglWorkerError, ValueError):
                self._count = None  # an inventory that cannot be read: said by the source's refusal later
        if self._count is None or members <= self._count:
            return None
        return (f"{spec.name}: the group of {members} workers leases at least {members} GPU(s) at once (one or more "
                f"per member), but the inventory has {self._count}")


def raise_or_give(session: SglSession, config: pytest.Config, items: list[pytest.Item],
                  problems: dict[str, str]) -> None:
    """Problems found at collection: one usage error (said once per distinct message), or, on an xdist worker,
    each offending test's own error."""
    if not problems:
        return
    if not is_xdist_worker(config):
        raise pytest.UsageError("\n".join(dict.fromkeys(problems.values())))
    for item in items:
        if item.nodeid in problems:
            item.stash[ITEM_ERROR_KEY] = problems[item.nodeid]
            if CONFIG_KEY in item.stash:
                del item.stash[CONFIG_KEY]


def check_attached_names(session: SglSession) -> None:
    """``--sgl-worker-url`` naming a spec nobody registered: a usage error listing the known ones."""
    unknown = [n for n in session.settings.worker_urls if n not in session.registry]
    if unknown and not is_xdist_worker(session.config):
        raise pytest.UsageError(f"{session.settings.sources.get('worker-url')}: unknown model spec(s) "
                                f"{', '.join(map(repr, unknown))}; known: {', '.join(session.registry.names())}")


def apply_shard(session: SglSession, config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = session.settings.shard
    if shard is None:
        return
    from .sharding import plan_shards

    costs, notes = session.shard_costs()
    tests = [(item.nodeid, item.stash[CONFIG_KEY].key if CONFIG_KEY in item.stash else None) for item in items]
    shards = plan_shards(tests, shard.total, costs)
    mine = shards[shard.index - 1]
    keep = mine.nodeids
    dropped = [item for item in items if item.nodeid not in keep]
    items[:] = [item for item in items if item.nodeid in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    total = sum(s.cost for s in shards)
    unit = "s" if costs is not None else " tests"
    basis = (f"balanced by {len(costs.sources)} report(s)" if costs is not None
             else "balanced by test count" + (f" ({'; '.join(notes)})" if notes else ""))
    session.shard_note = (f"sglworker: shard {shard}: {len(items)} of {len(tests)} tests, "
                          f"{len(mine.configs)} worker configuration(s), estimated {mine.cost:.1f}{unit} of "
                          f"{total:.1f}{unit} ({basis})")


def apply_refusals(session: SglSession, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Ask the worker source, before anything launches, which configurations it can never serve here: their tests
    are skipped with the reason (or fail with it). An inventory that cannot be read skips every test that needs a
    launched worker, unless the run asked for GPUs explicitly (a usage error then); an unsafe lock directory is an
    error, never a skip (a green run would hide it)."""
    from ..workers.sources.attached import AttachedWorkerError

    problems: dict[str, str] = {}
    verdicts: dict[tuple[WorkerConfig, bool], tuple[str, str] | None] = {}
    for item in items:
        worker_config = item.stash.get(CONFIG_KEY, None)
        if worker_config is None:
            continue
        try:
            opt_out = bool(opt_out_reason(item))
        except MarkerError as exc:
            problems[item.nodeid] = str(exc)
            continue
        key = (worker_config, opt_out)
        if key not in verdicts:
            try:
                refusal = session.source.refusal(worker_config, opt_out=opt_out)
                verdicts[key] = (refusal.action, refusal.reason) if refusal is not None else None
            except AttachedWorkerError as exc:
                if not is_xdist_worker(session.config):
                    raise pytest.UsageError(str(exc)) from None
                verdicts[key] = ("error", str(exc))
            except (SglWorkerError, ValueError) as exc:  # ValueError: --sgl-gpus names GPUs that are not visible
                verdicts[key] = _inventory_verdict(session, exc)
        verdict = verdicts[key]
        if verdict is None:
            continue
        action, reason = verdict
        if action == "skip":
            item.add_marker(pytest.mark.skip(reason=reason))
        elif action == "item-error":
            item.stash[ITEM_ERROR_KEY] = reason
        else:
            problems[item.nodeid] = reason
    raise_or_give(session, config, items, problems)


def _inventory_verdict(session: SglSession, exc: BaseException) -> tuple[str, str]:
    """What a test that needs a launched worker gets when the GPU inventory or the lock directory is unusable."""
    settings = session.settings
    inventory = isinstance(exc, InventoryUnavailable)
    if settings.cluster is not None and inventory:
        # no Ray, or an unreachable cluster: the run cannot mean what it says
        raise pytest.UsageError(f"{settings.sources.get('cluster', '--sgl-cluster')}: {exc}") from None
    if not inventory or (settings.gpus_explicit and is_xdist_worker(session.config)):
        # An unsafe or unusable lock directory is an error, never a skip (a green run would hide it); an xdist
        # worker cannot stop the session cleanly, so each worker test fails with the message.
        return "item-error", f"{settings.sources['gpus']}: {exc}" if inventory else str(exc)
    if settings.gpus_explicit:
        raise pytest.UsageError(f"{settings.sources['gpus']}: {exc}") from None
    return "skip", f"no GPU inventory: {exc}"


def sim_fault_problem(session: SglSession, config: WorkerConfig) -> str | None:
    """With the simulated engine, a fault setting in a spec's or a marker's env that the engine would refuse
    (an unknown fault, a value out of range): said at collection, with the faults it knows."""
    if session.settings.engine != "sim":
        return None
    from ..sim import ENV_FAULT, FaultError, parse_fault_spec

    value = {**config.spec.env, **dict(config.env)}.get(ENV_FAULT)
    if not value:
        return None
    try:
        parse_fault_spec(value, f"env {ENV_FAULT}={value!r}")
    except FaultError as exc:
        return f"{exc}; the faults and their values: python -m pytest_sglworker.sim --help"
    return None


def skip_without_router(session: SglSession, items: list[pytest.Item]) -> None:
    """Skip, before their workers launch, the tests of ``sgl_router`` when the router is not installed (a test whose
    marker is wrong keeps its error: it is wrong with the router too)."""
    users = [item for item in items if "sgl_router" in getattr(item, "fixturenames", ()) and ITEM_ERROR_KEY not in
             item.stash]
    if not users:
        return
    from ..workers.router import RouterUnavailable, router_launcher

    try:
        router_launcher(session.settings.router_launcher)
    except RouterUnavailable as exc:
        for item in users:
            item.add_marker(pytest.mark.skip(reason=str(exc)))


def skip_without_grpc(session: SglSession, items: list[pytest.Item]) -> None:
    """Without the gRPC packages, the tests of gRPC workers (``--grpc-mode``): skipped with the install command
    when a test's args ask for it, a usage error (on an xdist worker: each test's error) when a selected spec's
    worker_args do."""
    verdicts: dict[WorkerConfig, tuple[str, str] | None] = {}
    for item in items:
        worker_config = item.stash.get(CONFIG_KEY, None)
        if worker_config is None or session.settings.attached(worker_config.spec.name):
            continue
        if worker_config not in verdicts:
            verdicts[worker_config] = grpc_refusal(worker_config, session.choose_kind)
        verdict = verdicts[worker_config]
        if verdict is None:
            continue
        if verdict[0] == "skip":
            item.add_marker(pytest.mark.skip(reason=verdict[1]))
        elif is_xdist_worker(session.config):
            item.stash[ITEM_ERROR_KEY] = verdict[1]
        else:
            raise pytest.UsageError(verdict[1])


def grpc_refusal(config: WorkerConfig, choose: KindChooser | None = None) -> tuple[str, str] | None:
    """What a session does with a configuration that has gRPC workers when this Python lacks the gRPC
    packages: ``("usage", message)`` when the spec's own worker_args run ``--grpc-mode`` (the run selected that
    spec: a usage error before anything starts), ``("skip", reason)`` when only a test's args do; None when no
    member is a gRPC worker or the packages are there."""
    from ..engine.grpc_facts import grpc_missing_reason, wants_grpc
    from ..workers.grpc_worker import GrpcWorker

    if not any(isinstance(member.kind, GrpcWorker) for member in config.members(choose)):
        return None
    reason = grpc_missing_reason()
    if not reason:
        return None
    if wants_grpc(config.spec.worker_args):
        return "usage", f"model spec {config.spec.name!r} runs --grpc-mode (its worker_args): {reason}"
    return "skip", reason


def reorder(items: list[pytest.Item]) -> None:
    """Stable: tests of one worker configuration move up to the first test of that configuration."""
    first: dict[str, int] = {}
    keys: list[tuple[int, int]] = []
    for index, item in enumerate(items):
        worker_config = item.stash.get(CONFIG_KEY, None)
        if worker_config is None:
            keys.append((index, 0))
            continue
        anchor = first.setdefault(worker_config.key, index)
        keys.append((anchor, 1 if anchor != index else 0))
    order = sorted(range(len(items)), key=lambda i: (keys[i], i))
    items[:] = [items[i] for i in order]
