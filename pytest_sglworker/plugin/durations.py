"""What earlier runs measured, for the xdist scheduler's order (issue 33): each worker configuration's startup and
each test's duration, kept in pytest's cache (``config.cache``, the directory ``--lf`` and ``--cache-show`` use;
nothing is read or written under ``-p no:cacheprovider``).

The scheduler (:mod:`.xdist_scheduling`) starts the configuration with the most work first (longest processing
time first: its startup plus its tests' durations), so that a long startup does not begin last and run alone at the
end of the run; without history it goes by test count. The controller writes what this run measured at its end,
from the launch records the xdist workers sent (the run report's): each test's call (its span on the worker it
used; its setup, where a launch may wait, left out) and each configuration's startup (process started ->
ready). Entries of tests and configurations this run did not see are kept (a run of a subset keeps the rest's
history), up to :data:`LIMIT`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["CACHE_KEY", "LIMIT", "History", "estimates", "load_history", "measured", "save_history"]

CACHE_KEY = "sglworker/durations"
SCHEMA = 1
#: test entries kept at most (the most recently measured win)
LIMIT = 20000


@dataclass
class History:
    """Seconds measured by earlier runs: ``tests`` by node id, ``startups`` by configuration key."""

    tests: dict[str, float] = field(default_factory=dict)
    startups: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tests or self.startups)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        return None
    return float(value)


def _cache(config: pytest.Config) -> Any:
    return getattr(config, "cache", None)  # absent under -p no:cacheprovider


def load_history(config: pytest.Config) -> History | None:
    """The history in pytest's cache (None: no cache, nothing kept, or an entry that is not ours)."""
    cache = _cache(config)
    if cache is None:
        return None
    try:
        data = cache.get(CACHE_KEY, None)
    except Exception:  # an unreadable cache is no history
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    history = History()
    for name, target in (("tests", history.tests), ("startups", history.startups)):
        entries = data.get(name)
        if isinstance(entries, dict):
            for key, value in entries.items():
                seconds = _seconds(value)
                if isinstance(key, str) and seconds is not None:
                    target[key] = seconds
    return history or None


def measured(launches: Iterable[Mapping[str, Any]]) -> History:
    """What a run's launch records measured: each test's call (the longest of its spans: a group's members all
    serve it) and each configuration's startup (the median over its launches that became ready, process
    started -> ready; a group's is its slowest member's)."""
    found = History()
    groups: dict[tuple[str, str], float] = {}
    for record in launches:
        key = record.get("config")
        if record.get("role") == "router" or not isinstance(key, str):
            continue
        for span in record.get("tests") or ():
            start, end, nodeid = _seconds(span.get("t_start")), _seconds(span.get("t_end")), span.get("nodeid")
            if isinstance(nodeid, str) and start is not None and end is not None:
                found.tests[nodeid] = max(found.tests.get(nodeid, 0.0), max(0.0, end - start))
        started, ready = _seconds(record.get("t_started")), _seconds(record.get("t_ready"))
        if record.get("outcome") != "ok" or started is None or ready is None:
            continue
        where = (key, str(record.get("group") or record.get("id")))
        groups[where] = max(groups.get(where, 0.0), max(0.0, ready - started))
    per_key: dict[str, list[float]] = {}
    for (key, _), seconds in groups.items():
        per_key.setdefault(key, []).append(seconds)
    found.startups = {key: statistics.median(values) for key, values in per_key.items()}
    return found


def save_history(config: pytest.Config, launches: Iterable[Mapping[str, Any]]) -> None:
    """Merge what this run's launch records measured into the cache (nothing without a cache or measurements)."""
    cache = _cache(config)
    if cache is None:
        return
    new = measured(launches)
    if not new:
        return
    old = load_history(config) or History()
    tests = {k: v for k, v in old.tests.items() if k not in new.tests}
    tests.update({k: round(v, 4) for k, v in new.tests.items()})
    if len(tests) > LIMIT:
        tests = dict(list(tests.items())[-LIMIT:])
    startups = {**old.startups, **{k: round(v, 4) for k, v in new.startups.items()}}
    try:
        cache.set(CACHE_KEY, {"schema": SCHEMA, "tests": tests, "startups": startups})
    except Exception:  # a cache that cannot be written costs the next run its order, nothing else
        pass


def estimates(nodeids: Sequence[str], keys: Sequence[str | None], history: History | None
              ) -> tuple[list[float | None], dict[str, float]] | None:
    """Per collection index, the test's duration from history (None: unknown), and the startups; None without
    history of any of these tests or configurations."""
    if not history:
        return None
    tests = [history.tests.get(nodeid) for nodeid in nodeids]
    startups = {k: history.startups[k] for k in {k for k in keys if k is not None} if k in history.startups}
    if not startups and all(t is None for t in tests):
        return None
    return tests, startups
