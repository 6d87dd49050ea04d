"""The plugin's pytest-xdist hooks, registered only in a run that xdist distributes (its controller and its
workers). It marks tests with ``xdist_group`` for ``--dist loadgroup``, sends the controller's log directory and
status-line relay to the xdist workers, merges their report figures, and plugs in the scheduler of
:mod:`.xdist_scheduling` (imported only when xdist distributes tests: it is a large module).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from ..errors import BudgetViolation
from .keys import WORKER_FIXTURES, distributing, is_xdist_worker, item_spec
from .markers import MarkerError
from .terminal import ProgressRelay

if TYPE_CHECKING:
    from .session import SglSession

WORKER_FIXTURE_SET = frozenset(WORKER_FIXTURES)


class XdistHooks:
    """Registered only in a run that xdist distributes."""

    def __init__(self, session: SglSession) -> None:
        self.session = session
        self.relay: Any = None
        self.ray_hosts: Any = None  # ray_hosts.ControllerHosts: the hosts started ahead for the workers

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> Generator[None, None, None]:
        # Under --dist loadgroup, xdist's worker appends the xdist_group name to each node id in its own
        # pytest_collection_modifyitems, which pluggy calls before the plugin's (xdist registers it later):
        # the group marks must be in place first. The main hook reports marker errors.
        for item in items:
            fixturenames = getattr(item, "fixturenames", ())
            if WORKER_FIXTURE_SET.isdisjoint(fixturenames):
                continue
            fixture = next(f for f in WORKER_FIXTURES if f in fixturenames)
            spec = item_spec(item)
            if spec is None or item.get_closest_marker("xdist_group") is not None:
                continue
            try:
                key = self.session.resolve_config(item, spec, fixture).key
            except (MarkerError, BudgetViolation, ValueError):
                continue
            item.add_marker(pytest.mark.xdist_group(name=f"sgl-{key}"))
        result = yield
        if not is_xdist_worker(config):
            return result  # only an xdist worker appends the group to the node ids
        # pytest >= 9.2 derives the node id from the structured item._id, while xdist <= 3.8 still writes the
        # suffixed id to the legacy item._nodeid: the @group suffix is lost and loadgroup silently stops
        # grouping (pytest-dev/pytest-xdist#1386). Carry it over; a no-op once xdist sets the id itself.
        # This is the plugin's one use of pytest internals, guarded so that another pytest cannot break a run.
        for item in items:
            legacy = getattr(item, "_nodeid", None)
            if isinstance(legacy, str) and legacy.startswith(item.nodeid + "@") and hasattr(item, "_id"):
                try:
                    from _pytest.nodeid import NodeId

                    item._id = NodeId.parse(legacy)
                except Exception:  # a workaround must never fail a run
                    break
        return result

    def pytest_configure_node(self, node: Any) -> None:
        """The xdist workers log into the controller's session directory, and send their status lines to the
        controller (a file it follows) so that a long startup on an xdist worker shows in the terminal."""
        node.workerinput["sglworker_log_dir"] = str(self.session.log_dir)
        if self.relay is None:
            self.relay = ProgressRelay(self.session.terminal, self.session.log_dir / f".progress-{os.getpid()}.jsonl")
        node.workerinput["sglworker_progress"] = str(self.relay.path)
        self._ray_host_ahead(node)

    def _ray_host_ahead(self, node: Any) -> None:
        """With a Ray cluster (not through Ray Client), a host started ahead for the worker on this node, so that
        its first launch finds it started (``ray_hosts.ControllerHosts``)."""
        cluster = self.session.settings.cluster
        if cluster is None or cluster.address.startswith("ray://"):
            return
        from ..resources.processes import SESSION_ID
        from ..workers.sources.ray import forwarded_env
        from ..workers.sources.ray_connect import CONNECT_TIMEOUT, cluster_address, ray_auth
        from ..workers.sources.ray_hosts import ControllerHosts

        if self.ray_hosts is None:
            self.ray_hosts = ControllerHosts(cluster, address=cluster_address(cluster), actor_env=forwarded_env(),
                                             session=SESSION_ID, timeout=CONNECT_TIMEOUT, auth=ray_auth())
        self.ray_hosts.add(str(node.workerinput["workerid"]))
        node.workerinput["sglworker_ray_ahead"] = SESSION_ID

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if distributing(session.config):
            from . import xdist_scheduling

            xdist_scheduling.save_history(self.session)
            xdist_scheduling.end_run_groups(self.session)
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        self._close_ray_hosts()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._close_ray_hosts()  # an interrupted start skips pytest_sessionfinish
        if distributing(config):
            from . import xdist_scheduling

            xdist_scheduling.end_run_groups(self.session)

    def _close_ray_hosts(self) -> None:
        hosts, self.ray_hosts = self.ray_hosts, None
        if hosts is not None:
            hosts.close()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """On the controller, every report from a worker: the status lines the relay thread queued are written."""
        if self.relay is not None:
            self.session.terminal.flush()

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", {})
        if output.get("sglworker_stats"):
            self.session.worker_stats.append(output["sglworker_stats"])
        if output.get("sglworker_launches"):
            self.session.worker_launches.append(output["sglworker_launches"])
        if output.get("sglworker_warm"):
            self.session.worker_warm.append(output["sglworker_warm"])

    # -- scheduling by worker configuration (--sgl-dist, xdist_scheduling.py) ------------------------------
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        from . import xdist_scheduling

        return xdist_scheduling.make_scheduler(self.session, config, log)

    @pytest.hookimpl(specname="pytest_configure_node")
    def pytest_configure_node_scheduling(self, node: Any) -> None:
        """The xdist workers write which configuration each test needs where the scheduler reads it."""
        from . import xdist_scheduling

        xdist_scheduling.configure_node(self.session, node)

    @pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collection to the controller
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if is_xdist_worker(session.config):
            from . import xdist_scheduling

            xdist_scheduling.write_collection_map(self.session, session.items)

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        if not distributing(config):
            return None
        from . import xdist_scheduling

        return xdist_scheduling.header_line(self.session)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not distributing(terminalreporter.config):
            return  # no scheduler of ours ran
        from . import xdist_scheduling

        line = xdist_scheduling.summary_line(self.session)
        if line is not None and terminalreporter.config.get_verbosity() >= -1:
            terminalreporter.write_line(line)
