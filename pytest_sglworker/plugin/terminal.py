"""What the plugin writes to the terminal while a run goes on: ``[sglworker] ...`` message lines, and the live status
line of a worker that takes a while to start (in place on a terminal, a line now and then elsewhere, and, from an
xdist worker, through a file the controller follows: :class:`ProgressRelay`).

Every line goes through one :class:`Terminal` per pytest process. Only pytest's main thread touches pytest's
objects (the terminal reporter, the capture manager, the config): a line from another thread (a launch ahead, a
group member starting, the relay) is queued, and the main thread writes it at its next chance (:meth:`Terminal.flush`:
before its own next line, while it waits for launch threads, after every test phase). An xdist worker's status
lines go to the relay file, a plain append that any thread may make; its message lines go to its standard error,
which xdist leaves shared with the controller's (its terminal reporter writes nowhere), at once, naming the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..resources.shown import shown
from .keys import xdist_worker_id

if TYPE_CHECKING:
    from ..workers.launcher import ModelInstance

__all__ = ["PLAIN_INTERVAL_SECONDS", "STATUS_AFTER_SECONDS", "ProgressRelay", "Terminal", "status_text"]

#: A worker that is healthy sooner than this shows no status line at all.
STATUS_AFTER_SECONDS = 2.0
#: Off a terminal (and for xdist workers' progress) a status line is repeated at most this often.
PLAIN_INTERVAL_SECONDS = 30.0


def status_text(instance: ModelInstance, elapsed: float) -> str:
    """``[sglworker] 12 s loading weights: worker qwen3-0.6b on 127.0.0.1:20004 (pid 42, GPUs 0)``: the phase
    and the time first, where a narrow terminal still shows them."""
    from ..engine.log_lines import startup_phase_from_file

    phase = startup_phase_from_file(instance.log_path) or "starting"
    return f"[sglworker] {elapsed:.0f} s {phase}: {instance.describe()}"


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Terminal:
    """The plugin's lines on this process's terminal, and the record of every message of the session."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        #: every message of the session, in order (the run's record, written or not); appended under the lock
        self.messages: list[str] = []
        #: guards ``messages``, ``_pending`` and the status-line state
        self._lock = threading.Lock()
        #: lines other threads handed over, written by the main thread: ("message", text, always),
        #: ("status", key, text) or ("relayed", key, text)
        self._pending: list[tuple[str, str, Any]] = []
        self._last_plain_line: dict[str, float] = {}
        self._status_shown = False
        # Read once, here on the main thread: the threads that write status lines never read the config.
        self._relay = _relay_path(config)
        self._xdist_worker = xdist_worker_id(config)
        self._worker = self._xdist_worker or "?"

    def flush(self) -> None:
        """Write what other threads queued (on the main thread; elsewhere it does nothing)."""
        if not _on_main_thread():
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for kind, first, second in pending:
            if kind == "message":
                self._write_message(first, always=bool(second))
            elif kind == "status":
                self._show(first, second)
            else:
                self._write_relayed(first, second)

    def note(self, text: str) -> None:
        """Keep ``text`` in the session's record without writing it (from any thread)."""
        with self._lock:
            self.messages.append(text)

    def _reporter(self) -> Any:
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def _uncaptured(self) -> contextlib.AbstractContextManager[object]:
        """Write to the real terminal even while a test's output is captured (as live logging does)."""
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        return capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()

    def message(self, text: str, *, always: bool = False) -> None:
        """A ``[sglworker] ...`` line, kept for the session's record too. ``always``: a ``sglworker: ...`` line
        that shows whatever the verbosity (the report's path). From another thread it is queued for the main
        thread."""
        self.note(text)
        if not _on_main_thread():
            with self._lock:
                self._pending.append(("message", text, always))
            return
        self.flush()
        self._write_message(text, always=always)

    def _write_message(self, text: str, *, always: bool) -> None:
        if self.config.get_verbosity() < 0 and not always:
            return
        text = "\n".join(map(shown, text.split("\n")))  # names read from the lock directory: no escapes
        if self._xdist_worker is not None:
            self._write_from_xdist_worker(text, always=always)
            return
        tr = self._reporter()
        if tr is None:
            return
        with self._uncaptured():
            self._clear(tr)
            tr.ensure_newline()
            tr.write_line(f"sglworker: {text}" if always else f"[sglworker] {text}", red=text.startswith("ERROR"))

    def _write_from_xdist_worker(self, text: str, *, always: bool) -> None:
        """An xdist worker's terminal reporter writes nowhere (xdist points the worker's stdout at the null
        device): its lines go to its standard error, which it shares with the controller's, at once, so that a
        wait in a test's setup (for a GPU lease, for a port another process holds) is said while it lasts, not
        after. The worker's id leads the line; a new line first, as the controller may be in the middle of one."""
        line = f"sglworker: [{self._xdist_worker}] {text}" if always else f"[sglworker] [{self._xdist_worker}] {text}"
        with self._uncaptured():
            sys.stderr.write(f"\n{line}\n")
            sys.stderr.flush()

    def progress(self, instance: ModelInstance, elapsed: float) -> None:
        """The live status line of a worker that takes a while to start. It never fails a launch."""
        if elapsed < STATUS_AFTER_SECONDS:
            return
        try:
            text = status_text(instance, elapsed)
            if self._relay is not None:
                _append(self._relay, {"worker": self._worker, "key": str(instance.port), "text": text})
                return
            if not _on_main_thread():
                with self._lock:  # the latest status of each worker, written by the main thread
                    self._pending = [p for p in self._pending if p[:2] != ("status", str(instance.port))]
                    self._pending.append(("status", str(instance.port), text))
                return
            self.flush()
            self._show(str(instance.port), text)
        except Exception as exc:  # a status line must never fail a launch
            self.note(f"status line failed: {exc!r}")

    def progress_end(self) -> None:
        """The wait is over: clear the status line before pytest writes the test's outcome (main thread)."""
        try:
            if self._relay is not None:
                _append(self._relay, {"worker": self._worker, "done": True})
                return
            if not _on_main_thread():
                return
            self.flush()
            tr = self._reporter()
            if tr is not None:
                with self._uncaptured():
                    self._clear(tr)
        except Exception as exc:
            self.note(f"status line failed: {exc!r}")

    def relayed(self, key: str, text: str) -> None:
        """A status line an xdist worker relayed (:class:`ProgressRelay`, on its own thread): queued, and written by
        the main thread as a plain line, at most every few seconds per worker and port."""
        with self._lock:
            self._pending.append(("relayed", key, text))

    def _write_relayed(self, key: str, text: str) -> None:
        tr = self._reporter()
        if tr is None or self.config.get_verbosity() < 0:
            return
        if time.monotonic() - self._last_plain_line.get(key, 0.0) >= PLAIN_INTERVAL_SECONDS / 6:
            self._last_plain_line[key] = time.monotonic()
            tr.ensure_newline()
            tr.write_line(text)

    def _width(self, tr: Any) -> int:
        return max(20, int(getattr(getattr(tr, "_tw", None), "fullwidth", 80)) - 1)

    def _clear(self, tr: Any) -> None:
        if self._status_shown:
            tr.write("\r" + " " * self._width(tr) + "\r")
            self._status_shown = False

    def _show(self, key: str, text: str) -> None:
        tr = self._reporter()
        if tr is None or self.config.get_verbosity() < 0:
            return
        with self._uncaptured():
            if getattr(tr, "isatty", False):
                width = self._width(tr)
                tr.write("\r" + (text if len(text) <= width else text[: width - 1] + "…").ljust(width))
                self._status_shown = True
            elif time.monotonic() - self._last_plain_line.get(key, 0.0) >= PLAIN_INTERVAL_SECONDS:
                self._last_plain_line[key] = time.monotonic()
                tr.ensure_newline()
                tr.write_line(text)


# -- xdist: the workers' status lines, shown by the controller -------------------------------------------

def _relay_path(config: pytest.Config) -> Path | None:
    workerinput = getattr(config, "workerinput", None)
    path = workerinput.get("sglworker_progress") if isinstance(workerinput, dict) else None
    return Path(path) if path else None


def _append(path: Path, entry: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


class ProgressRelay:
    """On the xdist controller: follows the file the workers append their status lines to (thread
    ``sglworker-progress``: it reads that file and hands each line to :meth:`Terminal.relayed`, nothing else), and
    the controller's main thread shows each worker's latest (``[gw1] ...``) at its next event, at most every few
    seconds per worker."""

    def __init__(self, terminal: Terminal, path: Path) -> None:
        self.terminal = terminal
        self.path = path
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sglworker-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        offset = 0
        while not self.stop.wait(0.5):
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            offset += end
            for line in data[:end].splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("done") or "text" not in entry:
                    continue
                text = entry["text"].replace("[sglworker] ", f"[sglworker] [{entry.get('worker')}] ", 1)
                self.terminal.relayed(f"{entry.get('worker')}:{entry.get('key')}", text)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        with contextlib.suppress(OSError):
            self.path.unlink()
