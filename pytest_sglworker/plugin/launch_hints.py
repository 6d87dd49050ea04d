"""The xdist controller's word to one xdist worker about launching ahead (``ahead-<worker id>.json`` in the run's
private directory that ``workerinput`` names): the configurations to launch ahead now, in the order the xdist worker
will take their tests, the configurations whose tests have all run, whose idle workers to let go, each configuration's
last test sent to this worker (``last``: its group goes as that test ends), and the groups
handed over within the run (issue 43): those launched ahead here whose tests went to another xdist worker (``hand``),
and those another xdist worker launched ahead whose tests come here (``adopt``: key -> the giver's id). Written by the
scheduler (:mod:`.xdist_scheduling`), read by the xdist worker's session between tests and while its pool waits for
a launch. A giver's answer, whether it handed its group over to the run, is a file of its own
(``handed-<giver>-<digest>.json``) that the taker waits for (:class:`RunHandOver`, the pool's
:class:`~..workers.pool_warm.HandOver`). A pytest-facing module of plain functions: it imports :mod:`.keys` and the
atomic write of ``resources``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..resources.state import atomic_write
from .keys import MAP_INPUT, xdist_worker_id

#: the schema of the word
AHEAD_SCHEMA = "pytest-sglworker/xdist-launch-ahead/v4"
#: the schema of a giver's answer
ANSWER_SCHEMA = "pytest-sglworker/xdist-hand-over/v1"


def write_launch_hint(directory: Path | None, worker: str, keys: Sequence[str], drop: Sequence[str],
                      hand: Sequence[str] = (), adopt: Mapping[str, str] | None = None,
                      last: Mapping[str, str] | None = None) -> None:
    """On the controller: tell xdist worker ``worker`` to launch the configurations ``keys`` ahead (in that order),
    to let the idle workers of the configurations ``drop`` go (every test of theirs is handed out), to hand its groups
    launched ahead of ``hand`` over to the run, to adopt the groups of ``adopt`` (key -> the xdist worker id of the
    giver, which launched it ahead), and to let a group go right after its configuration's last test here (``last``:
    key -> that test's node id; every test of the configuration is handed out)."""
    if directory is None or not directory.is_dir():
        return
    try:
        atomic_write(directory / f"ahead-{worker}.json",
                     json.dumps({"schema": AHEAD_SCHEMA, "configurations": list(keys), "drop": list(drop),
                                 "hand": list(hand), "adopt": dict(adopt or {}), "last": dict(last or {})}),
                     mode=0o600)
    except OSError:
        pass  # launching ahead is an optimisation: the configuration starts with its first test


def _run_dir(config: Any) -> Path | None:
    workerinput = getattr(config, "workerinput", None)
    if not isinstance(workerinput, dict) or not workerinput.get(MAP_INPUT):
        return None
    return Path(workerinput[MAP_INPUT])


def _read_hint(directory: Path | None, worker: str | None) -> dict[str, Any] | None:
    if directory is None:
        return None
    try:
        data = json.loads((directory / f"ahead-{worker}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == AHEAD_SCHEMA else None


def _answer_path(directory: Path, giver: str, key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return directory / f"handed-{''.join(c for c in giver if c.isalnum())}-{digest}.json"


class RunHandOver:
    """The pool's word on groups handed over within the run (:class:`~..workers.pool_warm.HandOver`): the groups this
    xdist worker hands over and those it adopts, read from its hint file, and the givers' answers beside it."""

    def __init__(self, config: Any) -> None:
        self.directory = _run_dir(config)
        self.worker = xdist_worker_id(config)

    def _adopt(self) -> dict[str, str]:
        data = _read_hint(self.directory, self.worker)
        adopt = data.get("adopt") if data is not None else None
        return {k: v for k, v in adopt.items() if isinstance(k, str) and isinstance(v, str)} \
            if isinstance(adopt, dict) else {}

    def to_hand_over(self) -> tuple[str, ...]:
        data = _read_hint(self.directory, self.worker)
        hand = data.get("hand") if data is not None else None
        return tuple(k for k in hand if isinstance(k, str)) if isinstance(hand, list) else ()

    def answer(self, key: str, published: bool) -> None:
        if self.directory is None or self.worker is None:
            return
        try:
            atomic_write(_answer_path(self.directory, self.worker, key),
                         json.dumps({"schema": ANSWER_SCHEMA, "key": key, "handed": published}), mode=0o600)
        except OSError:
            pass  # a taker stops waiting at its lease timeout, and launches its own

    def expects(self, key: str) -> bool:
        return key in self._adopt()

    def awaited(self, key: str) -> bool | None:
        giver = self._adopt().get(key)
        if giver is None or self.directory is None:
            return None
        try:
            data = json.loads(_answer_path(self.directory, giver, key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("schema") != ANSWER_SCHEMA or data.get("key") != key:
            return None
        return bool(data.get("handed"))


def read_launch_hint(config: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """On an xdist worker: the configurations the controller last told it to launch ahead (in order), and those
    whose idle workers to let go. A claim of the run's private directory: it names the worker's own configurations
    or is ignored."""
    return read_hint_file(_run_dir(config), xdist_worker_id(config))


def last_tests(config: Any) -> dict[str, str]:
    """On an xdist worker: configuration key -> the node id of the last test of it that the controller sends here (its
    tests are all handed out); empty elsewhere. A claim: only a test this worker runs, of that configuration, acts on
    it."""
    data = _read_hint(_run_dir(config), xdist_worker_id(config))
    last = data.get("last") if data is not None else None
    return {k: v for k, v in last.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(last, dict) \
        else {}


def hint_place(config: Any) -> tuple[Path, str] | None:
    """On an xdist worker of a run whose controller writes launch hints: the run's private directory and this
    worker's id (what a thread that reads the hints is handed; read on the main thread)."""
    directory, worker = _run_dir(config), xdist_worker_id(config)
    return None if directory is None or worker is None else (directory, worker)


def read_hint_file(directory: Path | None, worker: str | None) -> tuple[tuple[str, ...], frozenset[str]]:
    """:func:`read_launch_hint` from the run's directory and the worker's id: plain values, any thread."""
    return _words(_read_hint(directory, worker))


def read_follow_words(directory: Path | None, worker: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a follower thread of the word reads, in one read (plain values, any thread): the configurations to launch
    ahead (as :func:`read_hint_file`), and the groups launched ahead here to hand over (``hand``)."""
    data = _read_hint(directory, worker)
    hand = data.get("hand") if data is not None else None
    return _words(data)[0], tuple(k for k in hand if isinstance(k, str)) if isinstance(hand, list) else ()


def _words(data: dict[str, Any] | None) -> tuple[tuple[str, ...], frozenset[str]]:
    if data is None:
        return (), frozenset()
    keys, drop = data.get("configurations"), data.get("drop")
    dropped = frozenset(k for k in drop if isinstance(k, str)) if isinstance(drop, list) else frozenset()
    ahead = tuple(k for k in keys if isinstance(k, str) and k not in dropped) if isinstance(keys, list) else ()
    return ahead, dropped
