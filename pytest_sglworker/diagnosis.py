"""First-error classification of an sglang worker log, startup phase and KV-line parsing.

Plain Python, stdlib only: no pytest here.

:func:`diagnose` reads a worker's log (and optionally its exit code) and says what went wrong *first*.
That matters because an sglang startup failure usually prints several errors, and the last one is often a
symptom. The canonical case (FACTS.md): with the default ``--mem-fraction-static`` the breakable prefill
CUDA graph runs out of memory in ``capture_end()``; PyTorch's ``__exit__`` then ends the same capture again
and raises ``num_active_captures_ > 0 INTERNAL ASSERT FAILED ... markCaptureEnd called with no captures in
progress``. sglang's breakable-graph context logs that *second* exception before the scheduler prints the
chained traceback (OOM first, then "During handling of the above exception ..."), so the assertion can be
the first error line in the file. It is never the cause: :func:`diagnose` always labels it secondary.

:func:`startup_phase` says how far a starting worker got (cheap: a few ``str.rfind`` over the text, so it
can be called on every health poll); :func:`parse_kv_tokens`, :func:`parse_max_total_tokens` and
:func:`parse_memory` read the engine's memory lines, for comparing a run with :mod:`ledger`'s prediction.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

__all__ = [
    "Diagnosis",
    "Kind",
    "LogMemory",
    "diagnose",
    "parse_kv_tokens",
    "parse_max_total_tokens",
    "parse_memory",
    "startup_phase",
    "startup_phase_from_file",
]


class Kind(str, Enum):
    """What a worker failure was. The values are stable strings (``kind.value``), safe to match on."""

    NONE = "none"
    GRAPH_CAPTURE_OOM = "graph_capture_oom"
    GRAPH_CAPTURE_ERROR = "graph_capture_error"
    KV_POOL_DOES_NOT_FIT = "kv_pool_does_not_fit"
    WEIGHTS_OOM = "weights_oom"
    CUDA_OOM = "cuda_oom"
    PORT_IN_USE = "port_in_use"
    MODEL_NOT_FOUND = "model_not_found"
    NCCL_ERROR = "nccl_error"
    BAD_FLAG = "bad_flag"
    KILLED_BY_SIGNAL = "killed_by_signal"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


#: How many lines of an error :attr:`Diagnosis.first_error` quotes, and how long a quoted line may be.
MAX_QUOTED_LINES = 5
MAX_LINE_CHARS = 400
#: How many secondary errors :attr:`Diagnosis.secondary` keeps.
MAX_SECONDARY = 6


@dataclass(frozen=True)
class Diagnosis:
    """The first error of a worker log, classified.

    ``first_error`` quotes the error (up to :data:`MAX_QUOTED_LINES` lines), ``first_error_line`` is its
    1-based line number in the log (``None`` when the log shows no error). ``secondary`` lists later errors
    and symptoms, each as ``"log line N: text (why it is not the cause)"``.
    """

    kind: Kind
    summary: str
    advice: str = ""
    first_error: str = ""
    first_error_line: int | None = None
    secondary: tuple[str, ...] = ()
    returncode: int | None = None
    phase: str | None = None

    @property
    def is_error(self) -> bool:
        """True unless the log and the exit code show nothing wrong."""
        return self.kind is not Kind.NONE

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


# ---------------------------------------------------------------------------------------------- patterns

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# "[2026-12-02 10:00:00] msg", "[2026-12-02 10:00:00 TP0] msg", "[2026-12-02 10:00:00 DP0 TP1 EP1] msg",
# "[2026-12-02 10:00:00.123 TP0] msg", and a bare "[TP0] msg".
_PREFIX = re.compile(
    r"^\[(?:\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?: [A-Z_]+\d+)*|[A-Z_]+\d+(?: [A-Z_]+\d+)*)\] ?"
)
_TRACEBACK = "Traceback (most recent call last):"
_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)

# Lines that look like errors and are not: import fallbacks, Python warnings, c10 warnings ("[W ..." and
# "[rank0]:[W1202 ...") such as ProcessGroupNCCL's "destroy_process_group() was not called" at exit, and
# the engine's own port fallback.
_NOISE = re.compile(
    r"Ignore import error when loading sglang\.srt\.models\."
    r"|^\S*:\d+: \w*Warning: "
    r"|^\w*Warning: "
    r"|^(?:\[rank\d+\]:)?\[W[\d ]"
    r"|is already in use, trying port"
    r"|Waiting for \d+ seconds for \w+ to be available"
)
# A cheap first look: only lines matching this are examined further.
_INTERESTING = re.compile(
    r"Error|Exception|error|rror:|out of memory|Not enough memory|leave no GPU memory|already in use"
    r"|Errno|EADDRINUSE|is not available|NCCL|nccl|Repository Not Found|not a valid model identifier"
    r"|huggingface|offline|No such file|SIGQUIT|sigquit|SIGTERM|Initialization failed|exit code"
    r"|INTERNAL ASSERT|markCaptureEnd|terminate called|Load weight|graph begin|graph end|Capturing "
    r"|Gracefully|Fatal Python|Segmentation fault"
)
_EXCEPTION_START = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit)\b(?::|$)")

_CLEANUP_ASSERT = re.compile(r"markCaptureEnd called with no captures in progress|num_active_captures_ > 0")
_OOM = re.compile(
    r"\bOutOfMemoryError\b|CUDA out of memory|CUDA error: out of memory|cudaErrorMemoryAllocation"
    r"|\bout of memory\b"
)
_OOM_STANDALONE = re.compile(r"CUDA out of memory|CUDA error: out of memory|cudaErrorMemoryAllocation")
_KV = re.compile(
    r"Not enough memory\. Please try to increase --mem-fraction-static"
    r"|Loaded weights leave no GPU memory for the KV cache"
)
_PORT = re.compile(
    r"address already in use|\[Errno 98\]|\bEADDRINUSE\b|\b\w+_port at \d+ is not available"
    r"|Port is already in use|\bport \d+ is already in use|is already in use\. ",
    re.IGNORECASE,
)
_MODEL = re.compile(
    r"Repository Not Found|RepositoryNotFoundError|is not a local folder and is not a valid model identifier"
    r"|We couldn't connect to 'https://huggingface\.co'|LocalEntryNotFoundError|HFValidationError"
    r"|Repo id must be in the form|GatedRepoError|EntryNotFoundError|RevisionNotFoundError"
    r"|does not appear to have a file named config\.json|Can't load the configuration of"
    r"|Cannot find any model weights|offline mode is enabled|HF_HUB_OFFLINE"
    r"|(?:FileNotFoundError|No such file or directory)[^\n]*(?:config\.json|\.safetensors|tokenizer)"
)
_NCCL = re.compile(
    r"NCCL error|\bnccl(?:InternalError|SystemError|UnhandledCudaError|InvalidUsage|InvalidArgument"
    r"|RemoteError)\b|ProcessGroupNCCL[^\n]*(?:[Ee]rror|timed out|Watchdog caught|exception)|DistBackendError"
)
_NCCL_SOFT = re.compile(r"\bNCCL WARN\b")
_BAD_FLAG = re.compile(
    r"^[\w .\-/]+: error: (?:unrecognized arguments|argument [-\w/]+|the following arguments are required"
    r"|ambiguous option|one of the arguments|invalid choice)"
)
_CHILD_DIED = re.compile(
    r"scheduler died during initialization \(exit code: (-?\d+)\)|crashed with exit code (-?\d+)"
    r"|\bexited with (?:exit )?code (-\d+)"
)
_SYMPTOM = re.compile(
    r"Received sigquit from a child process|SIGQUIT received|Initialization failed\.|Triggering SIGQUIT"
)
_SHUTDOWN = re.compile(r"SIGTERM received|Gracefully exiting")
_TERMINATE = re.compile(r"^(?:terminate called after throwing|Fatal Python error:|Segmentation fault)")

_LOAD_BEGIN = "Load weight begin"
_LOAD_END = "Load weight end"
_CAPTURE = re.compile(r"Capture (?P<what>.*?)\s*(?:CUDA|cuda|CPU|NPU|XPU|MUSA) graph (?P<edge>begin|end)\b")
_TQDM = re.compile(
    r"Capturing (?:prefill shape|batches) \((?:num_tokens|bs)=(?P<size>\d+)[^)]*\)[^|\n]*\|[^|\n]*\|\s*"
    r"(?P<done>\d+)/(?P<total>\d+)"
)

_CAPTURE_FRAMES = re.compile(
    r"capture_one|capture_end|cuda_graph_runner|CudaGraphRunner|breakable_cuda_graph|graph_capture"
    r"|capture_decode_graph|capture_prefill_graph|torch/cuda/graphs\.py|_capture_one_stream|def capture\b"
    r"|, in capture\b"
)
_LOAD_FRAMES = re.compile(r"load_weights|in load_model|weight_loader|model_loader/|safetensors")


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
    role: str = "hard"  # hard | soft | cleanup | symptom
    signal: int | None = None  # for child-death symptoms
    capture: str | None = None  # which graph, for capture OOMs
    after_shutdown: bool = False
    traceback_start: int | None = None  # 0-based line of "Traceback ..." for traceback exceptions
    chained_from: str | None = None  # for unknown chains: the first exception of the chain
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
    """Startup state while scanning: weight loading and open graph captures."""

    def __init__(self) -> None:
        self.loading = False
        self.captures: list[str] = []
        self.shutdown = False
        self.last_tqdm: tuple[int, int, int] | None = None  # (size, done, total) of the last capture bar

    def feed(self, msg: str, full: str) -> None:
        if _LOAD_BEGIN in msg:
            self.loading = True
        elif _LOAD_END in msg:
            self.loading = False
        if "graph " in msg:
            m = _CAPTURE.search(msg)
            if m:
                what = _graph_name(m.group("what"))
                if m.group("edge") == "begin":
                    self.captures.append(what)
                    self.last_tqdm = None
                elif what in self.captures:
                    self.captures.remove(what)
                elif self.captures:
                    self.captures.pop()
        if "Capturing " in full:
            bars = list(_TQDM.finditer(full))
            if bars:
                b = bars[-1]
                self.last_tqdm = (int(b.group("size")), int(b.group("done")), int(b.group("total")))
        if _SHUTDOWN.search(msg):
            self.shutdown = True


def _graph_name(what: str) -> str:
    what = what.lower()
    if "prefill" in what or "piecewise" in what or "extend" in what:
        return "prefill"
    if "verify" in what:
        return "verify"
    return "decode"


def _is_continuation(line: _Line) -> bool:
    """A line that continues a multi-line exception message (not a new log record or traceback part)."""
    s = line.raw
    if not s.strip() or line.is_log or _TRACEBACK in s or s.startswith(("  File ", "\tFile ")):
        return False
    if (
        s.startswith(_CHAIN_MARKERS)
        or _NOISE.search(s)
        or s.startswith(("Loading ", "Multi-thread", "Capturing "))
        or _NCCL_SOFT.search(s)
        or " NCCL INFO " in s
    ):
        return False
    return not s.startswith("usage:")


def _continuation(lines: list[_Line], i: int, limit: int = 8) -> tuple[list[str], int]:
    """The continuation lines after index ``i`` (exclusive); returns them and the next index.

    A blank line inside a message (huggingface_hub's errors have one) is crossed when the line after it
    still continues the message.
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


def _classify(text: str, context: str, state: _State) -> tuple[Kind | None, str, str | None]:
    """(kind, role, capture) for an error text; ``context`` is the traceback frames (or continuation)."""
    if _CLEANUP_ASSERT.search(text):
        return Kind.GRAPH_CAPTURE_ERROR, "cleanup", _capture_of(context, state)
    if _KV.search(text):
        return Kind.KV_POOL_DOES_NOT_FIT, "hard", None
    if _CHILD_DIED.search(text):
        return Kind.KILLED_BY_SIGNAL, "symptom", None
    if _OOM.search(text):
        if state.captures:
            return Kind.GRAPH_CAPTURE_OOM, "hard", state.captures[-1]
        if state.loading:
            return Kind.WEIGHTS_OOM, "hard", None
        if _CAPTURE_FRAMES.search(context) or "for prefill runner" in context:
            return Kind.GRAPH_CAPTURE_OOM, "hard", _capture_of(context, state)
        if _LOAD_FRAMES.search(context):
            return Kind.WEIGHTS_OOM, "hard", None
        return Kind.CUDA_OOM, "hard", None
    if _PORT.search(text):
        return Kind.PORT_IN_USE, "hard", None
    if _MODEL.search(text):
        return Kind.MODEL_NOT_FOUND, "hard", None
    if _NCCL.search(text):
        return Kind.NCCL_ERROR, "hard", None
    if _BAD_FLAG.search(text):
        return Kind.BAD_FLAG, "hard", None
    if _SYMPTOM.search(text):
        return None, "symptom", None
    if state.captures:
        return Kind.GRAPH_CAPTURE_ERROR, "hard", state.captures[-1]
    return None, "hard", None


def _capture_of(context: str, state: _State) -> str | None:
    if state.captures:
        return state.captures[-1]
    if "prefill" in context:
        return "prefill"
    if "decode" in context or "cuda_graph_runner" in context:
        return "decode"
    return None


def _child_signal(text: str) -> int | None:
    m = _CHILD_DIED.search(text)
    if not m:
        return None
    value = int(next(g for g in m.groups() if g is not None))
    return value if value < 0 else None


def _scan(lines: list[_Line]) -> list[_Event]:
    events: list[_Event] = []
    state = _State()
    i = 0
    n = len(lines)
    while i < n:
        line = lines[i]
        msg = line.msg
        if _TRACEBACK in msg:
            i = _traceback_group(lines, i, state, events)
            continue
        if not _INTERESTING.search(msg):
            i += 1
            continue
        state.feed(msg, line.raw)
        if _NOISE.search(msg) or _NOISE.search(line.raw):
            i += 1
            continue
        event = _standalone(lines, i, state)
        if event is None:
            i += 1
            continue
        events.append(event)
        i += 1
    return events


def _standalone(lines: list[_Line], i: int, state: _State) -> _Event | None:
    """An error-looking line outside a traceback, or None."""
    msg = lines[i].msg
    stripped = msg.strip()
    soft = _NCCL_SOFT.search(msg) is not None
    exception_like = _EXCEPTION_START.match(stripped) is not None or stripped.startswith("ERROR:")
    known = (
        _CLEANUP_ASSERT.search(msg)
        or _KV.search(msg)
        or _OOM_STANDALONE.search(msg)
        or _PORT.search(msg)
        or _BAD_FLAG.search(msg)
        or _CHILD_DIED.search(msg)
        or _SYMPTOM.search(msg)
        or _NCCL.search(msg)
        or (_MODEL.search(msg) and exception_like)
    )
    terminate = _TERMINATE.search(stripped) is not None
    if not (known or soft or exception_like or terminate):
        return None
    cont, _ = _continuation(lines, i) if not soft else ([], i + 1)
    text = [stripped, *cont]
    joined = "\n".join(text)
    kind, role, capture = _classify(joined, joined, state)
    if soft and role == "hard" and kind is None:
        kind, role = Kind.NCCL_ERROR, "soft"
    elif soft and kind is Kind.NCCL_ERROR:
        role = "soft"
    event = _Event(i, text, kind, role, capture=capture, after_shutdown=state.shutdown)
    if kind is Kind.KILLED_BY_SIGNAL:
        event.signal = _child_signal(joined)
    if kind in (Kind.GRAPH_CAPTURE_OOM, Kind.GRAPH_CAPTURE_ERROR) and state.last_tqdm:
        _add_bucket(event, state)
    return event


def _add_bucket(event: _Event, state: _State) -> None:
    if state.last_tqdm is not None:
        size, done, total = state.last_tqdm
        event.detail["bucket"] = f"bucket {min(done + 1, total)} of {total}, num_tokens={size}"


def _traceback_group(lines: list[_Line], i: int, state: _State, events: list[_Event]) -> int:
    """Parse a (possibly chained) traceback starting at ``i``; append one event; return the next index."""
    n = len(lines)
    state.feed(lines[i].msg, lines[i].raw)
    group_start = i
    exceptions: list[_Event] = []
    while True:
        tb_start = i
        i += 1
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
        )
        if kind is Kind.KILLED_BY_SIGNAL:
            event.signal = _child_signal(joined)
        if kind in (Kind.GRAPH_CAPTURE_OOM, Kind.GRAPH_CAPTURE_ERROR):
            _add_bucket(event, state)
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

    A known kind wins (the OOM under the capture-cleanup assertion, the HFValidationError under the OSError
    that wraps it); then a dead child process (the EOFError it causes is chained to it); then, for an
    unknown error, the exception that propagated (the last one printed), which usually says the most.
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


def diagnose(log_text: str, returncode: int | None = None) -> Diagnosis:
    """Find the first error of a worker log and classify it.

    ``returncode`` is the worker's exit status (``None`` while it runs, negative for a signal). A log with
    no error and a returncode of ``None`` or ``0`` gives :attr:`Kind.NONE`. Errors are found whatever the
    returncode, so a worker that hangs after a fatal error (uvicorn's failed bind leaves the process alive)
    can be diagnosed while it still runs.
    """
    lines = _split(log_text)
    events = _scan(lines)
    phase = startup_phase(log_text)
    events.sort(key=lambda e: e.line)

    live = [e for e in events if not e.after_shutdown]
    hard = [e for e in live if e.role == "hard"]
    cause: _Event | None = hard[0] if hard else None
    if cause is not None and cause.kind is Kind.NCCL_ERROR:
        earlier = [e for e in live if e.role == "soft" and e.line < cause.line]
        if earlier:
            cause = _Event(
                earlier[0].line,
                earlier[0].text + cause.text[:2],
                Kind.NCCL_ERROR,
                "hard",
                traceback_start=cause.traceback_start,
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
    secondary = _secondary(events, cause)
    related = [line for e in events if e.kind is cause.kind and e is not cause for line in e.text]
    return _describe(cause, related, secondary, returncode, phase)


def _no_error(
    lines: list[_Line], events: list[_Event], returncode: int | None, phase: str | None
) -> Diagnosis:
    stopped = any(_SHUTDOWN.search(line.msg) for line in lines if "SIG" in line.msg or "Grace" in line.msg)
    symptoms = tuple(_secondary_line(e) for e in events if e.role == "symptom")[:MAX_SECONDARY]
    if returncode is not None and returncode < 0:
        name = _signal_name(-returncode)
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
            _signal_advice(-returncode),
            secondary=symptoms,
            returncode=returncode,
            phase=phase,
        )
    if returncode:
        return Diagnosis(
            Kind.UNKNOWN,
            f"the worker exited with code {returncode} and its log shows no error",
            "read the whole log; run the worker's command line by hand to see what it prints",
            secondary=symptoms,
            returncode=returncode,
            phase=phase,
        )
    summary = "no error in the log" + (f" (reached: {phase})" if phase else "")
    if stopped:
        summary = "no error in the log; the worker shut down on request (SIGTERM)"
    return Diagnosis(Kind.NONE, summary, returncode=returncode, phase=phase)


def _secondary(events: list[_Event], cause: _Event) -> tuple[str, ...]:
    seen = set(cause.text)
    out: list[str] = []
    extra = 0
    for e in events:
        if e is cause or e.line == cause.line or e.text[0] in seen:
            continue
        if e.role == "soft" and cause.kind is Kind.NCCL_ERROR:
            continue
        seen.add(e.text[0])
        if len(out) < MAX_SECONDARY:
            out.append(_secondary_line(e))
        else:
            extra += 1
    if extra:
        out.append(f"... and {extra} more")
    return tuple(out)


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


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _signal_advice(signum: int) -> str:
    if signum == signal.SIGKILL:
        return (
            "SIGKILL with no error in the log is most likely the host's OOM killer (CPU RAM, not GPU "
            "memory): "
            "check `dmesg -T | grep -i oom` and the machine's memory; otherwise something outside killed it "
            "(a CI timeout, another tool)"
        )
    if signum == signal.SIGTERM:
        return "something outside the worker stopped it with SIGTERM (a CI timeout, another tool)"
    if signum == signal.SIGSEGV:
        return "a crash in native code: rerun with the same arguments and look for a core dump"
    return "the worker was stopped by a signal from outside; check what else runs on the machine"


def _quote(cause: _Event) -> str:
    text = [_clip(t) for t in cause.text[:MAX_QUOTED_LINES]]
    if cause.chained_from and len(text) < MAX_QUOTED_LINES:
        text.append(f"(chained from: {_clip(cause.chained_from)})")
    return "\n".join(text)


def _describe(
    cause: _Event, related: list[str], secondary: tuple[str, ...], returncode: int | None, phase: str | None
) -> Diagnosis:
    """Summary and advice for the cause. ``related`` holds the text of other errors of the same kind, where
    a detail (a port number, a model id) may be when the first error lacks it."""
    text = "\n".join(cause.text)
    more = "\n".join([text, *related])
    first = cause.text[0]
    kind = cause.kind or Kind.UNKNOWN
    graph = cause.capture or "prefill"
    bucket = cause.detail.get("bucket")
    if kind is Kind.GRAPH_CAPTURE_OOM:
        summary = f"CUDA out of memory while capturing the {graph} CUDA graph" + (
            f" ({bucket})" if bucket else ""
        )
        if graph == "prefill":
            advice = (
                "keep --cuda-graph-backend-prefill=disabled (part of CI_WORKER_ARGS) and a lower "
                "--mem-fraction-static such as 0.6: graph capture and activations only get "
                "free_memory*(1-mem_fraction_static), which the KV pool squeezes at the engine's default"
            )
        else:
            advice = (
                "lower --mem-fraction-static (e.g. 0.6) so that graph capture gets more than "
                "free_memory*(1-mem_fraction_static), or cap the graph with --cuda-graph-max-bs-decode"
            )
    elif kind is Kind.GRAPH_CAPTURE_ERROR:
        if cause.detail.get("only_cleanup"):
            summary = (
                f"a CUDA graph capture failed ({graph}); the log holds only PyTorch's cleanup assertion "
                "(markCaptureEnd), not the original error"
            )
        else:
            summary = f"error while capturing the {graph} CUDA graph: {_clip(first)}"
        advice = (
            "disable the graph (--cuda-graph-backend-prefill=disabled, part of CI_WORKER_ARGS) and, if "
            "memory is tight, lower --mem-fraction-static"
        )
    elif kind is Kind.KV_POOL_DOES_NOT_FIT:
        value = _search(r"--mem-fraction-static=(\d+(?:\.\d+)?)", text) or _search(
            r"mem_fraction_static=(\d+(?:\.\d+)?)", text
        )
        above = _search(r"Raise --mem-fraction-static above (\d+(?:\.\d+)?)", text)
        summary = "the KV cache pool does not fit: the loaded weights leave no GPU memory for it" + (
            f" under --mem-fraction-static={value}" if value else ""
        )
        advice = (
            "the fraction applies to the memory free when the worker starts, not to the card: check that no "
            "other process holds GPU memory (one worker per GPU lease), raise --mem-fraction-static"
            + (f" (sglang says above {above})" if above else "")
            + ", or use a bigger GPU / more tensor parallelism"
        )
    elif kind is Kind.WEIGHTS_OOM:
        summary = "CUDA out of memory while loading the weights"
        advice = (
            "the model does not fit in the GPU memory that was free: use a bigger GPU or more tensor "
            "parallelism (--tp-size), and check that no other process holds memory on that GPU"
        )
    elif kind is Kind.CUDA_OOM:
        summary = "CUDA out of memory" + (f" while {phase}" if phase and phase != "ready" else "")
        advice = (
            "lower --mem-fraction-static to leave more room for activations, or reduce "
            "--chunked-prefill-size "
            "or --max-running-requests; check that no other process holds memory on that GPU"
        )
    elif kind is Kind.PORT_IN_USE:
        named = re.search(r"\b(\w+_port) at (\d+) is not available", more)
        port = (
            f"{named.group(1)} {named.group(2)}"
            if named
            else _search(r"port: (\d+)", more)
            or _search(r"\('[^']*', (\d+)\)", more)
            or _search(r"(?:addr|address)='?tcp://[^:]+:(\d+)", more)
        )
        summary = "a port the worker needs is already in use" + (f" ({port})" if port else "")
        advice = (
            "another process (often a stale worker from an earlier run) holds the port: give each worker "
            "its own reserved port block and pin --nccl-port from it; `ss -ltnp` shows who listens"
        )
    elif kind is Kind.MODEL_NOT_FOUND:
        name = (
            _search(r"Repository Not Found for url: \S*/api/models/([^/\s]+/[^/\s]+)", more)
            or _search(r"(?:^|[\s'])([\w.\-/]+)'? is not a local folder", more)
            or _search(r"namespace/repo_name': '([^']+)'", more)
        )
        summary = (
            "the model could not be found"
            + (f": {name}" if name else "")
            + (
                " (Hugging Face hub unreachable or offline)"
                if re.search(r"couldn't connect|offline|outgoing traffic has been disabled", text)
                else ""
            )
        )
        advice = (
            "point SGLWORKER_MODEL_ROOT at a directory holding <root>/<hf id> copies, pass a local "
            "--model-path, "
            "or pre-download the model while online (`huggingface-cli download <id>`); offline mode "
            "(HF_HUB_OFFLINE=1) only finds models already in the HF cache"
        )
    elif kind is Kind.NCCL_ERROR:
        warn = first.split("NCCL WARN ", 1)
        summary = (
            f"NCCL error: {_clip(warn[1])} (NCCL WARN)" if len(warn) == 2 else f"NCCL error: {_clip(first)}"
        )
        advice = (
            "rerun with NCCL_DEBUG=INFO; check that CUDA_VISIBLE_DEVICES names the GPUs of this lease, that "
            "--nccl-port is pinned per worker (random NCCL ports collide between parallel workers), and in "
            "containers that peer access and /dev/shm are available"
        )
    elif kind is Kind.BAD_FLAG:
        message = first.split(": error: ", 1)[-1]
        summary = f"sglang rejected the arguments: {_clip(message)}"
        advice = (
            "the flag does not exist in this sglang version or its value is not allowed; check "
            "`python -m sglang.launch_server --help` for the installed version"
        )
        if "ambiguous option" in message:
            advice = (
                "argparse matched a prefix of several flags (the flag you gave no longer exists under that "
                "exact "
                "name in this sglang version): spell one of the full flag names it lists"
            )
    elif kind is Kind.KILLED_BY_SIGNAL:
        signum = -(cause.signal or (returncode if returncode is not None and returncode < 0 else -9))
        name = _signal_name(signum)
        summary = (
            f"the engine's scheduler process was killed by {name} (exit code {-signum} in the log) with no "
            "error "
            "of its own"
        )
        advice = _signal_advice(signum)
    else:
        where = cause.traceback_start
        short = first if len(first) <= 200 else first[:197] + "..."
        summary = short + (f" (traceback starts at log line {where + 1})" if where is not None else "")
        advice = _unknown_advice(text)
    return Diagnosis(
        kind,
        summary,
        advice,
        _quote(cause),
        cause.line + 1,
        secondary,
        returncode,
        phase,
    )


def _unknown_advice(text: str) -> str:
    if "No accelerator" in text:
        return (
            "no GPU is visible to the worker: check CUDA_VISIBLE_DEVICES and the driver; on a CPU-only "
            "machine "
            "the real engine needs --device cpu and SGLANG_USE_CPU_ENGINE=1"
        )
    if "No module named" in text:
        module = _search(r"No module named '([^']+)'", text)
        hint = (
            "; on a CPU-only machine this usually means the CPU engine was not selected "
            "(SGLANG_USE_CPU_ENGINE=1 and --device cpu, plus the sgl_kernel stub)"
            if module and module.split(".")[0] in ("vllm", "sgl_kernel", "flashinfer")
            else ""
        )
        return f"the worker's Python environment lacks module {module!r}{hint}"
    return "read the traceback in the log at the line above; the error is not one this plugin recognizes"


def _search(pattern: str, text: str, group: int = 1) -> str | None:
    m = re.search(pattern, text)
    return m.group(group) if m else None


# ---------------------------------------------------------------------------------------------- phases

_PHASES: tuple[tuple[str, str], ...] = (
    ("The server is fired up and ready to roll!", "ready"),
    ("Uvicorn running on", "warming up"),
    ("Application startup complete", "starting HTTP server"),
    ("Started server process", "starting HTTP server"),
    ("max_total_num_tokens=", "starting HTTP server"),
    ("graph begin", "capturing CUDA graphs"),
    ("Memory pool end", "allocating KV pool"),
    ("KV Cache is allocated", "allocating KV pool"),
    (_LOAD_END, "allocating KV pool"),
    (_LOAD_BEGIN, "loading weights"),
)


def startup_phase(log_text: str) -> str | None:
    """The latest startup phase the log shows, or None if the log shows none yet.

    ``"loading weights"``, ``"allocating KV pool"``, ``"capturing CUDA graphs"``, ``"starting HTTP server"``,
    ``"warming up"`` or ``"ready"``. It costs one ``str.rfind`` per marker (no regex, no line split), so it
    can run on every health poll; a tail of the log is enough as long as it holds the latest marker (see
    :func:`startup_phase_from_file`).
    """
    best = -1
    phase: str | None = None
    for marker, name in _PHASES:
        pos = log_text.rfind(marker)
        if pos > best:
            best, phase = pos, name
    return phase


def startup_phase_from_file(path: str | os.PathLike[str], max_bytes: int = 256 * 1024) -> str | None:
    """:func:`startup_phase` of a log file, reading it backwards ``max_bytes`` at a time.

    Usually one read of the last ``max_bytes`` finds a marker; a log flooded with other output is read
    further back, chunk by chunk, until a marker turns up or the file's start is reached. None for a
    missing or unreadable file.
    """
    chunk = max(4096, int(max_bytes))
    overlap = max(len(marker) for marker, _ in _PHASES)
    try:
        with open(Path(path), "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            end = size
            while end > 0:
                start = max(0, end - chunk)
                fh.seek(start)
                data = fh.read(min(size, end + overlap) - start)
                phase = startup_phase(data.decode("utf-8", errors="replace"))
                if phase is not None:
                    return phase
                end = start
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------- memory lines

_KV_LINE = re.compile(
    r"KV Cache is allocated\.(?: dtype: (?P<dtype>[\w.]+),)? #tokens: (?P<tokens>\d+)"
    r"(?:, K size: (?P<k>[\d.]+) GB, V size: (?P<v>[\d.]+) GB)?"
)
_MAX_TOTAL = re.compile(r"max_total_num_tokens=(\d+)")
_LOAD_BEGIN_LINE = re.compile(r"Load weight begin\. avail mem=([\d.]+) GB")
_LOAD_END_LINE = re.compile(r"Load weight end\..*?avail mem=([\d.]+) GB, mem usage=(-?[\d.]+) GB")


@dataclass(frozen=True)
class LogMemory:
    """The engine's memory lines (GB as sglang prints them, i.e. GiB). ``None`` where the log lacks a line."""

    load_begin_avail_gb: float | None = None
    load_end_avail_gb: float | None = None
    weights_gb: float | None = None
    kv_dtype: str | None = None
    kv_tokens: int | None = None
    k_size_gb: float | None = None
    v_size_gb: float | None = None
    max_total_num_tokens: int | None = None


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    last = None
    for found in pattern.finditer(text):
        last = found
    return last


def parse_kv_tokens(log_text: str) -> int | None:
    """``N`` of the last ``KV Cache is allocated. dtype: D, #tokens: N, ...`` line, or None."""
    m = _last(_KV_LINE, log_text)
    return int(m.group("tokens")) if m else None


def parse_max_total_tokens(log_text: str) -> int | None:
    """``N`` of the last ``max_total_num_tokens=N`` in the log, or None."""
    m = _last(_MAX_TOTAL, log_text)
    return int(m.group(1)) if m else None


def parse_memory(log_text: str) -> LogMemory:
    """All memory lines of the (last) startup in the log, to compare with :func:`ledger.predict_memory`."""
    begin = _last(_LOAD_BEGIN_LINE, log_text)
    end = _last(_LOAD_END_LINE, log_text)
    kv = _last(_KV_LINE, log_text)

    def num(m: re.Match[str] | None, group: int | str) -> float | None:
        value = m.group(group) if m else None
        return float(value) if value is not None else None

    return LogMemory(
        load_begin_avail_gb=num(begin, 1),
        load_end_avail_gb=num(end, 1),
        weights_gb=num(end, 2),
        kv_dtype=kv.group("dtype") if kv else None,
        kv_tokens=int(kv.group("tokens")) if kv else None,
        k_size_gb=num(kv, "k"),
        v_size_gb=num(kv, "v"),
        max_total_num_tokens=parse_max_total_tokens(log_text),
    )
