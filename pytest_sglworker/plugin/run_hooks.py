"""The per-test hooks: a test's worker failure sections, its launch ahead, its time for the run report.

:class:`RunHooks` is registered (:func:`enable_run_hooks`) only in runs that use the plugin's fixtures or write a
run report, so that a run that never asks for a worker pays no hook call per test.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from ..resources.processes import signal_name
from ..workers.sources.base import SignalSent
from .deaths import dead_processes, lead_with_death
from .keys import (
    CONFIG_KEY,
    ITEM_ERROR_KEY,
    NEXT_KEY,
    REPORTS_KEY,
    SHOWN_KEY,
    SIGNALS_KEY,
    WORKERS_KEY,
    is_xdist_worker,
)

if TYPE_CHECKING:
    from ..workers.errors import WorkerDied
    from ..workers.launcher import ModelInstance
    from .session import SglSession

__all__ = ["RUN_HOOKS_NAME", "RunHooks", "enable_run_hooks", "worker_section"]

RUN_HOOKS_NAME = "sglworker-run"


def enable_run_hooks(session: SglSession) -> None:
    """Register the per-test hooks (:class:`RunHooks`) once."""
    manager = session.config.pluginmanager
    if manager.get_plugin(RUN_HOOKS_NAME) is None:
        manager.register(RunHooks(session), RUN_HOOKS_NAME)


@contextlib.contextmanager
def observe_signals(sent: list[Any]) -> Iterator[None]:
    """While the test's call runs: every ``os.kill``/``os.killpg`` the test makes on pytest's main thread is
    recorded in ``sent`` (a :class:`SignalSent` each) and then made as asked, so that a worker the test killed
    itself is not reported as a death of its own. Calls from other threads are not recorded. Someone else's
    replacement of ``os.kill`` made during the call is left in place."""
    real_kill, real_killpg = os.kill, os.killpg
    main = threading.main_thread()
    active = [True]

    def recording(real: Callable[[int, int], None], group: bool) -> Callable[[int, int], None]:
        def call(pid: int, sig: int) -> None:
            if active[0] and threading.current_thread() is main:
                sent.append(SignalSent(int(pid), int(sig), group))
            real(pid, sig)
        return call

    kill, killpg = recording(real_kill, False), recording(real_killpg, True)
    os.kill, os.killpg = kill, killpg
    try:
        yield
    finally:
        active[0] = False  # inert from now on, even where a test's own patch put it back
        if os.kill is kill:
            os.kill = real_kill
        if os.killpg is killpg:
            os.killpg = real_killpg


def _title(instance: ModelInstance) -> str:
    role = "" if instance.role == "worker" else f" {instance.role}"
    return f"sglang worker {instance.spec.name}{role} {instance.host}:{instance.port}"


def worker_section(instance: ModelInstance, tail: int) -> tuple[str, str]:
    """The report section a failed test gets for each worker it used: its log path and its condensed tail, or,
    for a worker that died during the test, its whole failure text (diagnosis included)."""
    title = _title(instance)
    if getattr(instance, "attached", False):
        state = "answers its health check" if instance.responds() else "does NOT answer its health check"
        return f"{title} (attached)", f"{instance.describe()} {state} now\n{instance.log_tail(tail)}"
    if instance.is_alive() or instance.stopped:
        condensed = instance.condensed_tail(tail)
        notes = f" ({'; '.join(condensed.notes)})" if condensed.notes else ""
        return title, f"log: {instance.log_path}\nlast lines of the log{notes}:\n{condensed.text}"
    return f"{title} exited with {signal_name(instance.returncode)} during the test", str(instance.death(lines=tail))


class RunHooks:
    """The per-test hooks: a test's worker failure sections, its launch ahead, its time for the run report.
    Registered (:meth:`SglSession.enable_run_hooks`) only in runs that use the plugin's fixtures or write a run
    report, so that a run that never asks for a worker pays no hook call per test."""

    def __init__(self, session: SglSession) -> None:
        self.session = session

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        item.stash[NEXT_KEY] = nextitem

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        """With this test's own workers in place (after its setup), start the next configurations ahead."""
        self.session.launch_ahead(item)

    @pytest.hookimpl(wrapper=True, specname="pytest_runtest_call")
    def pytest_runtest_call_signals(self, item: pytest.Item) -> Generator[None, None, None]:
        """The signals the test sends during its call, for its workers' give-back (:func:`observe_signals`)."""
        with observe_signals(item.stash.setdefault(SIGNALS_KEY, [])):
            return (yield)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """After this test's fixtures are torn down its workers are pooled again, or retired when it was the
        last test of their configuration: a GPU may just have come free. Seen from the next test, whose
        configuration comes first (it is about to be needed), then the ones after it."""
        if nextitem is not None:
            self.session.launch_ahead(item, nextitem=nextitem)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        error = item.stash.get(ITEM_ERROR_KEY, None)
        if error is not None:
            pytest.fail(error, pytrace=False)

    @pytest.hookimpl(wrapper=True, specname="pytest_runtest_setup")
    def pytest_runtest_setup_tracked(self, item: pytest.Item) -> Generator[None, None, None]:
        """Which test's fixtures are being set up: its own launch starts the launches ahead."""
        self.session.let_go_dropped()
        self.session.setting_up = item
        try:
            return (yield)
        finally:
            self.session.setting_up = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        item.stash.setdefault(REPORTS_KEY, {})[report.when] = report
        if CONFIG_KEY in item.stash:  # carried to the xdist controller with the report
            report.sglworker_config = item.stash[CONFIG_KEY].key  # type: ignore[attr-defined]
        workers = item.stash.get(WORKERS_KEY, None)
        if workers and report.failed:
            junit = bool(getattr(self.session.config.option, "xmlpath", None))
            shown = item.stash.get(SHOWN_KEY, set())
            led = self._lead_with_death(item, report, call, workers)
            led_process: Any = led.process if led is not None else None
            for instance in workers:
                # Nothing twice: a process whose failure text this report shows gets no section (the one whose
                # death leads it gets its log's tail only); after a failure of the plugin's own (setup, teardown),
                # or one a death leads, only a process that died on its own adds what the reader needs.
                died = not instance.is_alive() and not instance.stopped
                if id(instance) in shown or (((shown and report.when != "call") or led is not None) and not died):
                    continue
                if led is not None and instance is led_process:  # its death leads the report: its tail here
                    title = f"{_title(instance)} exited with {signal_name(instance.returncode)} during the test"
                    body = led.tail_text or f"log: {instance.log_path} (empty)"
                else:
                    title, body = worker_section(instance, self.session.settings.tail_lines)
                report.sections.append((title, body))
                # CI systems read junitxml, which takes properties and captured output from the teardown report:
                # the log path as a property, the tail in the test's system-err (not shown twice in the terminal)
                prop = (f"sglworker_log_{instance.role}_{instance.port}", str(instance.log_path))
                if instance.log_path is not None and prop not in item.user_properties:
                    item.user_properties.append(prop)
                if junit:
                    item.add_report_section(report.when, "stderr", f"{title}\n{body}\n")
        return report

    def _lead_with_death(self, item: pytest.Item, report: pytest.TestReport, call: pytest.CallInfo[None],
                         workers: list[Any]) -> WorkerDied | None:
        """A process the test holds that died during its call leads the call's report (:mod:`.deaths`): the
        death it leads with, or None."""
        if report.when != "call" or call.excinfo is None:
            return None
        dead = dead_processes(workers, call.excinfo.value)
        if not dead:
            return None
        death = dead[0].death(item.stash.get(SIGNALS_KEY, ()), lines=self.session.settings.tail_lines)
        return death if lead_with_death(item, report, call.excinfo, death) else None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Each test's time (setup, which includes waiting for its workers, call and teardown), its worker
        configuration and the category pytest's terminal summary counts each of its phases in, for the run report
        (the times are what --sgl-shard-report balances shards by). Lines that launch threads queued for the
        terminal are written here too."""
        self.session.terminal.flush()
        config = self.session.config
        if is_xdist_worker(config):
            return
        entry = self.session.test_times.setdefault(report.nodeid, [0.0, None, []])
        entry[0] += report.duration
        entry[1] = entry[1] or getattr(report, "sglworker_config", None)
        status = config.hook.pytest_report_teststatus(report=report, config=config)
        if status and status[0]:  # "" for a passing setup or teardown: pytest counts none
            entry[2].append(str(status[0]))
