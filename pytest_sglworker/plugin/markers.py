"""The plugin's markers as typed, validated objects.

``@pytest.mark.sgl_worker(...)``, ``@pytest.mark.sgl_workers(...)``, ``@pytest.mark.sgl_router(...)``,
``@pytest.mark.sgl_requires(...)`` and ``@pytest.mark.sgl_budget_opt_out(reason=...)``: each maps onto a
frozen dataclass; an unknown keyword or a bad value raises :class:`MarkerError` naming the marker and the
fix, which the session turns into an error of that test (never of the whole session).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from .keys import ITEM_ERROR_KEY

WORKER_MARKER_DOC = (
    "sgl_worker(args=(), env=None, fresh=False, startup_timeout=None, allow_foreign_host=None): "
    "extra sglang args and env for this test's sgl_worker; fresh=True for an unshared worker"
)
WORKERS_MARKER_DOC = (
    "sgl_workers(count=N | prefill=P, decode=D, args=(), env=None, fresh=False, startup_timeout=None, "
    "worker_args=(), prefill_args=(), decode_args=(), worker_env=None, prefill_env=None, decode_env=None): "
    "the worker group of this test's sgl_workers; a role's args (or env) are a list (a dict) for all its members, "
    "or a list of lists (of dicts), one per member"
)
ROUTER_MARKER_DOC = (
    "sgl_router(policy=None, args=(), startup_timeout=None, workers='all', dp_aware=None, "
    "scope='function'): the real sglang router in front of this test's sgl_workers: started with all of them, "
    "'none', the first N or a list of member indices; --policy as given (default: the router's own, e.g. "
    "policy='round_robin'); --dp-aware as asked (default: when a worker runs dp); one router per test, or per "
    "'class' or 'module'"
)
REQUIRES_MARKER_DOC = "sgl_requires(*features): skip models whose spec lacks one of these features"
OPT_OUT_MARKER_DOC = (
    "sgl_budget_opt_out(reason): allow this test's extra args to raise --mem-fraction-static or re-enable "
    "the prefill CUDA graph; the reason is required and shown in the report"
)
MARKER_DOCS = (WORKER_MARKER_DOC, WORKERS_MARKER_DOC, ROUTER_MARKER_DOC, REQUIRES_MARKER_DOC, OPT_OUT_MARKER_DOC)


class MarkerError(ValueError):
    """A marker with an unknown keyword or a bad value."""


def _kwargs(mark: pytest.Mark, known: set[str]) -> Mapping[str, Any]:
    if mark.args:
        raise MarkerError(f"{mark.name} takes keyword arguments only, e.g. @pytest.mark.{mark.name}(args=[...])")
    unknown = sorted(set(mark.kwargs) - known)
    if unknown:
        raise MarkerError(f"{mark.name} got unknown argument(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    return mark.kwargs


def _args(name: str, key: str, value: Any) -> tuple[str, ...]:
    value = value or ()
    if isinstance(value, str):
        raise MarkerError(f"{name}({key}=...) must be a list of arguments, not the string {value!r}")
    if not isinstance(value, (list, tuple)):
        raise MarkerError(f"{name}({key}=...) must be a list of arguments, got {value!r}")
    if not all(isinstance(a, str) for a in value):
        raise MarkerError(f"{name}({key}=...) must contain strings only, got {list(value)!r}")
    return tuple(value)


def _env(name: str, value: Any) -> dict[str, str]:
    value = value or {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise MarkerError(f"{name}(env=...) must be a dict of strings to strings")
    return dict(value)


def _flag(name: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise MarkerError(f"{name}({key}=...) must be True or False, got {value!r}")
    return value


def _timeout(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        # NaN too: it would never time out
        raise MarkerError(f"{name}(startup_timeout=...) must be a positive number of seconds, got {value!r}")
    return float(value)


#: the most members one worker group may have, whatever the inventory: far beyond any machine or cluster a test
#: suite leases, low enough that the per-member work at collection (each member's argv checked) stays small
MAX_GROUP_MEMBERS = 1024


def _count(name: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MarkerError(f"{name}({key}=...) must be a whole number, got {value!r}")
    if value > MAX_GROUP_MEMBERS:
        raise MarkerError(f"{name}({key}={value}) asks for more than {MAX_GROUP_MEMBERS} workers, the most one group "
                          "may have (each member is a process with GPUs of its own): give a smaller number")
    return value


@dataclass(frozen=True)
class WorkerMarker:
    """``@pytest.mark.sgl_worker(...)`` as a typed object."""

    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    fresh: bool = False
    startup_timeout: float | None = None
    allow_foreign_host: str | None = None

    @classmethod
    def from_mark(cls, mark: pytest.Mark | None) -> WorkerMarker:
        if mark is None:
            return cls()
        kw = _kwargs(mark, {"args", "env", "fresh", "startup_timeout", "allow_foreign_host"})
        foreign = kw.get("allow_foreign_host")
        if foreign is not None and (not isinstance(foreign, str) or not foreign.strip()):
            raise MarkerError("sgl_worker(allow_foreign_host=...) must be a non-empty reason string")
        return cls(_args("sgl_worker", "args", kw.get("args")), _env("sgl_worker", kw.get("env")),
                   _flag("sgl_worker", "fresh", kw.get("fresh", False)),
                   _timeout("sgl_worker", kw.get("startup_timeout")), foreign)


@dataclass(frozen=True)
class WorkersMarker:
    """``@pytest.mark.sgl_workers(count=N)`` or ``(prefill=P, decode=D)``, with the ``sgl_worker`` keywords
    and per-role args. Without the marker a ``sgl_workers`` test gets one regular worker."""

    count: int = 0
    prefill: int = 0
    decode: int = 0
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    fresh: bool = False
    startup_timeout: float | None = None
    role_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: ``(role, index, args)``: one member's own args
    member_args: tuple[tuple[str, int, tuple[str, ...]], ...] = ()
    #: ``(role, index, env items)``: one member's own env
    member_env: tuple[tuple[str, int, tuple[tuple[str, str], ...]], ...] = ()

    @classmethod
    def from_mark(cls, mark: pytest.Mark | None) -> WorkersMarker:
        if mark is None:
            return cls(count=1)
        kw = _kwargs(mark, {"count", "prefill", "decode", "args", "env", "fresh", "startup_timeout",
                            "worker_args", "prefill_args", "decode_args", "worker_env", "prefill_env", "decode_env"})
        count = _count("sgl_workers", "count", kw.get("count", 0))
        prefill = _count("sgl_workers", "prefill", kw.get("prefill", 0))
        decode = _count("sgl_workers", "decode", kw.get("decode", 0))
        if "count" in kw and count == 0:
            raise MarkerError("sgl_workers(count=0) asks for no worker: give count=1 or more")
        if count and (prefill or decode):
            raise MarkerError("sgl_workers takes count=N (regular workers) or prefill=P, decode=D, not both")
        if prefill + decode > MAX_GROUP_MEMBERS:
            raise MarkerError(f"sgl_workers(prefill={prefill}, decode={decode}) asks for more than {MAX_GROUP_MEMBERS} "
                              "workers, the most one group may have: give smaller numbers")
        if not count and not (prefill and decode):
            raise MarkerError("sgl_workers needs count=N, or both prefill=P and decode=D (each at least 1), "
                              "e.g. @pytest.mark.sgl_workers(prefill=1, decode=1)")
        sizes = {"worker": count, "prefill": prefill, "decode": decode}
        role_args: list[tuple[str, tuple[str, ...]]] = []
        member_args: list[tuple[str, int, tuple[str, ...]]] = []
        member_env: list[tuple[str, int, tuple[tuple[str, str], ...]]] = []
        for role in ("worker", "prefill", "decode"):
            for what in ("args", "env"):
                key = f"{role}_{what}"
                if not kw.get(key):
                    continue
                if not sizes[role]:
                    owner = "a count=N group" if role == "worker" else "a prefill/decode group"
                    fix = "; use prefill_*/decode_*" if role == "worker" else ""
                    raise MarkerError(f"sgl_workers({key}=...) belong to {owner}{fix}")
                value = kw[key]
                per_member = (isinstance(value, (list, tuple)) and bool(value)
                              and all(isinstance(v, (list, tuple) if what == "args" else Mapping) for v in value))
                if not per_member:
                    if what == "args":
                        role_args.append((role, _args("sgl_workers", key, value)))
                    else:
                        env = tuple(sorted(_env("sgl_workers", value).items()))
                        member_env += [(role, i, env) for i in range(sizes[role])]
                    continue
                if len(value) != sizes[role]:
                    raise MarkerError(f"sgl_workers({key}=...) gives {len(value)} members' {what}, but the group has "
                                      f"{sizes[role]} {role} member(s): one entry per member, or a single "
                                      f"{'list' if what == 'args' else 'dict'} for all of them")
                for i, entry in enumerate(value):
                    if what == "args":
                        member_args.append((role, i, _args("sgl_workers", f"{key}[{i}]", entry)))
                    else:
                        member_env.append((role, i, tuple(sorted(_env("sgl_workers", entry).items()))))
        return cls(count, prefill, decode, _args("sgl_workers", "args", kw.get("args")),
                   _env("sgl_workers", kw.get("env")),
                   _flag("sgl_workers", "fresh", kw.get("fresh", False)),
                   _timeout("sgl_workers", kw.get("startup_timeout")), tuple(role_args),
                   tuple((r, i, a) for r, i, a in member_args if a), tuple((r, i, e) for r, i, e in member_env if e))


ROUTER_SCOPES = ("function", "class", "module")


@dataclass(frozen=True)
class RouterMarker:
    """``@pytest.mark.sgl_router(policy=..., args=[...], workers=..., dp_aware=..., scope=...)``.

    ``workers``: the group's members the router starts with: ``"all"`` (default), ``"none"`` (add them through its
    worker API), the first ``N``, or a list of member indices (launch order: prefill members first).
    ``dp_aware``: ``--dp-aware`` as asked; None adds it when a member runs ``--dp-size`` > 1. ``scope``: one router
    per test (``"function"``), or one for every test of the class or module that asks for the same router over
    the same configuration (its workers then serve the whole scope)."""

    policy: str | None = None
    args: tuple[str, ...] = ()
    startup_timeout: float | None = None
    workers: str | tuple[int, ...] = "all"
    dp_aware: bool | None = None
    scope: str = "function"

    @classmethod
    def from_mark(cls, mark: pytest.Mark | None) -> RouterMarker:
        if mark is None:
            return cls()
        kw = _kwargs(mark, {"policy", "args", "startup_timeout", "workers", "dp_aware", "scope"})
        policy = kw.get("policy")
        if policy is not None and (not isinstance(policy, str) or not policy.strip()):
            raise MarkerError(f"sgl_router(policy=...) must be a policy name such as 'round_robin', got {policy!r}")
        workers = kw.get("workers", "all")
        if isinstance(workers, bool) or not (workers in ("all", "none") or (isinstance(workers, int) and workers >= 0)
                                             or (isinstance(workers, (list, tuple)) and all(
                                                 isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in workers))):
            raise MarkerError(f"sgl_router(workers=...) must be 'all', 'none', a number of workers or a list of member "
                              f"indices, got {workers!r}")
        if isinstance(workers, (list, tuple)):
            twice = sorted(i for i, n in Counter(workers).items() if n > 1)
            if twice:
                raise MarkerError(f"sgl_router(workers={list(workers)!r:.200}) names member(s) {twice!r:.200} more "
                                  "than once: the router takes each worker once; list each index once")
        asked = len(workers) if isinstance(workers, (list, tuple)) else workers if isinstance(workers, int) else 0
        if asked > MAX_GROUP_MEMBERS:
            raise MarkerError(f"sgl_router(workers=...) asks for more than {MAX_GROUP_MEMBERS} workers, the most a "
                              "group may have")
        chosen: str | tuple[int, ...] = workers if isinstance(workers, str) else (
            tuple(range(workers)) if isinstance(workers, int) else tuple(workers))
        dp_aware = kw.get("dp_aware")
        if dp_aware is not None and not isinstance(dp_aware, bool):
            raise MarkerError(f"sgl_router(dp_aware=...) must be True, False or None, got {dp_aware!r}")
        scope = kw.get("scope", "function")
        if scope not in ROUTER_SCOPES:
            raise MarkerError(f"sgl_router(scope=...) must be one of {', '.join(map(repr, ROUTER_SCOPES))}, "
                              f"got {scope!r}")
        return cls(policy, _args("sgl_router", "args", kw.get("args")),
                   _timeout("sgl_router", kw.get("startup_timeout")), chosen, dp_aware, scope)

    def members(self, group: Any) -> list[Any] | None:
        """The members of ``group`` the router starts with (None: all of them). An index beyond the group is a
        :class:`MarkerError`. ``group`` may be the group's indices (``range(size)``): collection checks the marker
        against the group's size before anything starts."""
        if isinstance(self.workers, str):
            return None if self.workers == "all" else []
        wrong = [i for i in self.workers if i >= len(group)]
        if wrong:
            indices = "0" if len(group) == 1 else f"0 to {len(group) - 1} (in launch order: prefill members first)"
            raise MarkerError(f"sgl_router(workers=...) names member(s) {wrong} of a group of {len(group)}: give "
                              f"indices {indices}")
        return [group[i] for i in self.workers]


def opt_out_reason(node: Any) -> str | None:
    """The reason of ``@pytest.mark.sgl_budget_opt_out`` on ``node``, or None."""
    mark = node.get_closest_marker("sgl_budget_opt_out")
    if mark is None:
        return None
    unknown = sorted(set(mark.kwargs) - {"reason"})
    if unknown or len(mark.args) > 1 or (mark.args and "reason" in mark.kwargs):
        raise MarkerError(f"sgl_budget_opt_out takes one reason only, got args {mark.args!r} and kwargs "
                          f"{mark.kwargs!r}: @pytest.mark.sgl_budget_opt_out(reason='why')")
    reason = mark.kwargs.get("reason", mark.args[0] if mark.args else None)
    if not isinstance(reason, str) or not reason.strip():
        raise MarkerError("sgl_budget_opt_out needs a reason: @pytest.mark.sgl_budget_opt_out(reason='why')")
    return reason


def required_features(node: Any) -> set[str]:
    """The features ``@pytest.mark.sgl_requires(...)`` asks for on ``node`` (an item or a definition)."""
    features: set[str] = set()
    for mark in node.iter_markers("sgl_requires"):
        if mark.kwargs:
            raise MarkerError(f"sgl_requires takes feature names only, got keyword(s) "
                              f"{', '.join(sorted(mark.kwargs))}: @pytest.mark.sgl_requires('streaming', 'chat')")
        for feature in mark.args:
            names = feature if isinstance(feature, (list, tuple, set, frozenset)) else [feature]
            for name in names:
                if not isinstance(name, str) or not name.strip():
                    raise MarkerError(f"sgl_requires takes feature names (non-empty strings), got {name!r}: "
                                      "@pytest.mark.sgl_requires('streaming', 'chat')")
                features.add(name)
    return features


def poolable(item: Any) -> bool:
    """Whether a test's workers come from the pool (not ``fresh=True``, not its own launch options)."""
    try:
        worker = WorkerMarker.from_mark(item.get_closest_marker("sgl_worker"))
        group = WorkersMarker.from_mark(item.get_closest_marker("sgl_workers"))
    except MarkerError:
        return False
    if "sgl_worker" in getattr(item, "fixturenames", ()):
        return not (worker.fresh or worker.startup_timeout is not None or worker.allow_foreign_host is not None)
    return not (group.fresh or group.startup_timeout is not None)


def will_run(item: Any) -> bool:
    """Whether a test will run: not marked skip (as ``sgl_requires`` marks a model without the feature), no
    collection error of the plugin's."""
    return item.get_closest_marker("skip") is None and ITEM_ERROR_KEY not in item.stash


def launchable(item: Any) -> bool:
    """Whether a test's workers may be launched ahead: pooled, and the test will run (:func:`will_run`): a test that
    is skipped would leave its launch unused, on GPUs another test waits for."""
    return poolable(item) and will_run(item)
