"""A worker that dies under a test leads that test's report.

When a process the test holds (a worker, a member of its group, its router) dies during the test's call, what the
test met (``httpx.RemoteProtocolError: Server disconnected``, a ``ConnectError``, an assertion about an answer that
never came) is a consequence; the death is the news. :func:`lead_with_death` reshapes the call's report in pytest's
``pytest_runtest_makereport`` hook, with pytest's own report objects:

- the crash line (``report.longrepr.reprcrash.message``: what pytest's short summary, ``--tb=line`` and junitxml's
  ``message`` show) becomes the death's headline: which process, how it ended, why;
- the failure text starts with the death (headline, diagnosis, advice, argv, log path), then what the test met: its
  exception in the test's own frames (the client library's frames and its chained exceptions left out) or, when
  ``--tb`` was given or ``--full-trace``, pytest's rendering in that style (``--tb=line``: the crash line alone);
- the log's last lines follow in the report section of that process.

A request that failed because the connection closed may be seen a moment before the process is seen dead (the
kernel closes its sockets before its parent can reap it): :func:`dead_processes` waits, within a deadline, for the
process the request went to.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import pytest

__all__ = ["CONNECTION_WAIT_SECONDS", "dead_processes", "lead_with_death"]

#: how long a request that failed on a closed connection waits for the process it went to to be seen dead
CONNECTION_WAIT_SECONDS = 5.0
#: httpx's and httpcore's errors of a connection that closed or could not be made (matched by name: neither is
#: imported for this)
_CONNECTION_ERRORS = frozenset({"ConnectError", "ReadError", "WriteError", "CloseError", "RemoteProtocolError",
                                "NetworkError"})


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, newest first."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in out):
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _connection_port(exc: BaseException) -> tuple[bool, int | None]:
    """Whether ``exc`` is (or was raised from) a connection that closed or was refused, and the port of the
    request that met it when the client says (httpx's errors carry their request)."""
    chain = _chain(exc)
    closed = any(isinstance(e, ConnectionError) or (type(e).__module__.split(".")[0] in ("httpx", "httpcore")
                                                     and type(e).__name__ in _CONNECTION_ERRORS) for e in chain)
    port = None
    for e in chain:
        try:
            port = int(e.request.url.port)  # type: ignore[attr-defined]
            break
        except Exception:  # no request, or not one of httpx's
            continue
    return closed, port


def _died(process: Any) -> bool:
    return not getattr(process, "attached", False) and not process.is_alive() and not process.stopped


def dead_processes(processes: Sequence[Any], exc: BaseException | None) -> list[Any]:
    """The processes of ``processes`` that died during the test (not stopped on purpose), the one the failed
    request went to first. When none is dead yet and ``exc`` is a closed or refused connection, the process it went
    to (all of them, when the request's port is not known) is waited for, up to :data:`CONNECTION_WAIT_SECONDS`."""
    held = [p for p in processes if not getattr(p, "attached", False)]
    closed, port = _connection_port(exc) if exc is not None else (False, None)
    dead = [p for p in held if _died(p)]
    if not dead and closed:
        watched = [p for p in held if not p.stopped and (port is None or p.port == port)]
        deadline = time.monotonic() + CONNECTION_WAIT_SECONDS
        while watched and not dead and time.monotonic() < deadline:
            time.sleep(0.02)
            dead = [p for p in watched if _died(p)]
    return sorted(dead, key=lambda p: p.port != port)


@lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """Where code that is not the test suite's own lives: the standard library, installed packages, this
    plugin."""
    paths = {sysconfig.get_paths().get(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths if p and os.path.realpath(p) != os.sep)


def _own_frame(entry: Any) -> bool:
    path = str(entry.path)
    if path.startswith("<"):
        return False
    return not os.path.realpath(path).startswith(_library_roots())


def _test_repr(item: pytest.Item, excinfo: pytest.ExceptionInfo[BaseException]) -> Any:
    """The test's exception in its own frames, as pytest renders a failure (long, the middle frames short), without
    the reprs of its fixtures; None when none of its frames is the suite's own."""
    own = excinfo.traceback.filter(_own_frame)
    if not own:
        return None
    if len(own) > 2 and hasattr(own[0], "with_repr_style"):  # what pytest's "auto" style does (pytest >= 8)
        own = type(own)([own[0], *(entry.with_repr_style("short") for entry in own[1:-1]), own[-1]])
    info = pytest.ExceptionInfo.from_exc_info((excinfo.type, excinfo.value, excinfo.tb))
    info.traceback = own
    shown = info.getrepr(style="long", chain=False, tbfilter=False, funcargs=False,
                         showlocals=bool(item.config.getoption("showlocals", False)))
    return shown


def _prepend(longrepr: Any, text: str, note: str) -> bool:
    """Put ``text`` and then ``note`` before what ``longrepr`` (pytest's exception repr) shows: a first element
    of its chain with no frame, only ``text`` as its closing line (pytest's chain prints each element's description
    after it); for a native traceback (``--tb=native``), lines before its own."""
    chain = getattr(longrepr, "chain", None)
    if chain:
        try:
            head = dataclasses.replace(chain[0][0], reprentries=[], extraline=text)
        except TypeError:  # not a plain traceback repr (a native one): its lines take it below
            pass
        else:
            longrepr.chain = [(head, None, note), *chain]
            return True
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", None)
    if entries and getattr(entries[0], "style", None) == "native" and hasattr(entries[0], "lines"):
        entries[0].lines = [f"{text}\n\n{note}\n", *entries[0].lines]
        return True
    return False


def lead_with_death(item: pytest.Item, report: pytest.TestReport, excinfo: pytest.ExceptionInfo[BaseException],
                    death: Any) -> bool:
    """Make ``death`` (the :class:`~pytest_sglworker.workers.errors.WorkerDied` of a process that died during the
    test) lead the call's failed ``report``: its headline as pytest's crash line, its text before what the test met
    (see the module's docstring). Its log's last lines are the caller's to add. Whether the report's text now leads
    with it (not under ``--tb=line``, where only the crash line does)."""
    config = item.config
    longrepr: Any = report.longrepr
    note = "what the test met:"
    style = config.getoption("tbstyle", "auto")
    if style == "line":  # one line a failure: the crash line is the death's headline, its text a section
        _crash_line(longrepr, death)
        return False
    if style == "auto" and not config.getoption("fulltrace", False):
        shown = _test_repr(item, excinfo)
        if shown is not None:
            longrepr = shown
            note = "what the test met, in its own frames (--tb=long shows the libraries' frames too):"
    if not _prepend(longrepr, death.render(tail=False), note):
        _crash_line(report.longrepr, death)
        return False
    _crash_line(longrepr, death)
    report.longrepr = longrepr
    return True


def _crash_line(longrepr: Any, death: Any) -> None:
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        crash.message = death.summary
