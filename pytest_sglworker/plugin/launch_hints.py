"""The xdist controller's word to one xdist worker about launching ahead (``ahead-<worker id>.json`` in the run's
private directory that ``workerinput`` names): the configurations to launch ahead now, in the order the xdist worker
will take their tests, and the configurations whose tests have all run, whose idle workers to let go. Written by the
scheduler (:mod:`.xdist_scheduling`), read by the xdist worker's session between tests and while its pool waits for
a launch. A pytest-facing module of plain functions: it imports only :mod:`.keys`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .keys import MAP_INPUT, xdist_worker_id

#: the schema of the word
AHEAD_SCHEMA = "pytest-sglworker/xdist-launch-ahead/v2"


def write_launch_hint(directory: Path | None, worker: str, keys: Sequence[str], drop: Sequence[str]) -> None:
    """On the controller: tell xdist worker ``worker`` to launch the configurations ``keys`` ahead (in that order),
    and to let the idle workers of the configurations ``drop`` go (every test of theirs is handed out)."""
    if directory is None or not directory.is_dir():
        return
    from ..resources.state import atomic_write

    try:
        atomic_write(directory / f"ahead-{worker}.json",
                     json.dumps({"schema": AHEAD_SCHEMA, "configurations": list(keys), "drop": list(drop)}), mode=0o600)
    except OSError:
        pass  # launching ahead is an optimisation: the configuration starts with its first test


def read_launch_hint(config: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """On an xdist worker: the configurations the controller last told it to launch ahead (in order), and those
    whose idle workers to let go. A claim of the run's private directory: it names the worker's own configurations
    or is ignored."""
    workerinput = getattr(config, "workerinput", None)
    if not isinstance(workerinput, dict) or not workerinput.get(MAP_INPUT):
        return (), frozenset()
    try:
        data = json.loads((Path(workerinput[MAP_INPUT]) / f"ahead-{xdist_worker_id(config)}.json").read_text())
    except (OSError, ValueError):
        return (), frozenset()
    if not isinstance(data, dict) or data.get("schema") != AHEAD_SCHEMA:
        return (), frozenset()
    keys, drop = data.get("configurations"), data.get("drop")
    dropped = frozenset(k for k in drop if isinstance(k, str)) if isinstance(drop, list) else frozenset()
    ahead = tuple(k for k in keys if isinstance(k, str) and k not in dropped) if isinstance(keys, list) else ()
    return ahead, dropped
