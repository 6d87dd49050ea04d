"""First-error classification of an sglang worker log.

Plain Python, stdlib only: no pytest here.

:func:`diagnose` reads a worker's log (and optionally its exit code) and says what went wrong *first*. That matters
because an sglang startup failure usually prints several errors, and the last one is often a symptom. The canonical
case: with the default ``--mem-fraction-static`` the breakable prefill CUDA graph runs out of memory in
``capture_end()``; PyTorch's ``__exit__`` then ends the same capture again and raises ``num_active_captures_ > 0
INTERNAL ASSERT FAILED ... markCaptureEnd called with no captures in progress``. sglang's breakable-graph context logs
the exception that reaches it (that *second* one) with ``logger.error`` before re-raising (`breakable_cuda_graph/
context.py <https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/model_executor/runner_backend_utils/
breakable_cuda_graph/context.py>`_), and only then does the scheduler print the chained traceback (OOM first, then
"During handling of the above exception ..."), so the assertion can be the first error line in the file. It is never
the cause: :func:`diagnose` always labels it secondary.

What each kind looks like and what to say about it lives in one record per kind, :class:`Rule`, in
:mod:`.diagnosis_rules` (``RULES``); ``kind.fatal`` and ``kind.memory`` come from there. This module
is the scanner: it splits the log into errors (tracebacks, chained tracebacks, error-looking lines), tracks the
startup state (weight loading, graph captures and their progress bars, shutdown), asks the records, and picks the
first cause. Its cheap pre-filter is derived from the records' own patterns.

**Adding a rule** takes three things: a :class:`Rule` in ``RULES`` (a new :class:`Kind` member if the kind is new:
its patterns, summary, advice, ``fatal``, ``memory``), a log fixture ``tests/data/logs/<name>.log`` showing it (a real
one from sglang's issue tracker when there is one, with its link in a ``# `` header), and its line in ``CASES`` of
``tests/engine/test_diagnosis.py``.

How far a starting worker got and what its memory lines say are :mod:`.log_lines`.

Why one module of this size: the scanner is one state machine over the log (tracebacks, chained tracebacks, per-
rank prefixes, continuation lines, the capture in progress, choosing the cause) whose states the classification
reads; what the kinds *are* lives in :mod:`.diagnosis_rules`, one record each.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .diagnosis_rules import (
    CAPTURE_FRAMES,
    FATAL_KINDS,
    MEMORY_KINDS,
    Facts,
    Kind,
    Rule,
    Scene,
    active_rules,
    prefilter,
    rule_for,
    signal_advice,
    signal_name,
)
from .log_lines import LOAD_BEGIN, LOAD_END, startup_phase

__all__ = [
    "FATAL_KINDS",
    "MEMORY_KINDS",
    "Diagnosis",
    "Kind",
    "Rule",
    "diagnose",
    "looks_like_error",
]

#: How many lines of an error :attr:`Diagnosis.first_error` quotes, and how long a quoted line may be.
MAX_QUOTED_LINES = 5
MAX_LINE_CHARS = 400
#: How many secondary errors :attr:`Diagnosis.secondary` keeps.
MAX_SECONDARY = 6


@dataclass(frozen=True)
class Diagnosis:
    """The first error of a worker log, classified.

    ``first_error`` quotes the error (up to :data:`MAX_QUOTED_LINES` lines), ``first_error_line`` is its 1-based line
    number in the log (``None`` when the log shows no error). ``secondary`` lists later errors and symptoms, each as
    ``"log line N: text (why it is not the cause)"``.
    """

    kind: Kind
    summary: str
    advice: str = ""
    first_error: str = ""
    first_error_line: int | None = None
    secondary: tuple[str, ...] = ()
    returncode: int | None = None
    phase: str | None = None
    #: the text each entry of ``secondary`` quotes (as clipped there), in the same order
    secondary_text: tuple[str, ...] = ()

    @property
    def is_error(self) -> bool:
        """True unless the log and the exit code show nothing wrong."""
        return self.kind is not Kind.NONE

    @property
    def fatal(self) -> bool:
        """sglang may stay alive after this error without ever serving (``kind.fatal``)."""
        return self.kind.fatal

    @property
    def memory_related(self) -> bool:
        """A memory failure: the memory ledger belongs beside it (``kind.memory``)."""
        return self.kind.memory

    def render(self) -> str:
        """Lines for a failure message: the diagnosis, the first error, what is not the cause, advice."""
        out = [f"diagnosis: {self.summary}"]
        if self.first_error:
            quoted = self.first_error.splitlines()
            where = f"log line {self.first_error_line}" if self.first_error_line is not None else "log"
            out.append(f"first error ({where}): {quoted[0]}")
            out.extend(f"    {line}" for line in quoted[1:])
        if self.secondary:
            out.append(f"secondary (not the cause): {self.secondary[0]}")
            out.extend(f"    {line}" for line in self.secondary[1:])
        if self.advice:
            out.append(f"advice: {self.advice}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


# ---------------------------------------------------------------------------------------------- structure

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# "[2026-12-02 10:00:00] msg", "[2026-12-02 10:00:00 TP0] msg", "[2026-12-02 10:00:00 DP0 TP1 EP1] msg",
# "[2026-12-02 10:00:00.123 TP0] msg", and a bare "[TP0] msg".
_PREFIX = re.compile(
    r"^\[(?:\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?: [A-Z_]+\d+)*|[A-Z_]+\d+(?: [A-Z_]+\d+)*)\] ?"
)
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = ('  File "', '\tFile "')
_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)

# Lines that look like errors and are not: import fallbacks, Python warnings, c10 warnings ("[W ..." and
# "[rank0]:[W1202 ...") such as ProcessGroupNCCL's "destroy_process_group() was not called" at exit, and the
# engine's own port fallback.
_NOISE = re.compile(
    r"Ignore import error when loading sglang\.srt\.models\."
    r"|^\S*:\d+: \w*Warning: "
    r"|^\w*Warning: "
    r"|^(?:\[rank\d+\]:)?\[W[\d ]"
    r"|is already in use, trying port"
    r"|Waiting for \d+ seconds for \w+ to be available"
)
_EXCEPTION_START = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit)\b(?::|$)")
# The server tearing down after a failure. sglang < 0.4.3 wrote "child proces." (one s;
# https://github.com/sgl-project/sglang/issues/3456).
_SYMPTOM = re.compile(
    r"Received sigquit from a child proces|SIGQUIT received|Initialization failed\.|Triggering SIGQUIT"
)
_SHUTDOWN = re.compile(r"SIGTERM received|Gracefully exiting")
_TERMINATE = re.compile(r"^(?:terminate called after throwing|Fatal Python error:|Segmentation fault)")

_CAPTURE = re.compile(r"Capture (?P<what>.*?)\s*(?:CUDA|cuda|CPU|NPU|XPU|MUSA) graph (?P<edge>begin|end)\b")
# tqdm bars of a capture in progress: "Capturing prefill shape (num_tokens=704 avail_mem=..)" (prefill, 0.5.23),
# "Capturing num tokens (num_tokens=3968 ..)" (piecewise prefill, 0.5.x), "Capturing batches (bs=256 ..)" (decode)
# and, before 0.4.8, "Capturing batches (avail_mem=2.85 GB)" without the size.
_TQDM = re.compile(
    r"Capturing (?P<what>prefill shape|num tokens|batches) \((?:(?:num_tokens|bs)=(?P<size>\d+))?[^)]*\)"
    r"[^|\n]*\|[^|\n]*\|\s*(?P<done>\d+)/(?P<total>\d+)"
)
# What the scanner itself must see besides the rules' patterns (generic exceptions, the startup state).
_STRUCTURE = (
    _EXCEPTION_START.pattern, r"ERROR:", _SYMPTOM.pattern, _SHUTDOWN.pattern, _TERMINATE.pattern,
    LOAD_BEGIN, LOAD_END, _CAPTURE.pattern, _TQDM.pattern,
)

_prefilters: dict[tuple[Rule, ...], re.Pattern[str]] = {}


def _interesting() -> re.Pattern[str]:
    """The cheap first look, derived from the active rules: only lines it matches are examined further."""
    rules = active_rules()
    found = _prefilters.get(rules)
    if found is None:
        found = _prefilters[rules] = prefilter(rules, _STRUCTURE)
    return found


def looks_like_error(text: str) -> bool:
    """Whether new log text may hold an error worth a :func:`diagnose` (the rules' own pre-filter): a cheap
    check for a caller that watches a growing log."""
    return _TRACEBACK in text or _interesting().search(text) is not None


# ---------------------------------------------------------------------------------------------- parsing


@dataclass
class _Line:
    raw: str  # the line as printed (ANSI removed, the last carriage-return segment)
    msg: str  # without the "[timestamp TPn] " prefix
    is_log: bool  # had a log prefix


@dataclass
class _Event:
    line: int  # 0-based index of the quoted line
    text: list[str]  # quoted lines
    kind: Kind | None  # None: generic (unknown)
    role: str = "hard"  # hard | soft | cleanup | symptom | chained
    signal: int | None = None  # for child-death symptoms
    capture: str | None = None  # which graph, for capture errors
    after_shutdown: bool = False
    traceback_start: int | None = None  # 0-based line of "Traceback ..." for traceback exceptions
    chained_from: str | None = None  # for unknown chains: the first exception of the chain
    frames: str = ""  # the traceback frames
    detail: dict[str, str] = field(default_factory=dict)


def _split(log_text: str) -> list[_Line]:
    out: list[_Line] = []
    for raw in log_text.split("\n"):
        if "\x1b" in raw:
            raw = _ANSI.sub("", raw)
        if "\r" in raw:
            parts = [p for p in raw.split("\r") if p.strip()]
            raw = parts[-1] if parts else ""
        m = _PREFIX.match(raw)
        out.append(_Line(raw, raw[m.end() :] if m else raw, m is not None))
    if out and out[-1].raw == "" and log_text.endswith("\n"):
        out.pop()
    return out


def _clip(text: str) -> str:
    text = text.rstrip()
    return text if len(text) <= MAX_LINE_CHARS else text[: MAX_LINE_CHARS - 3] + "..."


class _State:
    """Startup state while scanning: weight loading, open graph captures, the last capture progress bar."""

    def __init__(self) -> None:
        self.loading = False
        self.captures: list[str] = []
        self.shutdown = False
        self.bar: tuple[str, int | None, int, int] | None = None  # (graph, size, done, total) of the last bar

    def feed(self, msg: str, full: str) -> None:
        if LOAD_BEGIN in msg:
            self.loading = True
        elif LOAD_END in msg:
            self.loading = False
        if "graph " in msg:
            m = _CAPTURE.search(msg)
            if m:
                what = _graph_name(m.group("what"))
                self.bar = None
                if m.group("edge") == "begin":
                    self.captures.append(what)
                elif what in self.captures:
                    self.captures.remove(what)
                elif self.captures:
                    self.captures.pop()
        if "Capturing " in full:
            bars = list(_TQDM.finditer(full))
            if bars:
                b = bars[-1]
                size = b.group("size")
                self.bar = (
                    _graph_name(b.group("what")),
                    int(size) if size else None,
                    int(b.group("done")),
                    int(b.group("total")),
                )
        if _SHUTDOWN.search(msg):
            self.shutdown = True

    def capture(self) -> str | None:
        """The graph being captured: an open "Capture ... graph begin", else an unfinished progress bar."""
        if self.captures:
            return self.captures[-1]
        if self.bar is not None and self.bar[2] < self.bar[3]:
            return self.bar[0]
        return None


def _graph_name(what: str) -> str:
    what = what.lower()
    if any(word in what for word in ("prefill", "piecewise", "extend", "num tokens", "shape")):
        return "prefill"
    if "verify" in what:
        return "verify"
    return "decode"


def _is_warning(text: str) -> Rule | None:
    return next((rule for rule in active_rules() if rule.warning(text)), None)


def _is_continuation(line: _Line) -> bool:
    """A line that continues a multi-line exception message (not a new log record or traceback part)."""
    s = line.raw
    if not s.strip() or line.is_log or _TRACEBACK in s or s.startswith(_FRAME):
        return False
    if (
        s.startswith(_CHAIN_MARKERS)
        or _NOISE.search(s)
        or s.startswith(("Loading ", "Multi-thread", "Capturing "))
        or " NCCL INFO " in s
        or _is_warning(s)
    ):
        return False
    return not s.startswith("usage:")


def _continuation(lines: list[_Line], i: int, limit: int = 8) -> tuple[list[str], int]:
    """The continuation lines after index ``i`` (exclusive); returns them and the next index.

    A blank line inside a message (huggingface_hub's errors have one) is crossed when the line after it still
    continues the message.
    """
    out: list[str] = []
    j = i + 1
    n = len(lines)
    while j < n and len(out) < limit:
        if not lines[j].raw.strip():
            if j + 1 < n and lines[j + 1].raw.strip() and _is_continuation(lines[j + 1]):
                j += 1
                continue
            break
        if not _is_continuation(lines[j]):
            break
        out.append(lines[j].raw)
        j += 1
    return out, j


def _classify(text: str, frames: str, state: _State) -> tuple[Kind | None, str, str | None]:
    """(kind, role, capture) for an error text; ``frames`` is its traceback (or the text itself)."""
    rules = active_rules()
    capture = _capture_of(frames, state)
    for rule in rules:  # a symptom of a kind (the capture-cleanup assertion, a dead child) is never a cause
        if rule.symptom(text):
            return rule.kind, rule.symptom_role, capture
    scene = Scene(text, frames, state.capture(), state.loading)
    for rule in rules:
        if rule.matches(text) and (rule.when is None or rule.when(scene)):
            return rule.kind, "hard", capture
    if _SYMPTOM.search(text):
        return None, "symptom", None
    for rule in rules:
        if rule.fallback is not None and rule.fallback(scene):
            return rule.kind, "hard", capture
    return None, "hard", None


def _capture_of(frames: str, state: _State) -> str | None:
    current = state.capture()
    if current is not None:
        return current
    if "prefill" in frames:
        return "prefill"
    if "decode" in frames or CAPTURE_FRAMES.search(frames):
        return "decode"
    return None


def _child_signal(text: str) -> int | None:
    m = re.search(r"exit code:? (-\d+)|exited with (?:exit )?code (-\d+)", text)
    return int(m.group(1) or m.group(2)) if m else None


def _scan(lines: list[_Line]) -> list[_Event]:
    events: list[_Event] = []
    state = _State()
    interesting = _interesting()
    i = 0
    n = len(lines)
    while i < n:
        line = lines[i]
        msg = line.msg
        if _TRACEBACK in msg:
            i = _traceback_group(lines, i, state, events)
            continue
        if not line.is_log and line.raw.startswith(_FRAME):  # a traceback whose header is not in the log
            i = _traceback_group(lines, i, state, events, headerless=True)
            continue
        if not interesting.search(msg):
            i += 1
            continue
        state.feed(msg, line.raw)
        if _NOISE.search(msg) or _NOISE.search(line.raw):
            i += 1
            continue
        event, i = _standalone(lines, i, state)
        if event is not None:
            events.append(event)
    return events


def _standalone(lines: list[_Line], i: int, state: _State) -> tuple[_Event | None, int]:
    """An error-looking line outside a traceback (or None) and the index after it and its continuation."""
    msg = lines[i].msg
    stripped = msg.strip()
    warned = _is_warning(msg)
    exception_like = _EXCEPTION_START.match(stripped) is not None or stripped.startswith("ERROR:")
    known = _SYMPTOM.search(msg) or any(
        rule.symptom(msg) or (rule.matches_line(msg) and (exception_like or not rule.standalone_needs_exception))
        for rule in active_rules()
    )
    terminate = _TERMINATE.search(stripped) is not None
    if not (known or warned or exception_like or terminate):
        return None, i + 1
    cont, after = _continuation(lines, i) if warned is None else ([], i + 1)
    text = [stripped, *cont]
    joined = "\n".join(text)
    kind, role, capture = _classify(joined, joined, state)
    if warned is not None and role == "hard" and kind in (None, warned.kind):
        kind, role = warned.kind, "soft"
    event = _Event(i, text, kind, role, capture=capture, after_shutdown=state.shutdown, frames=joined)
    _annotate(event, joined, state)
    return event, after


def _annotate(event: _Event, text: str, state: _State) -> None:
    if event.kind is Kind.KILLED_BY_SIGNAL:
        event.signal = _child_signal(text)
    if state.bar is not None:
        graph, size, done, total = state.bar
        label = "num_tokens" if graph == "prefill" else "bs"
        event.detail["bucket"] = f"bucket {min(done + 1, total)} of {total}" + (
            f", {label}={size}" if size is not None else ""
        )


def _traceback_group(
    lines: list[_Line], i: int, state: _State, events: list[_Event], headerless: bool = False
) -> int:
    """Parse a (possibly chained) traceback starting at ``i``; append one event; return the next index.

    ``headerless``: ``i`` is the first frame of a traceback whose "Traceback (most recent call last):" line is not in
    the log (a trimmed or interleaved log).
    """
    n = len(lines)
    if not headerless:
        state.feed(lines[i].msg, lines[i].raw)
    group_start = i
    exceptions: list[_Event] = []
    while True:
        tb_start = i
        if not headerless:
            i += 1
        headerless = False
        frames: list[str] = []
        while i < n and lines[i].raw[:1] in (" ", "\t") and not lines[i].is_log:
            frames.append(lines[i].raw)
            i += 1
        context = "\n".join(frames)
        if i < n and lines[i].raw.strip() and not lines[i].is_log and _TRACEBACK not in lines[i].raw:
            exc_index = i
            cont, i = _continuation(lines, i)
            text = [lines[exc_index].raw.strip(), *cont]
        else:  # a truncated traceback: quote its last frame line
            exc_index = max(tb_start, i - 1)
            text = [lines[exc_index].raw.strip() or _TRACEBACK]
        joined = "\n".join(text)
        kind, role, capture = _classify(joined, context + "\n" + joined, state)
        event = _Event(
            exc_index,
            text,
            kind,
            role,
            capture=capture,
            after_shutdown=state.shutdown,
            traceback_start=tb_start,
            frames=context,
        )
        _annotate(event, joined, state)
        exceptions.append(event)
        # a chain: blank lines, a chain marker, blank lines, the next "Traceback"
        j = i
        while j < n and not lines[j].raw.strip():
            j += 1
        if j < n and lines[j].raw.startswith(_CHAIN_MARKERS):
            j += 1
            while j < n and not lines[j].raw.strip():
                j += 1
            if j < n and _TRACEBACK in lines[j].raw:
                i = j
                continue
        break
    chosen = _merge_chain(exceptions, group_start)
    events.append(chosen)
    for other in exceptions:
        if other is not chosen:
            if other.role == "hard":
                other.role = "chained"
            events.append(other)
    return i


def _merge_chain(exceptions: list[_Event], group_start: int) -> _Event:
    """The exception that stands for a chained traceback: its most specific one.

    A known kind wins (the OOM under the capture-cleanup assertion, the HFValidationError under the OSError that
    wraps it); then a dead child process (the EOFError it causes is chained to it); then, for an unknown error, the
    exception that propagated (the last one printed), which usually says the most.
    """
    specific = [e for e in exceptions if e.kind is not None and e.role == "hard"]
    died = [e for e in exceptions if e.kind is Kind.KILLED_BY_SIGNAL]
    generic = [e for e in exceptions if e.kind is None and e.role == "hard"]
    cleanup = [e for e in exceptions if e.role == "cleanup"]
    if specific:
        chosen = specific[0]
    elif died:
        chosen = died[0]
    elif generic:
        chosen = generic[-1]
        if exceptions[0] is not chosen:
            chosen.chained_from = exceptions[0].text[0]
    elif cleanup:
        chosen = cleanup[0]
    else:
        chosen = exceptions[-1]
    chosen.traceback_start = group_start
    return chosen


# ---------------------------------------------------------------------------------------------- diagnose


def diagnose(log_text: str, returncode: int | None = None, argv: Sequence[str] | None = None) -> Diagnosis:
    """Find the first error of a worker log and classify it.

    ``returncode`` is the worker's exit status (``None`` while it runs, negative for a signal). ``argv``, the
    worker's command line when known, is what the advice reads before it recommends a flag. A log with no error
    and a returncode of ``None`` or ``0`` gives :attr:`Kind.NONE`. Errors are found whatever the returncode, so a
    worker that hangs after a fatal error (uvicorn's failed bind leaves the process alive) can be diagnosed while it
    still runs.
    """
    lines = _split(log_text)
    events = _scan(lines)
    phase = startup_phase(log_text)
    events.sort(key=lambda e: e.line)

    live = [e for e in events if not e.after_shutdown]
    hard = [e for e in live if e.role == "hard"]
    cause: _Event | None = hard[0] if hard else None
    if cause is not None and cause.kind is not None and rule_for(cause.kind).warnings:
        # warnings of the same kind before the error say more (NCCL WARN lines name the failing call)
        earlier = [e for e in live if e.role == "soft" and e.kind is cause.kind and e.line < cause.line]
        if earlier:
            cause = _Event(
                earlier[0].line,
                earlier[0].text + cause.text[:2],
                cause.kind,
                "hard",
                traceback_start=cause.traceback_start,
                frames=cause.frames,
            )
    if cause is None:
        died = [e for e in live if e.kind is Kind.KILLED_BY_SIGNAL and e.signal is not None]
        cleanup = [e for e in live if e.role == "cleanup"]
        soft = [e for e in live if e.role == "soft"]
        failed = returncode not in (None, 0)
        if died:
            cause = died[0]
        elif cleanup:
            cause = cleanup[0]
            cause.detail["only_cleanup"] = "1"
        elif soft and failed:
            cause = soft[0]
    if cause is None:
        return _no_error(lines, events, returncode, phase)
    secondary, quoted = _secondary(events, cause)
    related = [line for e in events if e.kind is cause.kind and e is not cause for line in e.text]
    return _describe(cause, related, secondary, returncode, phase, quoted, argv)


def _no_error(lines: list[_Line], events: list[_Event], returncode: int | None, phase: str | None) -> Diagnosis:
    stopped = any(_SHUTDOWN.search(line.msg) for line in lines if "SIG" in line.msg or "Grace" in line.msg)
    shown = [e for e in events if e.role == "symptom"][:MAX_SECONDARY]
    symptoms = tuple(_secondary_line(e) for e in shown)
    quoted = tuple(_clip(e.text[0]) for e in shown)
    if returncode is not None and returncode < 0:
        name = signal_name(-returncode)
        if stopped:
            return Diagnosis(
                Kind.NONE,
                f"the worker shut down on request (SIGTERM); returncode {returncode} ({name}) comes from "
                "sglang's own kill_process_tree at the end of a shutdown",
                returncode=returncode,
                phase=phase,
            )
        return Diagnosis(
            Kind.KILLED_BY_SIGNAL,
            f"the worker was killed by {name} (returncode {returncode}) and its log shows no error",
            signal_advice(-returncode),
            secondary=symptoms,
            returncode=returncode,
            phase=phase,
            secondary_text=quoted,
        )
    if returncode:
        return Diagnosis(
            Kind.UNKNOWN,
            f"the worker exited with code {returncode} and its log shows no error",
            "read the whole log; run the worker's command line by hand to see what it prints",
            secondary=symptoms,
            returncode=returncode,
            phase=phase,
            secondary_text=quoted,
        )
    summary = "no error in the log" + (f" (reached: {phase})" if phase else "")
    if stopped:
        summary = "no error in the log; the worker shut down on request (SIGTERM)"
    return Diagnosis(Kind.NONE, summary, returncode=returncode, phase=phase)


def _secondary(events: list[_Event], cause: _Event) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The later errors that are not the cause (as :attr:`Diagnosis.secondary` says them) and the text each quotes."""
    seen = set(cause.text)
    out: list[str] = []
    texts: list[str] = []
    extra = 0
    for e in events:
        if e is cause or e.line == cause.line or e.text[0] in seen:
            continue
        if e.role == "soft" and e.kind is cause.kind:
            continue
        if cause.kind is not None and e.kind is cause.kind and rule_for(cause.kind).repeats:
            continue  # the same event again (another pid): its summary counts them
        seen.add(e.text[0])
        if len(out) < MAX_SECONDARY:
            out.append(_secondary_line(e))
            texts.append(_clip(e.text[0]))
        else:
            extra += 1
    if extra:
        out.append(f"... and {extra} more")
    return tuple(out), tuple(texts)


def _secondary_line(e: _Event) -> str:
    text = _clip(e.text[0])
    if e.role == "cleanup":
        why = "PyTorch's cleanup assertion after a failed graph capture: a symptom, not the cause"
    elif e.role == "symptom":
        why = "the server tearing down after the failure"
    elif e.after_shutdown:
        why = "after the shutdown began"
    elif e.role == "chained":
        why = "chained to another error"
    elif e.role == "soft":
        why = "a warning"
    else:
        why = "a later error"
    return f"log line {e.line + 1}: {text} ({why})"


def _quote(cause: _Event) -> str:
    text = [_clip(t) for t in cause.text[:MAX_QUOTED_LINES]]
    if cause.chained_from and len(text) < MAX_QUOTED_LINES:
        text.append(f"(chained from: {_clip(cause.chained_from)})")
    return "\n".join(text)


def _describe(
    cause: _Event, related: list[str], secondary: tuple[str, ...], returncode: int | None, phase: str | None,
    quoted: tuple[str, ...] = (), argv: Sequence[str] | None = None,
) -> Diagnosis:
    """Summary and advice for the cause, from its kind's rule. ``related`` holds the text of other errors of the
    same kind, where a detail (a port number, a model id) may be when the first error lacks it."""
    kind = cause.kind or Kind.UNKNOWN
    text = "\n".join(cause.text)
    facts = Facts(
        text=text,
        related="\n".join([text, *related]),
        frames=cause.frames,
        graph=cause.capture or "prefill",
        bucket=cause.detail.get("bucket"),
        phase=phase,
        returncode=returncode,
        signal=cause.signal,
        only_cleanup="only_cleanup" in cause.detail,
        traceback_line=cause.traceback_start + 1 if cause.traceback_start is not None else None,
        argv=None if argv is None else tuple(argv),
    )
    rule = rule_for(kind)
    return Diagnosis(
        kind, rule.summary(facts), rule.advice(facts), _quote(cause), cause.line + 1, secondary, returncode, phase,
        quoted,
    )
