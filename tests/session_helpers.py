"""An inner ``python -m pytest`` as a process the tests can send signals to (shared by the fault and stress tiers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest


def _default_sigint() -> None:
    # A background job of a non-interactive shell starts with SIGINT ignored, and a suite run under ``nohup`` with
    # SIGHUP ignored; a child inherits both, and the plugin (rightly) leaves an ignored signal ignored. The inner
    # session stands for a pytest run the usual way: every signal these tests send starts at its default.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _own_group() -> None:
    _default_sigint()
    os.setpgid(0, 0)


class Session:
    """``python -m pytest`` in the pytester directory, as a process we can send signals to."""

    def __init__(self, pytester: pytest.Pytester, *args: str, process_group: bool = False) -> None:
        """``process_group``: the session leads a process group of its own (its xdist workers join it), so that a
        signal can reach the whole group, as a terminal's Ctrl-C does."""
        self.out = pytester.path / f"session-{time.monotonic_ns()}.out"
        with open(self.out, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", *args], cwd=pytester.path, stdin=subprocess.DEVNULL,
                stdout=fh, stderr=subprocess.STDOUT, preexec_fn=_own_group if process_group else _default_sigint,
            )

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the session did not end within {timeout:g} s:\n{self.output()}") from None

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_Shared = TypeVar("_Shared")


def shared_run(request: pytest.FixtureRequest, key: pytest.StashKey[Any],
               run: Callable[[Callable[[str], Any]], _Shared]) -> _Shared:
    """What ``run(getfixturevalue)`` returns, made once per test session (in ``request.config.stash`` under ``key``)
    for every test of a module that reads one shared inner session. A run that raised is cached too, so the other
    tests fail with its error instead of running it again."""
    cached = request.config.stash.get(key, None)
    if cached is None:
        try:
            cached = run(request.getfixturevalue)
        except Exception as exc:
            cached = exc
        request.config.stash[key] = cached
    if isinstance(cached, Exception):
        pytest.fail(f"the shared inner session could not run: {cached!r}")
    return cast(_Shared, cached)
