"""Hooks that pytest-sglworker adds; implement them in a conftest.py or a plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ..engine.specs import SpecRegistry


def pytest_sglworker_register_specs(registry: SpecRegistry) -> None:
    """Register model specs: ``registry.add(ModelSpec(...))`` or ``registry.add({...}, name="...")``.

    Called once per session, after the built-in specs are in, for every plugin and conftest that
    implements it (conftests of sub-directories when they are loaded). Every spec must carry
    ``CI_WORKER_ARGS``; the session stops with a usage error otherwise.
    """


@pytest.hookspec(firstresult=True)
def pytest_sglworker_worker_env(spec: object, lease_env: dict[str, str]) -> dict[str, str] | None:
    """Return the extra environment for a worker of ``spec`` (default: ``lease_env``, i.e. the
    ``CUDA_VISIBLE_DEVICES`` of its GPU lease). The first non-None result wins: override GPU selection
    here without monkeypatching."""


@pytest.hookspec(firstresult=True)
def pytest_sglworker_worker_kind(role: str, args: tuple[str, ...]) -> object | None:
    """Return the :class:`~pytest_sglworker.workers.kinds.WorkerKind` of a worker with ``role`` (``worker``,
    ``prefill``, ``decode``) and these args (the spec's worker_args, then the test's and its role's extra
    args), or None for the default (:func:`~pytest_sglworker.workers.kinds.default_kind`: ``--grpc-mode`` selects
    :class:`~pytest_sglworker.workers.grpc_worker.GrpcWorker`). A new kind of worker is one subclass returned here."""
