"""What an sglang worker's log says as it starts: how far it got (:func:`startup_phase`, cheap enough for every
health poll) and its memory lines (the KV pool's tokens, the weights' memory: :func:`parse_memory`), read for the
live status line and for comparing a run with the memory ledger's prediction.

Plain Python, stdlib only. The first error of a failed log is :mod:`.diagnosis`'s.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["INFERENCE_PATHS", "LOAD_BEGIN", "LOAD_END", "READY_LINE", "LogMemory", "ServedCounter",
           "parse_kv_tokens", "parse_max_total_tokens", "parse_memory",
           "startup_phase", "startup_phase_from_file"]

#: sglang's weight-loading lines (``Load weight begin. avail mem=X GB`` and its end)
LOAD_BEGIN = "Load weight begin"
LOAD_END = "Load weight end"

#: the engine's last startup line: it is serving
READY_LINE = "The server is fired up and ready to roll!"

_PHASES: tuple[tuple[str, str], ...] = (
    (READY_LINE, "ready"),
    ("Uvicorn running on", "warming up"),
    ("Application startup complete", "starting HTTP server"),
    ("Started server process", "starting HTTP server"),
    ("max_total_num_tokens=", "starting HTTP server"),
    ("graph begin", "capturing CUDA graphs"),
    ("Memory pool end", "allocating KV pool"),
    ("KV Cache is allocated", "allocating KV pool"),
    (LOAD_END, "allocating KV pool"),
    (LOAD_BEGIN, "loading weights"),
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
LOAD_BEGIN_LINE = re.compile(r"Load weight begin\. avail mem=([\d.]+) GB")
LOAD_END_LINE = re.compile(r"Load weight end\..*?avail mem=([\d.]+) GB, mem usage=(-?[\d.]+) GB")


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
    begin = _last(LOAD_BEGIN_LINE, log_text)
    end = _last(LOAD_END_LINE, log_text)
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


# ---------------------------------------------------------------------------------------------- access lines

#: sglang's HTTP routes that run inference (what a router sends a worker)
INFERENCE_PATHS = frozenset({
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/encode", "/classify", "/v1/rerank",
    "/v1/score", "/v1/responses",
})
#: uvicorn's access line at log level info: ``INFO:     127.0.0.1:50202 - "POST /generate HTTP/1.1" 200 OK``
_ACCESS_LINE = re.compile(rb'INFO: +\S+ - "(?P<method>[A-Z]+) (?P<path>/[^ ?"]*)[^"]*" (?P<status>\d{3})')


class ServedCounter:
    """A worker's inference requests, counted from its own log: uvicorn's access lines (log level info, the
    engine's default) for :data:`INFERENCE_PATHS` from ``start`` (the log's size when the worker was found
    ready: its own warm-up request is logged before it answers ready), else after the engine's ready line. Not the
    ready line alone: the engine answers ready a moment before it logs that line, so a test's first request can
    be logged before it. The real engine and the simulated one write the same lines, so a routing test that
    counts this way runs unchanged on both. The log is read on from where the last :meth:`update` stopped.

    Not thread-safe: one counter per worker, used by the thread that asks."""

    def __init__(self, path: str | os.PathLike[str], start: int | None = None) -> None:
        self.path = Path(path)
        self._offset = start or 0
        self._partial = b""
        self._ready = start is not None
        #: answered with a 2xx status, by path
        self.served: dict[str, int] = {}
        #: answered with another status (4xx, 5xx), by path
        self.refused: dict[str, int] = {}

    @property
    def ready_seen(self) -> bool:
        return self._ready

    def update(self) -> int:
        """Read what the log gained; returns the requests served so far (2xx answers)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            data = b""
        if data:
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()  # a line still being written
            ready = READY_LINE.encode()
            for line in lines:
                if not self._ready:
                    self._ready = ready in line
                    continue
                found = _ACCESS_LINE.search(line)
                if found is None:
                    continue
                path = found.group("path").decode("ascii", "replace")
                if path not in INFERENCE_PATHS:
                    continue
                into = self.served if found.group("status").startswith(b"2") else self.refused
                into[path] = into.get(path, 0) + 1
        return sum(self.served.values())
