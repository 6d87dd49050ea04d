"""The diagnosis rules: one record per failure kind (patterns, summary, advice, fatal, memory-related).

Plain Python, stdlib only. :mod:`pytest_sglworker.engine.diagnosis` scans a worker log and hands every error it finds to
these records, in the order of :data:`RULES`; the first record whose patterns match classifies the error. See the
docstring of :mod:`pytest_sglworker.engine.diagnosis` for how to add a rule.

The scanner's cheap pre-filter (the only lines it looks at closely) is *derived* from the records: every pattern's
required literal text is extracted from the regex itself (:func:`required_literals`), so a new pattern cannot be
silently ignored. A pattern with no literal the pre-filter could key on is refused when the record is built.

Why one module of this size: it is the table of records itself, one per failure kind with its summary and advice
functions beside it, so that adding a rule is one edit here (and a log fixture).
"""

from __future__ import annotations

import importlib
import re
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "FATAL_KINDS",
    "MEMORY_KINDS",
    "RULES",
    "Facts",
    "Kind",
    "Rule",
    "Scene",
    "active_rules",
    "required_literals",
    "rule_for",
    "using_rules",
]


class Kind(str, Enum):
    """What a worker failure was. The values are stable strings (``kind.value``), safe to match on.

    ``kind.fatal`` and ``kind.memory`` come from the kind's :class:`Rule`.
    """

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
    SIM_FAULT = "sim_fault"
    KILLED_BY_SIGNAL = "killed_by_signal"
    WEB_WORKER_CRASH_LOOP = "web_worker_crash_loop"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value

    @property
    def rule(self) -> Rule:
        """The record that describes this kind."""
        return rule_for(self)

    @property
    def fatal(self) -> bool:
        """After this first error sglang may stay alive without ever serving: the health wait ends early."""
        return rule_for(self).fatal

    @property
    def memory(self) -> bool:
        """A memory failure: the memory ledger belongs beside the diagnosis."""
        return rule_for(self).memory

    @property
    def kv_pool(self) -> bool:
        """A memory failure where the KV pool found no room (not an allocation that ran out)."""
        return rule_for(self).kv_pool


@dataclass(frozen=True)
class Scene:
    """What a rule's ``when`` sees of an error: its text, its traceback frames and the startup state."""

    text: str  # the error's quoted lines
    frames: str  # the traceback frames and the text
    capture: str | None  # the CUDA graph being captured ("prefill", "decode", "verify"), None outside a capture
    loading: bool  # between "Load weight begin" and "Load weight end"


@dataclass(frozen=True)
class Facts:
    """What a rule's summary and advice are built from."""

    text: str  # the cause's quoted lines
    related: str  # the cause and the other errors of the same kind (a port number may be only there)
    frames: str  # the cause's traceback frames
    graph: str  # the CUDA graph concerned ("prefill" unless the log says otherwise)
    bucket: str | None  # "bucket 26 of 58, num_tokens=704" from the last capture progress bar
    phase: str | None  # the startup phase the log reached
    returncode: int | None
    signal: int | None  # a child's signal number from "exit code -9"
    only_cleanup: bool  # the log holds only PyTorch's capture-cleanup assertion
    traceback_line: int | None  # 1-based log line where the cause's traceback starts
    argv: tuple[str, ...] | None = None  # the worker's command line, when known: advice reads it before a flag

    @property
    def first(self) -> str:
        return self.text.splitlines()[0] if self.text else ""

    def flag(self, name: str) -> str | None:
        """The value the argv gives flag ``name`` (``--flag=value`` or ``--flag value``, the last one wins), ``""``
        for a flag given without a value, None when the argv does not give it (or is not known)."""
        found = None
        args = self.argv or ()
        for i, arg in enumerate(args):
            if arg == name:
                found = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
            elif arg.startswith(name + "="):
                found = arg[len(name) + 1:]
        return found


Describe = Callable[[Facts], str]
#: The shortest literal a rule pattern must require (a shorter one would let most lines through the pre-filter).
MIN_LITERAL = 4


@dataclass(frozen=True)
class Rule:
    """One failure kind: how to recognise it and what to say about it.

    ``patterns`` (regex sources) classify an error's text as this kind when ``when`` (if given) holds for its
    :class:`Scene`. A log line outside a traceback is matched against ``standalone`` instead when that is given
    (narrower, because an info line may mention "out of memory"), and only if it looks like an exception when
    ``standalone_needs_exception``. ``symptoms`` mark lines that show this kind only as a consequence (role
    ``symptom_role``: ``"cleanup"`` or ``"symptom"``), never the cause while a real error exists; ``warnings`` mark
    warnings of this kind, quoted with the error they precede. ``fallback`` classifies any otherwise unknown error
    as this kind when it holds. ``fatal``: after this first error sglang may stay alive without ever serving, so
    the health wait ends early. ``memory``: the memory ledger is attached to the failure.
    """

    kind: Kind
    summary: Describe
    advice: Describe
    patterns: tuple[str, ...] = ()
    when: Callable[[Scene], bool] | None = None
    standalone: tuple[str, ...] | None = None
    standalone_needs_exception: bool = False
    symptoms: tuple[str, ...] = ()
    symptom_role: str = "symptom"
    warnings: tuple[str, ...] = ()
    fallback: Callable[[Scene], bool] | None = None
    fatal: bool = False
    memory: bool = False
    #: a memory failure where what ran out is the KV pool's room: the ledger's reading of the log says so
    kv_pool: bool = False
    #: later errors of this kind are the same event again, counted by the summary rather than listed as secondary
    repeats: bool = False
    flags: int = 0
    _hard: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)
    _alone: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)
    _symptom: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)
    _warning: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.symptom_role not in ("symptom", "cleanup"):
            raise ValueError(f"rule {self.kind.value}: symptom_role must be 'symptom' or 'cleanup'")
        alone = self.patterns if self.standalone is None else self.standalone
        for name, sources in (("_hard", self.patterns), ("_alone", alone), ("_symptom", self.symptoms),
                              ("_warning", self.warnings)):
            object.__setattr__(self, name, re.compile("|".join(sources), self.flags) if sources else None)
        self.hints()  # refuses a pattern with no literal the pre-filter could key on

    def matches(self, text: str) -> bool:
        return self._hard is not None and self._hard.search(text) is not None

    def matches_line(self, text: str) -> bool:
        return self._alone is not None and self._alone.search(text) is not None

    def symptom(self, text: str) -> bool:
        return self._symptom is not None and self._symptom.search(text) is not None

    def warning(self, text: str) -> bool:
        return self._warning is not None and self._warning.search(text) is not None

    def hints(self) -> tuple[frozenset[str], frozenset[str]]:
        """(case-sensitive, case-insensitive) literals: every line any pattern of this rule matches holds one."""
        found: set[str] = set()
        for source in (*self.patterns, *(self.standalone or ()), *self.symptoms, *self.warnings):
            literals = required_literals(source, self.flags)
            if not literals or min(len(s) for s in literals) < MIN_LITERAL:
                raise ValueError(
                    f"rule {self.kind.value}: pattern {source!r} has no literal text (of {MIN_LITERAL}+ characters) "
                    "the scanner's pre-filter could key on; make part of it literal"
                )
            found |= literals
        folded = frozenset(found) if self.flags & re.IGNORECASE else frozenset()
        return (frozenset() if folded else frozenset(found)), folded


# ---------------------------------------------------------------------------------------------- literals

_sre: Any = None
try:  # the stdlib's regex parser: "re._parser" since Python 3.11, "sre_parse" before
    _sre = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
except ImportError:  # pragma: no cover - an interpreter without it: required_literals falls back
    _sre = None


def required_literals(pattern: str, flags: int = 0) -> frozenset[str]:
    """Literal strings such that every match of ``pattern`` contains at least one of them (empty: none found).

    Case-insensitive parts give lower-case literals. It reads the regex's parse tree: a sequence needs its best
    literal run or its best group, an alternation needs one literal of every branch.
    """
    if _sre is None:  # pragma: no cover
        return frozenset()
    try:
        tree = _sre.parse(pattern, flags)
    except Exception:  # an unparsable pattern fails at re.compile with a proper error
        return frozenset()
    found = _required(list(tree), bool(flags & re.IGNORECASE))
    return frozenset(found) if found else frozenset()


def _required(items: list[Any], fold: bool) -> set[str] | None:
    candidates: list[set[str]] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            text = "".join(run)
            candidates.append({text.lower() if fold else text})
            run.clear()

    for op, arg in items:
        if op is _sre.LITERAL:
            run.append(chr(arg))
            continue
        flush()
        if op is _sre.SUBPATTERN:
            add_flags = arg[1] if len(arg) == 4 else 0
            sub = _required(list(arg[-1]), fold or bool(add_flags & re.IGNORECASE))
            if sub:
                candidates.append(sub)
        elif op is _sre.BRANCH:
            union: set[str] = set()
            for branch in arg[1]:
                sub = _required(list(branch), fold)
                if not sub:
                    union = set()
                    break
                union |= sub
            if union:
                candidates.append(union)
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT) and arg[0] >= 1:
            sub = _required(list(arg[2]), fold)
            if sub:
                candidates.append(sub)
    flush()
    if not candidates:
        return None
    # the best requirement: the one whose shortest literal is longest (fewest chance hits), then the smallest set
    return max(candidates, key=lambda c: (min(len(s) for s in c), -len(c)))


def prefilter(rules: Iterable[Rule], extra: Iterable[str] = ()) -> re.Pattern[str]:
    """One regex of plain literals that matches every line any of ``rules`` (or the ``extra`` regexes) could."""
    exact: set[str] = set()
    folded: set[str] = set()
    for rule in rules:
        sensitive, insensitive = rule.hints()
        exact |= sensitive
        folded |= insensitive
    for source in extra:
        literals = required_literals(source)
        if not literals:
            raise ValueError(f"structural marker {source!r} has no literal text")
        exact |= literals
    parts = [re.escape(s) for s in _minimal(exact)]
    if folded:
        parts.append("(?i:" + "|".join(re.escape(s) for s in _minimal(folded)) + ")")
    return re.compile("|".join(parts))


def _minimal(literals: set[str]) -> list[str]:
    """Few short keys such that every literal contains one: Python's regex engine tries every alternative at every
    position, so fewer alternatives make the pre-filter faster. Greedy: the word (5+ word characters) found in most
    literals first; a literal with no such word is kept whole; a key that holds another key is dropped."""
    remaining = set(literals)
    keys: list[str] = []
    while remaining:
        counts: dict[str, int] = {}
        for literal in remaining:
            for word in set(re.findall(r"\w{5,}", literal)):
                counts[word] = counts.get(word, 0) + 1
        if not counts:
            keys.extend(sorted(remaining))
            break
        best = max(counts, key=lambda w: (counts[w], len(w), w))
        keys.append(best)
        remaining = {literal for literal in remaining if best not in literal}
    kept = [key for key in keys if not any(other != key and other in key for other in keys)]
    return sorted(kept, key=len, reverse=True)


# ---------------------------------------------------------------------------------------------- helpers

def _search(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text)
    return m.group(1) if m else None


def _clip(text: str, limit: int = 400) -> str:
    text = text.rstrip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_advice(signum: int) -> str:
    if signum == signal.SIGKILL:
        return (
            "SIGKILL with no error in the log is most likely the host's OOM killer (CPU RAM, not GPU memory): "
            "check `dmesg -T | grep -i oom` and the machine's memory; otherwise something outside killed it "
            "(a CI timeout, another tool)"
        )
    if signum == signal.SIGTERM:
        return "something outside the worker stopped it with SIGTERM (a CI timeout, another tool)"
    if signum == signal.SIGSEGV:
        return "a crash in native code: rerun with the same arguments and look for a core dump"
    return "the worker was stopped by a signal from outside; check what else runs on the machine"


# Frames that show where an error happened.
CAPTURE_FRAMES = re.compile(
    r"capture_one|capture_end|cuda_graph_runner|CudaGraphRunner|breakable_cuda_graph|graph_capture"
    r"|capture_decode_graph|capture_prefill_graph|torch/cuda/graphs\.py|_capture_one_stream|def capture\b"
    r"|, in capture\b"
)
LOAD_FRAMES = re.compile(r"load_weights|in load_model|weight_loader|model_loader/|safetensors")
KV_POOL_FRAMES = re.compile(r"init_memory_pool|alloc_memory_pool|mem_cache/memory_pool\.py|_create_buffers")
# sglang's own wrappers of a failed capture: "Capture cuda graph failed: <error>" (the decode and draft runners,
# python/sglang/srt/model_executor/runner/decode_cuda_graph_runner.py in
# https://github.com/sgl-project/sglang/tree/v0.5.23), "Fail when using backend: breakable for prefill runner."
# (runner_backend_utils/__init__.py) and, in 0.5.x before 0.5.23, "Piecewise CUDA Graph failed with error: ...".
CAPTURE_FAILED = (
    r"Capture cuda graph failed",
    r"Fail when using backend: [\w-]+ for prefill runner",
    r"Piecewise CUDA Graph failed with error",
)
_CAPTURE_FAILED = re.compile("|".join(CAPTURE_FAILED))

_OOM = (
    r"\bOutOfMemoryError\b",
    r"CUDA out of memory",
    r"CUDA error: out of memory",
    r"cudaErrorMemoryAllocation",
    r"\bout of memory\b",
)
_OOM_LINE = (r"CUDA out of memory", r"CUDA error: out of memory", r"cudaErrorMemoryAllocation")


def _in_capture(scene: Scene) -> bool:
    if scene.capture is not None:
        return True
    if scene.loading:
        return False
    return bool(CAPTURE_FRAMES.search(scene.frames) or _CAPTURE_FAILED.search(scene.frames))


def _loading_weights(scene: Scene) -> bool:
    return scene.loading or LOAD_FRAMES.search(scene.frames) is not None


# ---------------------------------------------------------------------------------------------- describers

def _capture_oom_summary(f: Facts) -> str:
    return f"CUDA out of memory while capturing the {f.graph} CUDA graph" + (f" ({f.bucket})" if f.bucket else "")


_SQUEEZE = "graph capture and activations only get free_memory*(1-mem_fraction_static), which the KV pool squeezes"
_PREFILL_OFF = "--cuda-graph-backend-prefill=disabled"


def _prefill_off_yet_captured(f: Facts, meanwhile: str) -> str:
    return (f"the argv already has {_PREFILL_OFF}, yet the engine captured a prefill graph: check what overrides the "
            f"flag (a config file, a wrapper script); meanwhile {meanwhile}")


def _capture_oom_advice(f: Facts) -> str:
    if f.graph != "prefill":
        return (
            "lower --mem-fraction-static (e.g. 0.6) so that graph capture gets more than "
            "free_memory*(1-mem_fraction_static), or cap the graph with --cuda-graph-max-bs-decode"
        )
    if f.argv is None:  # the argv is not known: what CI_WORKER_ARGS says
        return (f"keep {_PREFILL_OFF} (part of CI_WORKER_ARGS) and a lower --mem-fraction-static such as 0.6: "
                f"{_SQUEEZE} at the engine's default")
    given = f.flag("--mem-fraction-static")
    lower = f"lower --mem-fraction-static below its {given}" if given else "lower --mem-fraction-static (e.g. 0.6)"
    if f.flag("--cuda-graph-backend-prefill") == "disabled":
        return _prefill_off_yet_captured(f, f"{lower}, or --chunked-prefill-size: {_SQUEEZE}")
    return f"pass {_PREFILL_OFF} (part of CI_WORKER_ARGS) and {lower}: {_SQUEEZE}"


def _capture_error_advice(f: Facts) -> str:
    if f.graph == "prefill" and f.flag("--cuda-graph-backend-prefill") == "disabled":
        return _prefill_off_yet_captured(f, "if memory is tight, lower --mem-fraction-static")
    return (f"disable the graph ({_PREFILL_OFF}, part of CI_WORKER_ARGS) and, if memory is tight, lower "
            "--mem-fraction-static")


def _capture_error_summary(f: Facts) -> str:
    if f.only_cleanup:
        return (
            f"a CUDA graph capture failed ({f.graph}); the log holds only PyTorch's cleanup assertion "
            "(markCaptureEnd), not the original error"
        )
    return f"error while capturing the {f.graph} CUDA graph: {_clip(f.first)}"


def _kv_summary(f: Facts) -> str:
    value = _search(r"--mem-fraction-static=(\d+(?:\.\d+)?)", f.text) or _search(
        r"mem_fraction_static=(\d+(?:\.\d+)?)", f.text
    )
    return "the KV cache pool does not fit: the loaded weights leave no GPU memory for it" + (
        f" under --mem-fraction-static={value}" if value else ""
    )


def _kv_advice(f: Facts) -> str:
    above = _search(r"Raise --mem-fraction-static above (\d+(?:\.\d+)?)", f.text)
    return (
        "the fraction applies to the memory free when the worker starts, not to the card: check that no other "
        "process holds GPU memory (one worker per GPU lease), raise --mem-fraction-static"
        + (f" (sglang says above {above})" if above else "")
        + ", or use a bigger GPU / more tensor parallelism"
    )


def _cuda_oom_summary(f: Facts) -> str:
    if KV_POOL_FRAMES.search(f.frames):
        return "CUDA out of memory while allocating the KV cache pool"
    return "CUDA out of memory" + (f" while {f.phase}" if f.phase and f.phase != "ready" else "")


def _cuda_oom_advice(f: Facts) -> str:
    if KV_POOL_FRAMES.search(f.frames):
        return (
            "the KV pool sized from --mem-fraction-static did not fit in the GPU memory actually free: lower "
            "--mem-fraction-static or cap --max-total-tokens, and check that no other process holds memory on "
            "that GPU"
        )
    return (
        "lower --mem-fraction-static to leave more room for activations, or reduce --chunked-prefill-size or "
        "--max-running-requests; check that no other process holds memory on that GPU"
    )


def _port_summary(f: Facts) -> str:
    named = re.search(r"\b(\w+_port) at (\d+) is not available", f.related)
    port = (
        f"{named.group(1)} {named.group(2)}"
        if named
        else _search(r"port: (\d+)", f.related)
        or _search(r"\('[^']*', (\d+)\)", f.related)
        or _search(r"(?:addr|address)='?tcp://[^:]+:(\d+)", f.related)
    )
    return "a port the worker needs is already in use" + (f" ({port})" if port else "")


def _model_summary(f: Facts) -> str:
    name = (
        _search(r"Repository Not Found for url: \S*/api/models/([^/\s]+/[^/\s]+)", f.related)
        or _search(r"(?:^|[\s'])([\w.\-/]+)'? is not a local folder", f.related)
        or _search(r"namespace/repo_name': '([^']+)'", f.related)
    )
    offline = re.search(r"couldn't connect|offline|outgoing traffic has been disabled", f.text)
    return (
        "the model could not be found"
        + (f": {name}" if name else "")
        + (" (Hugging Face hub unreachable or offline)" if offline else "")
    )


def _nccl_summary(f: Facts) -> str:
    warn = f.first.split("NCCL WARN ", 1)
    return f"NCCL error: {_clip(warn[1])} (NCCL WARN)" if len(warn) == 2 else f"NCCL error: {_clip(f.first)}"


def _bad_flag_summary(f: Facts) -> str:
    return f"sglang rejected the arguments: {_clip(f.first.split(': error: ', 1)[-1])}"


def _bad_flag_advice(f: Facts) -> str:
    if "ambiguous option" in f.first:
        return (
            "argparse matched a prefix of several flags (the flag you gave no longer exists under that exact name "
            "in this sglang version): spell one of the full flag names it lists"
        )
    return (
        "the flag does not exist in this sglang version or its value is not allowed; check "
        "`python -m sglang.launch_server --help` for the installed version"
    )


def _killed_signum(f: Facts) -> int:
    return -(f.signal or (f.returncode if f.returncode is not None and f.returncode < 0 else -9))


def _killed_summary(f: Facts) -> str:
    signum = _killed_signum(f)
    return (
        f"the engine's scheduler process was killed by {signal_name(signum)} (exit code {-signum} in the log) "
        "with no error of its own"
    )


_WEB_WORKER_DIED = r"Child process \[(\d+)\] died"


def _web_worker_summary(f: Facts) -> str:
    deaths = len(re.findall(_WEB_WORKER_DIED, f.related)) or 1
    return (f"a web-server worker process of the HTTP server died {'once' if deaths == 1 else f'{deaths} times'} "
            "and was restarted (uvicorn's supervisor: Child process [N] died)")


def _unknown_summary(f: Facts) -> str:
    short = f.first if len(f.first) <= 200 else f.first[:197] + "..."
    return short + (f" (traceback starts at log line {f.traceback_line})" if f.traceback_line is not None else "")


def _unknown_advice(f: Facts) -> str:
    if "No accelerator" in f.text:
        return (
            "no GPU is visible to the worker: check CUDA_VISIBLE_DEVICES and the driver; on a CPU-only machine the "
            "real engine needs --device cpu and SGLANG_USE_CPU_ENGINE=1"
        )
    if "No module named" in f.text:
        module = _search(r"No module named '([^']+)'", f.text)
        hint = (
            "; on a CPU-only machine this usually means the CPU engine was not selected "
            "(SGLANG_USE_CPU_ENGINE=1 and --device cpu, plus the sgl_kernel stub)"
            if module and module.split(".")[0] in ("vllm", "sgl_kernel", "flashinfer")
            else ""
        )
        return f"the worker's Python environment lacks module {module!r}{hint}"
    return "read the traceback in the log at the line above; the error is not one this plugin recognizes"


def _fixed(text: str) -> Describe:
    return lambda _facts: text


# ---------------------------------------------------------------------------------------------- the records

#: The built-in records, in matching order: the first record whose patterns (and ``when``) match an error wins.
#: The three OOM records share their patterns and differ by ``when``: a capture in progress, then weight loading,
#: then anything else.
RULES: tuple[Rule, ...] = (
    Rule(
        Kind.KV_POOL_DOES_NOT_FIT,
        _kv_summary,
        _kv_advice,
        patterns=(
            # sglang < 0.5.23, pool_configurator.py / model_runner.py
            r"Not enough memory\. Please try to increase --mem-fraction-static",
            # 0.5.23, mem_cache/kv_cache_configurator.py
            r"Loaded weights leave no GPU memory for the KV cache",
            # Not "max_total_tokens=N is larger than the profiled value -M": a warning, and real logs show servers
            # that went on to serve after it (a speculative draft worker's pool), so it is no cause by itself.
        ),
        fatal=True,
        memory=True,
        kv_pool=True,
    ),
    Rule(
        Kind.GRAPH_CAPTURE_OOM,
        _capture_oom_summary,
        _capture_oom_advice,
        patterns=_OOM,
        standalone=_OOM_LINE,
        when=_in_capture,
        fatal=True,
        memory=True,
    ),
    Rule(
        Kind.WEIGHTS_OOM,
        _fixed("CUDA out of memory while loading the weights"),
        _fixed(
            "the model does not fit in the GPU memory that was free: use a bigger GPU or more tensor parallelism "
            "(--tp-size), and check that no other process holds memory on that GPU"
        ),
        patterns=_OOM,
        standalone=_OOM_LINE,
        when=_loading_weights,
        fatal=True,
        memory=True,
    ),
    Rule(Kind.CUDA_OOM, _cuda_oom_summary, _cuda_oom_advice, patterns=_OOM, standalone=_OOM_LINE, fatal=True,
         memory=True),
    Rule(
        Kind.PORT_IN_USE,
        _port_summary,
        _fixed(
            "another process (often a stale worker from an earlier run) holds the port: give each worker its own "
            "reserved port block and pin --nccl-port from it; `ss -ltnp` shows who listens"
        ),
        patterns=(
            r"[Aa]ddress already in use",  # uvicorn's lower case, zmq's capital
            r"\[Errno 98\]",
            r"\bEADDRINUSE\b",
            r"\b\w+_port at \d+ is not available",
            r"[Pp]ort is already in use",
            r"\b[Pp]ort \d+ is already in use",
            r"is already in use\. ",
        ),
        fatal=True,
    ),
    Rule(
        Kind.MODEL_NOT_FOUND,
        _model_summary,
        _fixed(
            "point SGLWORKER_MODEL_ROOT at a directory holding <root>/<hf id> copies, pass a local --model-path, or "
            "pre-download the model while online (`huggingface-cli download <id>`); offline mode (HF_HUB_OFFLINE=1) "
            "only finds models already in the HF cache"
        ),
        patterns=(
            r"Repository Not Found|RepositoryNotFoundError|is not a local folder and is not a valid model identifier",
            r"We couldn't connect to 'https://huggingface\.co'|LocalEntryNotFoundError|HFValidationError",
            r"Repo id must be in the form|GatedRepoError|EntryNotFoundError|RevisionNotFoundError",
            r"does not appear to have a file named config\.json|Can't load the configuration of",
            r"Cannot find any model weights|offline mode is enabled|HF_HUB_OFFLINE",
            r"(?:FileNotFoundError|No such file or directory)[^\n]*(?:config\.json|\.safetensors|tokenizer)",
        ),
        standalone_needs_exception=True,
        fatal=True,
    ),
    Rule(
        Kind.NCCL_ERROR,
        _nccl_summary,
        _fixed(
            "rerun with NCCL_DEBUG=INFO; check that CUDA_VISIBLE_DEVICES names the GPUs of this lease, that "
            "--nccl-port is pinned per worker (random NCCL ports collide between parallel workers), and in "
            "containers that peer access and /dev/shm are available"
        ),
        patterns=(
            r"NCCL error",
            r"\bnccl(?:InternalError|SystemError|UnhandledCudaError|InvalidUsage|InvalidArgument|RemoteError)\b",
            r"ProcessGroupNCCL[^\n]*(?:[Ee]rror|timed out|Watchdog caught|exception)",
            r"DistBackendError",
        ),
        warnings=(r"\bNCCL WARN\b",),
        fatal=True,
    ),
    Rule(
        Kind.SIM_FAULT,
        lambda f: f"the simulated engine refused its faults: {_clip(f.first.split('SGLSIM_FAULT: ', 1)[-1])}",
        _fixed("fix the SGLSIM_FAULT value (the faults and their values: python -m pytest_sglworker.sim --help)"),
        patterns=(r"\(sim\): error: SGLSIM_FAULT: ",),
        fatal=True,
    ),
    Rule(
        Kind.BAD_FLAG,
        _bad_flag_summary,
        _bad_flag_advice,
        patterns=(
            r"^[\w .\-/]+: error: (?:unrecognized arguments|argument [-\w/]+|the following arguments are required"
            r"|ambiguous option|one of the arguments|invalid choice)",
        ),
        fatal=True,
    ),
    Rule(
        Kind.GRAPH_CAPTURE_ERROR,
        _capture_error_summary,
        _capture_error_advice,
        patterns=CAPTURE_FAILED,
        # PyTorch's capture_end() after a failed capture: never the cause (see the diagnosis module docstring)
        symptoms=(r"markCaptureEnd called with no captures in progress|num_active_captures_ > 0",),
        symptom_role="cleanup",
        fallback=lambda scene: scene.capture is not None,
        fatal=True,
    ),
    Rule(
        Kind.KILLED_BY_SIGNAL,
        _killed_summary,
        lambda f: signal_advice(_killed_signum(f)),
        # engine.py's _scheduler_died_error and the launcher's child watcher
        symptoms=(
            r"scheduler died during initialization \(exit code: (-?\d+)\)|crashed with exit code (-?\d+)"
            r"|\bexited with (?:exit )?code (-\d+)",
        ),
        memory=True,
    ),
    Rule(
        Kind.WEB_WORKER_CRASH_LOOP,
        _web_worker_summary,
        _fixed(
            "with --tokenizer-worker-num above 1 the HTTP server runs that many uvicorn worker processes, and one that "
            "dies is restarted without a traceback of its own, again and again: run with --tokenizer-worker-num 1 "
            "to see the worker's own error; a worker killed with nothing logged is most often the host's OOM "
            "killer (CPU RAM: each worker holds a tokenizer), see `dmesg`"
        ),
        # uvicorn/supervisors/multiprocess.py, keep_subprocess_alive(): an INFO line, every restart
        patterns=(_WEB_WORKER_DIED,),
        repeats=True,
    ),
    Rule(Kind.UNKNOWN, _unknown_summary, _unknown_advice),
    Rule(Kind.NONE, _fixed("no error in the log"), _fixed("")),
)

FATAL_KINDS: frozenset[Kind] = frozenset(rule.kind for rule in RULES if rule.fatal)
MEMORY_KINDS: frozenset[Kind] = frozenset(rule.kind for rule in RULES if rule.memory)

_active: tuple[Rule, ...] = RULES
_by_kind: dict[Kind, Rule] = {}


def _index(rules: tuple[Rule, ...]) -> dict[Kind, Rule]:
    index: dict[Kind, Rule] = {}
    for rule in rules:
        if rule.kind in index:
            raise ValueError(f"two rules for kind {rule.kind.value}")
        index[rule.kind] = rule
    missing = [k.value for k in Kind if k not in index]
    if missing:
        raise ValueError(f"no rule for kind(s) {', '.join(missing)}")
    return index


_by_kind = _index(RULES)


def active_rules() -> tuple[Rule, ...]:
    """The records the diagnosis uses now (:data:`RULES` unless :func:`using_rules` is in effect)."""
    return _active


def rule_for(kind: Kind) -> Rule:
    return _by_kind[kind]


@contextmanager
def using_rules(rules: Iterable[Rule]) -> Iterator[tuple[Rule, ...]]:
    """Diagnose with ``rules`` (one per kind) inside the block; the pre-filter follows them. For tests."""
    global _active, _by_kind
    chosen = tuple(rules)
    saved = _active, _by_kind
    _active, _by_kind = chosen, _index(chosen)
    try:
        yield chosen
    finally:
        _active, _by_kind = saved
