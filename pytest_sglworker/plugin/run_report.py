"""The run report (``--sgl-report``), and the timeline and trace drawn from it: the figures and launch records
of this process and of the xdist workers (sent as plain dicts), merged, and each artifact written atomically.

The JSON schema is in the README; :mod:`.timeline` renders the HTML page and the Chrome trace from the same dict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..workers.records import ConfigStats

__all__ = ["SCHEMA", "merge_launches", "merge_stats", "write_artifact", "write_json"]

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


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    """``--sgl-report PATH``: the run report as JSON (schema in the README), written atomically (a failed
    write leaves the previous file, never a partial one), mode 0644."""
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

