"""The run report (``--sgl-report``), and the timeline and trace drawn from it: the figures and launch records
of this process and of the xdist workers (sent as plain dicts), merged, and each artifact written atomically.

The JSON schema is in the docs (docs/explanation/run-report.md); :mod:`.timeline` renders the HTML page and the
Chrome trace from the same dict.

Tests are counted as pytest's terminal summary counts them: every report of a test phase in the category pytest's
``pytest_report_teststatus`` gives it (a failing setup or teardown is an error, a failing call a failure, a passing
setup or teardown no category), so a test whose call passed and whose teardown failed (its worker died during it)
is one passed and one error, as pytest says. A test's own outcome, the one its spans on the launch records get, is
the worst of its categories.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..workers.records import ConfigStats

__all__ = ["OUTCOME_KEYS", "SCHEMA", "apply_test_outcomes", "merge_launches", "merge_stats", "outcome_counts",
           "test_outcome", "write_artifact", "write_json"]

SCHEMA = "pytest-sglworker/report/v1"


def merge_stats(sources: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, ConfigStats]:
    """Merge the ``as_dict`` figures of several processes, by configuration key."""
    merged: dict[str, ConfigStats] = {}
    for source in sources:
        for key, data in source.items():
            stats = ConfigStats.from_dict(data)
            if key in merged:
                merged[key].merge(stats)
            else:
                merged[key] = stats
    return merged


def merge_launches(sources: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """All processes' launch records, ordered by start."""
    launches = [dict(r) for source in sources for r in source]
    return sorted(launches, key=lambda r: (r.get("t_lease_requested") or r.get("t_started") or 0.0, r["id"]))


#: a test's outcome from its phases' categories: the first of these it has
_WORST_FIRST = ("failed", "error", "xpassed", "xfailed", "skipped", "passed")
#: pytest's category -> the key of the report's ``outcomes`` (``RunResult.parseoutcomes`` names: ``errors``)
OUTCOME_KEYS = {"passed": "passed", "failed": "failed", "error": "errors", "skipped": "skipped",
                "xfailed": "xfailed", "xpassed": "xpassed"}


def test_outcome(categories: Sequence[str]) -> str | None:
    """The outcome of one test from the categories of its phases (None when it has none: interrupted before its
    call had a report)."""
    found = [c for c in _WORST_FIRST if c in categories]
    if found:
        return found[0]
    return next(iter(categories), None)


def outcome_counts(categories: Sequence[Sequence[str]]) -> dict[str, int]:
    """Every test's categories counted as pytest's summary line counts them: ``passed``, ``failed``, ``errors``
    and ``skipped`` always, other categories (``xfailed``, ``xpassed``, ``rerun``, ...) when present."""
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for test in categories:
        for category in test:
            key = OUTCOME_KEYS.get(category, category)
            counts[key] = counts.get(key, 0) + 1
    return counts


def apply_test_outcomes(launches: Sequence[dict[str, Any]], outcomes: Mapping[str, str]) -> None:
    """Each test span of the launch records gets its test's outcome as pytest reported it (a worker that died
    during a passing call makes its teardown an error: the span says ``error``, not the call's ``passed``)."""
    for launch in launches:
        spans = launch.get("tests")
        if isinstance(spans, list):
            launch["tests"] = [{**span, "outcome": outcomes.get(span.get("nodeid"), span.get("outcome"))}
                               for span in spans]


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    """``--sgl-report PATH``: the run report as JSON (schema in docs/explanation/run-report.md), written atomically
    (a failed write leaves the previous file, never a partial one), mode 0644."""
    from ..resources.state import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(report, indent=2, sort_keys=True) + "\n")


def write_artifact(name: str, path: Path, report: Mapping[str, Any]) -> None:
    """Write one artifact of the run: ``report`` (the JSON), ``timeline`` (the HTML page) or ``trace`` (Chrome
    trace-event JSON), atomically; OSError and ValueError say why it could not be written."""
    if name == "report":
        write_json(path, report)
    elif name == "timeline":
        from .timeline import write_html

        write_html(path, report)
    else:
        from .timeline import write_trace

        write_trace(path, report)

