"""What the GPU check's parts share: where its pieces are, its checks' names, a row of its table, an inner
session's outcome, and the helpers that read logs, JUnit files and event records. Part of the program
``check.py`` (run by path, not a module of the package)."""

from __future__ import annotations

import json
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The folder that holds the ``pytest_sglworker`` this check belongs to: a checkout, or site-packages.
PLUGIN_ROOT = HERE.parents[2]
INNER = HERE / "inner"
FAKE_DIR = HERE / "fake_nvml"
HOLDER = HERE / "holder.py"
SCHEMA = "pytest-sglworker/gpu-check/v1"
MIB = 1024 * 1024
#: As the lease code's release tolerance (LeaseManager.release_tolerance_mib).
TOLERANCE_MIB = 256
SAMPLE_INTERVAL_S = 0.02
CHECKS = (
    "environment", "nvml_inventory", "lease_visibility", "nvml_process_ids", "ledger_input", "lease_exclusivity",
    "release_wait", "sigkill_teardown", "torch_view", "sglang_launch", "leftovers",
)
MAX_VISIBILITY_GPUS = 8
RUN_ENV = "GPU_CHECK_RUN"



@dataclass
class Row:
    check: str
    status: str  # pass | fail | warn | skip | info
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Session:
    name: str
    rc: int | None
    timed_out: bool
    seconds: float
    outcomes: dict[str, tuple[str, str]]
    output: str
    started: float
    ended: float

    @property
    def passed(self) -> bool:
        return self.rc == 0 and not self.timed_out and all(o == "passed" for o, _ in self.outcomes.values())

    def problem(self) -> str:
        """One line: the first clear error of the session."""
        if self.timed_out:
            return f"session {self.name} ran past its deadline ({self.seconds:.0f} s) and was stopped; " + \
                (first_error(self.output) or "no error line")
        bad = [(n, o, m) for n, (o, m) in self.outcomes.items() if o not in ("passed", "skipped")]
        holder = first_holder_error(self.output + "\n".join(m for _, _, m in bad))
        if bad:
            name, outcome, message = bad[0]
            return f"{name} {outcome}: " + (holder or first_error(message) or first_error(self.output) or "?")
        if self.rc not in (0, None):
            return f"session {self.name} exited {self.rc}: " + (holder or first_error(self.output) or "no error line")
        if not self.outcomes:
            return f"session {self.name} ran no test: " + (first_error(self.output) or "no error line")
        return ""


def clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_holder_error(text: str) -> str:
    for line in text.splitlines():
        if "[gpu-check holder] ERROR:" in line:
            return clip("holder: " + line.split("[gpu-check holder] ERROR: ", 1)[1])
    return ""


def first_error(text: str) -> str:
    if not text:
        return ""
    lines = text.splitlines()
    for line in lines:
        s = line.strip()
        if s.startswith("E ") and len(s) > 2:
            return clip(s[1:].strip())
    for line in lines:
        s = line.strip()
        if re.match(r"^(ERROR|Failed|AssertionError|[A-Za-z_.]*Error\b)", s):
            return clip(s)
    for line in lines:
        if line.strip() and not line.startswith(("=", "-", "_")):
            return clip(line)
    return ""


def parse_junit(path: Path) -> dict[str, tuple[str, str]]:
    """``{test name: (outcome, message)}``; the worst outcome of a test's phases wins."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    result: dict[str, tuple[str, str]] = {}
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        outcome, message = "passed", ""
        for child in case:
            tag = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if tag is None:
                continue
            text = (child.get("message") or "") + "\n" + (child.text or "")
            if rank[tag] > rank[outcome]:
                outcome, message = tag, text
        previous = result.get(name)
        if previous is None or rank[outcome] > rank[previous[0]]:
            result[name] = (outcome, message)
    return result


# ------------------------------------------------------------------------------------------------ analysis helpers


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _optional(nvml: Any, name: str, *args: Any) -> Any:
    """An NVML reading that may be missing (old nvidia-ml-py, the fake) or unsupported: None then."""
    fn = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        value = fn(*args)
    except Exception:
        return None
    return list(value) if isinstance(value, (list, tuple)) else value


def _signed(value: float) -> str:
    return f"{value:+.2f}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data
    except (OSError, ValueError):
        return None


def _card_for(name: str, total: int, cards: Mapping[str, int]) -> str | None:
    """The card table entry for an NVML name (``NVIDIA H200`` -> ``H200``), the closest in size among those
    whose model matches."""
    norm = "".join(c for c in name.lower() if c.isalnum())
    candidates = [c for c in cards if "".join(ch for ch in c.lower().split("-")[0] if ch.isalnum()) in norm]
    if not candidates:
        return None
    return min(candidates, key=lambda c: abs(cards[c] - total))


def _lease_intervals(events: Iterable[dict[str, Any]], index: int) -> list[tuple[float, float, str]]:
    acquired = {e["lease"]: e for e in events if e.get("event") == "lease_acquired" and index in e.get("indices", [])}
    out = []
    for e in events:
        if e.get("event") == "lease_released" and e.get("lease") in acquired:
            out.append((acquired[e["lease"]]["t"], e["t"], e["lease"]))
    return out


def _holder_intervals(events: Iterable[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for e in events:
        if e.get("source") != "holder":
            continue
        if e.get("event") == "allocated":
            start[e["pid"]] = e["t"]
        elif e.get("event") == "exit":
            end[e["pid"]] = e["t"]
    return {pid: (t, end.get(pid, float("inf"))) for pid, t in start.items()}


def _max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda p: (p[0], p[1]))
    best = current = 0
    for _, delta in points:
        current += delta
        best = max(best, current)
    return best


_PHASE_MARKERS = (
    ("server args", "server_args="), ("load weights", "Load weight begin"), ("weights loaded", "Load weight end"),
    ("KV pool", "KV Cache is allocated"), ("graph capture", "Capture cuda graph begin"),
    ("graphs captured", "Capture cuda graph end"), ("max_total_num_tokens", "max_total_num_tokens="),
    ("HTTP up", "Uvicorn running on"), ("ready", "The server is fired up and ready to roll!"),
)
_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def _startup_phases(log_text: str) -> list[dict[str, Any]]:
    """First line of each startup phase in an sglang log, with seconds since the first timestamped line."""
    first_stamp: float | None = None
    found: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, line in enumerate(log_text.splitlines(), 1):
        stamp = _STAMP.search(line)
        at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) if stamp else None
        if at is not None and first_stamp is None:
            first_stamp = at
        for phase, marker in _PHASE_MARKERS:
            if phase not in seen and marker in line:
                seen.add(phase)
                found.append({"phase": phase, "line": number,
                              "after_s": None if at is None or first_stamp is None else at - first_stamp})
    return found


def _newest_log(folder: Path, prefix: str) -> str | None:
    logs = sorted(folder.glob(f"{prefix}*.log"), key=lambda p: p.stat().st_mtime)
    return str(logs[-1]) if logs else None


# ------------------------------------------------------------------------------------------------ NVML sampling


class Sampler(threading.Thread):
    """Polls NVML every ``interval`` s. Keeps, per GPU, only the readings that differ from the one before,
    each with the time of the poll before it: ``(t_seen, t_previous_poll, free_mib, pids)``."""

    def __init__(self, nvml: Any, indices: Sequence[int], interval: float = SAMPLE_INTERVAL_S) -> None:
        super().__init__(name="gpu-check-nvml-sampler", daemon=True)
        self.nvml = nvml
        self.indices = list(indices)
        self.interval = interval
        self.changes: dict[int, list[tuple[float, float, int, tuple[int, ...]]]] = {i: [] for i in self.indices}
        self.polls = 0
        self.error: str | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._last_poll: dict[int, float] = {}

    def read(self, index: int) -> tuple[int, tuple[int, ...]]:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        free = int(nvml.nvmlDeviceGetMemoryInfo(handle).free) // MIB
        try:
            pids = tuple(sorted(int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)))
        except nvml.NVMLError:
            pids = ()
        return free, pids

    def run(self) -> None:
        while not self._stop_event.is_set():
            for index in self.indices:
                try:
                    free, pids = self.read(index)
                except Exception as exc:
                    self.error = f"NVML failed while sampling GPU {index}: {exc}"
                    return
                now = time.time()
                with self._lock:
                    history = self.changes[index]
                    if not history or history[-1][2:] != (free, pids):
                        history.append((now, self._last_poll.get(index, now), free, pids))
                    self._last_poll[index] = now
            self.polls += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def history(self, index: int) -> list[tuple[float, float, int, tuple[int, ...]]]:
        with self._lock:
            return list(self.changes.get(index, []))

    def state_at(self, index: int, t: float) -> tuple[int, tuple[int, ...]] | None:
        state = None
        for seen, _, free, pids in self.history(index):
            if seen > t:
                break
            state = (free, pids)
        return state

    def freed_after(self, index: int, since: float, until: float,
                    free: Callable[[int, tuple[int, ...]], bool]) -> tuple[float, float] | None:
        """When the readings, busy at or after ``since`` (``free`` false), first turned free again:
        ``(t_first_seen_free, t_last_poll_seen_busy)``; None if that is not seen up to ``until``."""
        history = self.history(index)
        busy_seen = False
        start = 0
        for i, record in enumerate(history):  # the reading in effect at ``since`` counts
            if record[0] <= since:
                start = i
        for record in history[start:]:
            if record[0] > until:
                return None
            if not free(record[2], record[3]):
                busy_seen = True
            elif busy_seen:
                return record[0], record[1]
        return None

    def window(self, index: int, start: float, end: float) -> list[tuple[float, int, tuple[int, ...]]]:
        """States in effect during ``[start, end]`` (the one at ``start`` included)."""
        out: list[tuple[float, int, tuple[int, ...]]] = []
        for seen, _, free, pids in self.history(index):
            if seen <= start:
                out = [(seen, free, pids)]
            elif seen <= end:
                out.append((seen, free, pids))
        return out
