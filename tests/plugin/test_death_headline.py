"""Which processes a failed test's report leads with (``plugin/deaths.py: dead_processes``), without a session: the
ones that died during the test (not stopped on purpose, not attached), the one the failed request went to first,
waited for within a deadline when the request met a closed connection. The mutation run's fast tests of the
failure headline (scripts/mutation.py, target ``headline``); the reports themselves are tested in
tests/plugin/test_death_reports.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest

from pytest_sglworker.plugin import deaths
from pytest_sglworker.plugin.deaths import _chain, _connection_port, dead_processes


@dataclass
class Fake:
    """A held process: dead once ``is_alive`` was asked ``dies_after`` times (0: dead already; None: never). Only an
    attached one has ``attached`` (as the plugin's processes: a worker or a router has none)."""

    port: int
    dies_after: int | None = None
    stopped: bool = False
    asked: int = field(default=0)

    def is_alive(self) -> bool:
        self.asked += 1
        return self.dies_after is None or self.asked <= self.dies_after


def request_error(port: int, kind: type[httpx.RequestError] = httpx.RemoteProtocolError) -> httpx.RequestError:
    return kind("Server disconnected", request=httpx.Request("POST", f"http://127.0.0.1:{port}/generate"))


def raised_from(exc: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise exc
        except BaseException as inner:
            raise outer from inner
    except BaseException as caught:
        return caught


def test_the_chain_is_newest_first_causes_before_contexts_and_ends_on_a_cycle() -> None:
    cause, context, top = ValueError("cause"), KeyError("context"), RuntimeError("top")
    top.__cause__, top.__context__ = cause, context
    assert _chain(top) == [top, cause]
    lone = RuntimeError("lone")
    lone.__context__ = context
    assert _chain(lone) == [lone, context]
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert _chain(a) == [a, b]


@pytest.mark.parametrize(("exc", "expected"), [
    (request_error(31234), (True, 31234)),
    (request_error(31234, httpx.ConnectError), (True, 31234)),
    (request_error(31234, httpx.ReadTimeout), (False, 31234)),  # slow, not closed
    (raised_from(request_error(31235), AssertionError("no answer")), (True, 31235)),
    (ConnectionRefusedError(), (True, None)),
    (raised_from(ConnectionResetError(), AssertionError("x")), (True, None)),
    (ValueError("unrelated"), (False, None)),
    (type("ConnectError", (Exception,), {})(), (False, None)),  # the name alone, not httpx's
])
def test_a_closed_connection_and_its_port(exc: BaseException, expected: tuple[bool, int | None]) -> None:
    assert _connection_port(exc) == expected


def test_the_port_comes_from_the_newest_exception_that_has_a_request() -> None:
    inner = request_error(31236)
    outer = raised_from(inner, ConnectionError("closed"))
    assert _connection_port(outer) == (True, 31236)
    assert _connection_port(raised_from(request_error(31237), request_error(31238))) == (True, 31238)


def test_only_the_processes_that_died_lead_not_the_stopped_nor_the_attached() -> None:
    alive, dead, stopped, attached = Fake(1), Fake(2, 0), Fake(3, 0, stopped=True), Fake(4, 0)
    attached.attached = True  # type: ignore[attr-defined]
    assert dead_processes([alive, dead, stopped, attached], None) == [dead]
    assert dead_processes([alive, stopped, attached], ValueError("x")) == []


def test_the_process_the_request_went_to_leads() -> None:
    first, second = Fake(1, 0), Fake(2, 0)
    assert dead_processes([first, second], request_error(2)) == [second, first]
    assert dead_processes([first, second], None) == [first, second]


def test_a_closed_connection_waits_for_the_process_it_went_to() -> None:
    target, other, stopped = Fake(7, dies_after=3), Fake(8, dies_after=1), Fake(7, dies_after=1, stopped=True)
    assert dead_processes([target, other, stopped], request_error(7)) == [target]
    assert other.asked == 1 and stopped.asked == 1  # neither is waited for: another port; stopped on purpose


def test_a_closed_connection_of_unknown_port_waits_for_every_held_process() -> None:
    one, two = Fake(7, dies_after=None), Fake(8, dies_after=2)
    assert dead_processes([one, two], ConnectionRefusedError()) == [two]


def test_no_wait_without_a_closed_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    never = Fake(7)
    assert dead_processes([never], None) == [] and never.asked == 1  # no exception: nothing waited for
    later = Fake(7, dies_after=1)
    assert dead_processes([later], ValueError("x")) == []
    assert dead_processes([later], None) == [later]  # asked once more: it had died meanwhile


def test_the_wait_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deaths, "CONNECTION_WAIT_SECONDS", 0.3)
    never = Fake(7)
    assert dead_processes([never], request_error(7)) == []
    assert never.asked > 2  # it was waited for
