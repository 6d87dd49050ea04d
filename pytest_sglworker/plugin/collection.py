"""What the plugin does at collection, before any worker starts: a pytest-facing module split from
``session.py`` (whose ``pytest_collection_modifyitems`` calls :func:`modify_items`).

Every test that needs a worker gets its configuration resolved once (``CONFIG_KEY`` in its stash), and every
problem is said before GPU time is spent: a broken budget or a flag sglang's parser refuses (a usage error; on
an xdist worker, an error of each test concerned), an attached worker that is down or serves another model, a
fault the simulated engine would refuse. Then ``--sgl-shard`` selects this runner's part (:mod:`sharding`),
tests the inventory can never hold or the router is missing for are skipped with the reason (so are tests of
gRPC workers without the gRPC packages; a selected spec that runs ``--grpc-mode`` is then a usage error), and
tests are reordered so that one configuration's tests run together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from ..errors import BudgetViolation, SglWorkerError
from .markers import MarkerError, WorkerMarker, WorkersMarker, opt_out_reason, required_features
from .session import CONFIG_KEY, ITEM_ERROR_KEY, WORKER_FIXTURES, is_xdist_worker, item_spec

if TYPE_CHECKING:
    from ..workers.kinds import KindChooser, WorkerConfig
    from .session import SglSession


def check_attached(session: SglSession, items: list[pytest.Item], problems: dict[str, str]) -> None:
    from ..workers.attached import AttachedWorkerError

    if not session.settings.worker_urls:
        return
    unknown = [n for n in session.settings.worker_urls if n not in session.registry]
    if unknown and not is_xdist_worker(session.config):
        raise pytest.UsageError(f"{session.settings.sources.get('worker-url')}: unknown model spec(s) "
                                f"{', '.join(map(repr, unknown))}; known: {', '.join(session.registry.names())}")
    for item in items:
        config = item.stash.get(CONFIG_KEY, None)
        if config is None or config.spec.name not in session.settings.worker_urls:
            continue
        try:
            refusal = session.attached_refusal(item, config)
        except AttachedWorkerError as exc:
            if not is_xdist_worker(session.config):
                raise pytest.UsageError(str(exc)) from None
            refusal = ("error", str(exc))
        except MarkerError as exc:
            refusal = ("error", str(exc))
        if refusal is None:
            continue
        if refusal[0] == "skip":
            item.add_marker(pytest.mark.skip(reason=refusal[1]))
        else:
            problems[item.nodeid] = refusal[1]


def shard_costs(session: SglSession) -> tuple[Any, list[str]]:
    """The costs of --sgl-shard-report (None: balance by test count) and notes for the header, read once; a
    file that is no run report is a usage error naming it."""
    if session.shard_costs is None:
        from .sharding import load_costs

        try:
            session.shard_costs = load_costs(session.settings.shard_report)
        except ValueError as exc:
            raise pytest.UsageError(f"{session.settings.sources.get('shard-report')}: {exc}") from None
    return session.shard_costs


def apply_shard(session: SglSession, config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = session.settings.shard
    if shard is None:
        return
    from .sharding import plan_shards

    costs, notes = shard_costs(session)
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


def modify_items(session: SglSession, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The collection-time work, in order: markers and budgets checked, each test's worker configuration
    resolved, attached workers and fault settings checked, sglang's parser asked about extra args, problems
    raised (or, on an xdist worker, given to each test), the shard selected, impossible tests skipped, tests
    reordered by configuration, and the queue the launch ahead reads set."""
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
    for item in items:
        fixturenames = getattr(item, "fixturenames", ())
        fixture = next((f for f in WORKER_FIXTURES if f in fixturenames), None)
        if fixture is None and "sgl_spawn_worker" not in fixturenames:
            continue
        try:
            WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
            opt_out_reason(item)
            if fixture is None:
                continue
            from .markers import RouterMarker

            RouterMarker.from_mark(item.get_closest_marker("sgl_router"))
            spec = item_spec(item)
            if spec is None:
                continue
            if spec.name in spec_problems:
                problems[item.nodeid] = spec_problems[spec.name]
                continue
            item.stash[CONFIG_KEY] = session.resolve_config(item, spec, fixture)
            fault = sim_fault_problem(session, item.stash[CONFIG_KEY])
            if fault:
                problems[item.nodeid] = f"test {item.nodeid}: {fault}"
        except MarkerError as exc:
            item.stash[ITEM_ERROR_KEY] = str(exc)
        except (BudgetViolation, ValueError) as exc:
            problems[item.nodeid] = str(exc)
    check_attached(session, items, problems)
    with_args = {item.nodeid: item.stash[CONFIG_KEY] for item in items
                 if CONFIG_KEY in item.stash and item.stash[CONFIG_KEY].members()[0].extra_args}
    flagged = session.check_flags({f"test {nodeid}": (c.spec, m.extra_args)
                                for nodeid, c in with_args.items() for m in c.members()[:1]})
    for nodeid in with_args:
        if f"test {nodeid}" in flagged:
            problems[nodeid] = flagged[f"test {nodeid}"]
    if spec_problems and not is_xdist_worker(config):
        raise pytest.UsageError("\n".join(spec_problems.values()))
    if problems:
        if not is_xdist_worker(config):
            raise pytest.UsageError("\n".join(dict.fromkeys(problems.values())))
        for item in items:
            if item.nodeid in problems:
                item.stash[ITEM_ERROR_KEY] = problems[item.nodeid]
                if CONFIG_KEY in item.stash:
                    del item.stash[CONFIG_KEY]
    apply_shard(session, config, items)
    skip_impossible(session, items)
    skip_without_router(session, items)
    skip_without_grpc(session, items)
    if session.settings.reorder:
        reorder(items)
    session._queue = list(items)
    session._queue_index = {item.nodeid: i for i, item in enumerate(items)}
    if not is_xdist_worker(config):  # an xdist worker does not know which tests it will get
        last_users: dict[Any, str] = {}  # WorkerConfig -> node id
        for item in items:
            if CONFIG_KEY in item.stash:
                last_users[item.stash[CONFIG_KEY]] = item.nodeid
        session.last_users = set(last_users.values())


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


def skip_impossible(session: SglSession, items: list[pytest.Item]) -> None:
    """Skip, before anything launches, tests whose workers can never get a GPU lease here."""
    attached = session.settings.worker_urls  # never leased: no GPU needed here
    configs = {item.stash[CONFIG_KEY] for item in items
               if CONFIG_KEY in item.stash and item.stash[CONFIG_KEY].spec.name not in attached}
    if not configs:
        return
    try:
        manager = session.lease_manager()
    except (SglWorkerError, ValueError) as exc:  # ValueError: --sgl-gpus names GPUs that are not visible
        from ..errors import InventoryUnavailable

        if session.settings.cluster is not None and isinstance(exc, InventoryUnavailable):
            # no Ray, or an unreachable cluster: the run cannot mean what it says
            raise pytest.UsageError(f"{session.settings.sources.get('cluster', '--sgl-cluster')}: {exc}") from None

        reason = f"no GPU inventory: {exc}"
        inventory = isinstance(exc, InventoryUnavailable)
        if not inventory or (session.settings.gpus_explicit and is_xdist_worker(session.config)):
            # An unsafe or unusable lock directory is an error, never a skip (a green run would hide it); an
            # xdist worker cannot stop the session cleanly, so each worker test fails with the message.
            source = f"{session.settings.sources['gpus']}: " if inventory else ""
            for item in items:
                if item.stash.get(CONFIG_KEY, None) in configs:
                    item.stash[ITEM_ERROR_KEY] = f"{source}{exc}"
            return
        if session.settings.gpus_explicit:
            raise pytest.UsageError(f"{session.settings.sources['gpus']}: {exc}") from None
        for item in items:
            if item.stash.get(CONFIG_KEY, None) in configs:
                item.add_marker(pytest.mark.skip(reason=reason))
        return
    reasons = {}
    for c in configs:
        gpus = c.gpus_needed(session.choose_kind)
        why = manager.can_ever_fit(gpus, c.spec.memory_mib)
        if why and c.group is not None:
            why = f"the group {c.group.describe()} leases {gpus} GPU(s) at once: {why}"
        elif why and gpus != c.spec.tp:
            why = f"the worker leases {gpus} GPU(s) at once (tp x data-parallel replicas): {why}"
        reasons[c] = why
    for item in items:
        worker_config = item.stash.get(CONFIG_KEY, None)
        if worker_config is not None and reasons.get(worker_config):
            item.add_marker(pytest.mark.skip(reason=f"{worker_config.spec.name}: {reasons[worker_config]}"))


def skip_without_router(session: SglSession, items: list[pytest.Item]) -> None:
    """Skip, before their workers launch, the tests of ``sgl_router`` when the router is not installed."""
    users = [item for item in items if "sgl_router" in getattr(item, "fixturenames", ())]
    if not users:
        return
    from ..workers.router import RouterUnavailable, router_launcher

    try:
        router_launcher(session.settings)
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
        if worker_config is None or worker_config.spec.name in session.settings.worker_urls:
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


def poolable(item: pytest.Item) -> bool:
    """Whether a test's workers come from the pool (not ``fresh=True``, not its own launch options)."""
    try:
        worker = WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
        group = WorkersMarker.from_mark(item.get_closest_marker("sgl_workers"))
    except MarkerError:
        return False
    if "sgl_worker" in getattr(item, "fixturenames", ()):
        return not (worker.fresh or worker.startup_timeout is not None or worker.allow_foreign_host is not None)
    return not (group.fresh or group.startup_timeout is not None)


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
