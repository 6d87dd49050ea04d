"""The goals every failure text of the plugin meets (the golden corpus of tests/acceptance/test_failure_texts.py,
and the real CPU engine's crash in the real-engine tier)."""

from __future__ import annotations

#: at most this many lines at the default tail (40 lines)
MAX_LINES = 60
#: the first cause within the first this many lines
CAUSE_WITHIN = 3


def check_goals(name: str, text: str, cause: str) -> tuple[int, int]:
    """The goals of every entry; returns (lines, line of the first cause)."""
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"{name}: {len(lines)} lines (at most {MAX_LINES})\n{text}"
    at = next((i + 1 for i, line in enumerate(lines) if cause in line), None)
    assert at is not None and at <= CAUSE_WITHIN, f"{name}: the cause ({cause!r}) is not in the first lines\n{text}"
    own = [line for line in lines if line and not line.startswith(" ")]  # the plugin's lines, not the log's
    repeated = sorted({line for line in own if own.count(line) > 1})
    assert not repeated, f"{name}: said twice: {repeated}\n{text}"
    assert text.count(lines[0]) == 1, f"{name}: the headline is said twice\n{text}"
    tails = [i for i, line in enumerate(lines) if line.startswith("last lines of the log")]
    assert len(tails) <= 1, f"{name}: a log tail is shown twice\n{text}"
    return len(lines), at
