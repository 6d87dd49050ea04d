"""The exceptions every layer may raise: the base class and the errors of specs, budgets, GPU leases and port
blocks. Plain Python, no pytest, no import of the package: the one module every layer may import. The errors
of a worker (it failed to start, it died) carry its diagnosis and memory ledger and live with the workers:
:mod:`pytest_sglworker.workers.errors`.

Also where an error or a help text sends its reader: :func:`docs_url`, an absolute URL (a wheel holds no
``docs/`` folder), the one place the project's address is written (pyproject.toml's ``[project.urls]`` and the
README's links name the same base; tests/plugin/test_docs_pointers.py keeps them so)."""

from __future__ import annotations

#: The project's home; its documentation pages are the repository's ``docs/`` folder, read under DOCS_URL.
PROJECT_URL = "https://github.com/pytest-sglworker/pytest-sglworker"
DOCS_URL = f"{PROJECT_URL}/blob/main/docs/"


def docs_url(page: str) -> str:
    """The absolute URL of a documentation page, ``page`` relative to ``docs/`` (``how-to/worker-oom.md``)."""
    return DOCS_URL + page


class SglWorkerError(Exception):
    """Base class of every error this package raises on purpose."""


class SpecError(SglWorkerError, ValueError):
    """A model spec is malformed, unknown, or registered twice."""


class BudgetViolation(SglWorkerError, ValueError):
    """A spec or a test's extra args break the mandatory memory budget (CI_WORKER_ARGS)."""


class InventoryUnavailable(SglWorkerError):
    """No GPU inventory could be read (NVML missing or failing) and none was declared."""


class LeaseImpossible(SglWorkerError, ValueError):
    """A lease that can never be granted here (tp larger than the GPUs visible, memory larger than any GPU)."""


class LeaseTimeout(SglWorkerError):
    """No GPU lease became free before the lease timeout. The message names the holders."""


class PortUnavailable(SglWorkerError):
    """No free port block could be reserved in the configured range."""
