"""Specs, lease observation and helpers of the inner sessions of ``sglworker gpu-check``.

The driver (``check.py``) sets, in the environment:

- ``GPU_CHECK_EVENTS``: the JSON-lines file every holder and every lease of the run appends to;
- ``GPU_CHECK_RESULTS``: a directory where each test writes what it measured (``<name>.json``);
- ``GPU_CHECK_GPUS``: the ``--sgl-gpus`` value of the session (one NVML index), ``GPU_CHECK_LOCK_DIR``;
- ``GPU_CHECK_PROBE``, ``GPU_CHECK_SMI``, ``GPU_CHECK_HOLD_S``, ``GPU_CHECK_BIG_GB``, ``GPU_CHECK_TINY_MODEL``
  (see the tests that read them).

Leases are observed by wrapping ``pytest_sglworker.resources.gpus.Lease`` (``__init__`` and ``release``): each
acquisition and each release (with its :class:`ReleaseReport`) becomes an event with a ``time.time()``
stamp, which the driver lines up with the holders' events and its NVML samples. If the package changes so
that this cannot be done, an ``observer_error`` event says so and the checks that need it fail.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from inner_helpers import emit

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

HOLD_SPECS = {"hold-1g": 1.0, "hold-30g": 30.0}


def pytest_sglworker_register_specs(registry: Any) -> None:
    specs = dict(HOLD_SPECS)
    specs["hold-big"] = float(os.environ.get("GPU_CHECK_BIG_GB") or 100)
    for name, gb in specs.items():
        registry.add(ModelSpec(
            name=name, model=f"gpu-check/{name}", memory_gb=gb, tp=1, worker_args=CI_WORKER_ARGS,
            env={"GPU_CHECK_HOLD_MIB": str(round(gb * 1024))},
            description="sglworker gpu-check GPU memory holder (holder.py)",
        ))
    tiny = os.environ.get("GPU_CHECK_TINY_MODEL")
    if tiny:
        extra = tuple(json.loads(os.environ.get("GPU_CHECK_TINY_ARGS") or "[]"))
        registry.add(ModelSpec(
            name="tiny-gpu", model=tiny, memory_gb=8, tp=1, features=frozenset({"chat"}),
            worker_args=(*CI_WORKER_ARGS, *extra), env=json.loads(os.environ.get("GPU_CHECK_TINY_ENV") or "{}"),
            description="tiny random Llama, real sglang, budget flags (decode graph on)",
        ))


# -------------------------------------------------------------------------------------------- lease observer

_ids = itertools.count(1)


def _install_lease_observer() -> None:
    try:
        from pytest_sglworker.resources import gpus

        lease_cls: Any = gpus.Lease
        original_init: Callable[..., None] = lease_cls.__init__
        original_release: Callable[..., Any] = lease_cls.release
    except (ImportError, AttributeError) as exc:
        emit("observer_error", error=f"cannot observe leases (pytest_sglworker.resources.gpus.Lease changed?): {exc!r}")
        return
    if getattr(original_release, "_gpu_check", False):
        return

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            self._gpu_check_id = f"{os.getpid()}-{next(_ids)}"
            emit("lease_acquired", lease=self._gpu_check_id, indices=list(self.indices),
                 free_mib=[g.free_mib for g in self.gpus], total_mib=[g.total_mib for g in self.gpus],
                 memory_mib=self.memory_mib, holder=self.holder, cuda_visible_devices=self.cuda_visible_devices)
        except Exception as exc:  # observing must never break a lease
            emit("observer_error", error=f"lease_acquired: {exc!r}")

    @functools.wraps(original_release)
    def release(self: Any, *args: Any, **kwargs: Any) -> Any:
        first = not getattr(self, "released", True)
        started = time.time()
        report = original_release(self, *args, **kwargs)
        if first:
            try:
                pids = kwargs.get("worker_pids", args[0] if args else ())
                emit("lease_released", lease=getattr(self, "_gpu_check_id", "?"), indices=list(self.indices),
                     started=started, worker_pids=sorted(int(p) for p in pids),
                     memory_back=bool(report.memory_back), waited_s=float(report.waited_s),
                     lingering_pids=list(report.lingering_pids),
                     shortfalls=[dataclasses.asdict(s) for s in report.shortfalls], error=report.error,
                     message=report.message, holder=self.holder)
            except Exception as exc:
                emit("observer_error", error=f"lease_released: {exc!r}")
        return report

    release._gpu_check = True  # type: ignore[attr-defined]
    lease_cls.__init__ = init
    lease_cls.release = release


_install_lease_observer()


# -------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def record() -> Callable[[str, dict[str, Any]], None]:
    """``record(name, data)``: what a test measured, for the driver (written before the test asserts)."""

    def write(name: str, data: dict[str, Any]) -> None:
        folder = Path(os.environ["GPU_CHECK_RESULTS"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")

    return write


@pytest.fixture
def gpu_index() -> int:
    return int(os.environ.get("GPU_CHECK_GPUS") or 0)


@pytest.fixture
def hold_seconds() -> float:
    return float(os.environ.get("GPU_CHECK_HOLD_S") or 1.0)


@pytest.fixture(autouse=True)
def _mark_test(request: pytest.FixtureRequest) -> Iterator[None]:
    emit("test_start", test=request.node.name)
    yield
    emit("test_end", test=request.node.name)
