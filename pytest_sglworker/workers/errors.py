"""The errors of a worker: it could not be launched, it exited or hung during startup, it died later. Each
holds what happened as fields (the worker, the event, the diagnosis of its log, the memory ledger, the argv, the
log path and its tail) and builds its text in ``__str__``. Plain Python, no pytest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SglWorkerError

if TYPE_CHECKING:
    from ..engine.diagnosis import Diagnosis
    from ..engine.ledger import MemoryLedger
    from ..engine.log_lines import LogMemory

#: later errors of the log named in a failure text (the rest are counted)
MAX_SECONDARY_SHOWN = 3

__all__ = ["LaunchCancelled", "LaunchError", "WorkerDied", "WorkerError", "WorkerStartupError",
           "WorkerStartupTimeout", "quoted_lines"]


def quoted_lines(diagnosis: Diagnosis | None) -> dict[str, str]:
    """The log lines a failure text with ``diagnosis`` quotes above its tail (see :class:`WorkerError`): the first
    error's lines and the later errors it shows as not the cause, to what each is quoted as, so that the tail marks
    them where they stand instead of repeating them."""
    if diagnosis is None:
        return {}
    quoted = {text: "not the cause" for text in diagnosis.secondary_text[:MAX_SECONDARY_SHOWN]}
    for line in diagnosis.first_error.splitlines():
        if not line.startswith("(chained from: "):
            quoted[line] = "the first error"
    return quoted


class WorkerError(SglWorkerError):
    """A worker failed. The fields say what happened; ``str(err)`` renders them as one failure text a person reads
    top to bottom, each fact once:

    1. the headline: which worker, the cause, then what happened (exit code or signal, when) and where: the cause
       comes early so that one-line places (pytest's short test summary cuts at the terminal's width) show it (a
       death, :class:`WorkerDied`, says first that it died and how, then why);
    2. the first error of its log with its line number, and the later errors that are not the cause;
    3. notes (``extra``) and the advice;
    4. for a memory failure, the memory ledger, and what the log says about its prediction;
    5. the argv and the log's path;
    6. the log's last lines, condensed (the plugin's own probes and progress bars collapsed, long lines cut, the
       first error's neighbourhood kept, setup lines folded, and the lines quoted under 1-2 marked, not repeated:
       :func:`quoted_lines`).

    :attr:`summary` is the headline, for one-line places (the run report, the timeline)."""

    def __init__(
        self,
        message: str = "",
        *,
        worker: str = "",
        where: str = "",
        event: str = "",
        diagnosis: Diagnosis | None = None,
        ledger: MemoryLedger | None = None,
        extra: str = "",
        argv: str = "",
        log_path: str | None = None,
        tail: str | None = None,
        tail_lines: int = 0,
        tail_notes: tuple[str, ...] = (),
        log_memory: LogMemory | None = None,
        advice: str | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message or f"{worker} {event}".strip())
        self.worker = worker
        #: where it ran (``127.0.0.1:20004, pid 42, GPUs 0``), at the end of the headline
        self.where = where
        self.event = event
        self.diagnosis = diagnosis
        self.ledger = ledger
        self.extra = extra
        self.argv = argv
        self.log_path = log_path
        self.tail = tail
        self.tail_lines = tail_lines
        #: what the tail's condensing did (``["38 health probe lines collapsed"]``)
        self.tail_notes = tail_notes
        #: the log's memory lines, read beside the ledger of a memory failure
        self.log_memory = log_memory
        #: the advice when it is not the diagnosis's own (a worker the test killed itself)
        self.advice_override = advice
        #: the cause when it is not the diagnosis's (a worker the test killed itself)
        self.cause_override = cause
        #: the process this error is about (set by its ``failure()``), so that a report shows its log once
        self.process: object | None = None

    @property
    def cause(self) -> str:
        """The cause for the headline: the diagnosis's summary, or, for a log with no error, how far it got."""
        if self.cause_override is not None:
            return self.cause_override
        if self.diagnosis is None:
            return ""
        if self.diagnosis.is_error:
            return self.diagnosis.summary
        return f"its log shows no error (it reached: {self.diagnosis.phase})" if self.diagnosis.phase else ""

    @property
    def summary(self) -> str:
        """The headline: which worker, the cause, what happened, where (``worker X: CAUSE — exited during startup
        with code 1 after 3.2 s (on 127.0.0.1:20000, pid 42, GPUs 0)``)."""
        if not self.worker:
            return str(self.args[0]).split("\n", 1)[0] if self.args else ""
        head = f"{self.worker}: {self.cause} — {self.event}" if self.cause else f"{self.worker} {self.event}"
        return f"{head.strip()} (on {self.where})" if self.where else head.strip()

    def _diagnosis_lines(self) -> list[str]:
        diagnosis = self.diagnosis
        if diagnosis is None or self.cause_override is not None:
            return []
        out = []
        if diagnosis.first_error:
            quoted = diagnosis.first_error.splitlines()
            where = f"log line {diagnosis.first_error_line}" if diagnosis.first_error_line is not None else "log"
            out.append(f"first error ({where}): {quoted[0]}")
            out.extend(f"    {line}" for line in quoted[1:])
        shown = diagnosis.secondary[:MAX_SECONDARY_SHOWN]
        out.extend(f"not the cause: {line}" for line in shown)
        if len(diagnosis.secondary) > len(shown):
            out.append(f"not the cause: … {len(diagnosis.secondary) - len(shown)} more later errors in the log")
        return out

    def _ledger_lines(self) -> list[str]:
        ledger = self.ledger
        if ledger is None:
            return []
        rendered = ledger.render().splitlines()
        out = [f"memory ledger (predicted for this GPU): {rendered[0]}"]
        if self.log_memory is not None:
            kv_pool = self.diagnosis is not None and self.diagnosis.kind.kv_pool
            out.append(f"  {ledger.against_log(self.log_memory, kv_pool=kv_pool)}")
        out.extend(line for line in rendered[1:] if not line.lstrip().startswith("verdict:"))
        if self.log_memory is None:
            out.extend(line for line in rendered[1:] if line.lstrip().startswith("verdict:"))
        return out

    @property
    def tail_text(self) -> str:
        """The log's last lines as the failure text shows them (its header line, then the lines indented); empty
        when the error carries no tail."""
        if self.tail is None:
            return ""
        notes = f" ({'; '.join(self.tail_notes)})" if self.tail_notes else ""
        lines = "\n".join("    " + line for line in self.tail.splitlines()) or "    <empty log>"
        return f"last lines of the log{notes}:\n{lines}"

    def render(self, *, tail: bool = True) -> str:
        """The failure text; ``tail=False``: all of it but the log's last lines (:attr:`tail_text`), for a report
        that puts something between the two (the exception a test met when its worker died)."""
        if not self.worker:
            return str(self.args[0]) if self.args else ""
        try:
            parts = [self.summary, *self._diagnosis_lines()]
        except Exception as exc:  # a diagnosis must never hide the log
            parts = [f"{self.worker} {self.event}", f"diagnosis unavailable: {exc!r}"]
        if self.extra:
            parts.append(self.extra)
        advice = self.advice_override if self.advice_override is not None else (
            self.diagnosis.advice if self.diagnosis is not None else "")
        if advice:
            parts.append(f"advice: {advice}")
        parts += self._ledger_lines()
        if self.argv:
            parts.append(f"argv: {self.argv}")
        if self.log_path:
            parts.append(f"log: {self.log_path}")
        if tail and self.tail is not None:
            parts.append(self.tail_text)
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.render()


class WorkerStartupError(WorkerError):
    """The worker process exited before it became healthy."""


class WorkerStartupTimeout(WorkerError):
    """The worker did not become healthy before the startup deadline."""


class WorkerDied(WorkerError):
    """A worker that had been healthy exited (during a test, or while pooled). Its headline says first that it died
    and how, then why (``worker X exited with code -9 (SIGKILL) during the test: CAUSE (on ...)``): a death during
    a test is pytest's crash line for it, which the short summary cuts at the terminal's width."""

    @property
    def summary(self) -> str:
        if not self.worker:
            return super().summary
        head = f"{self.worker} {self.event}: {self.cause}" if self.cause else f"{self.worker} {self.event}"
        return f"{head} (on {self.where})" if self.where else head


class LaunchError(WorkerError):
    """The worker could not be started at all (missing launcher, unwritable log dir, ...)."""


class LaunchCancelled(LaunchError):
    """A launch was abandoned because another member of its worker group failed."""
