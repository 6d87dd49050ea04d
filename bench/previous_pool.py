"""A pytest plugin for bench/bound.py's ``before`` variant: the pool as it was before issue 33's fixes, patched back
into each pytest process (``-p previous_pool``, with bench/ on ``PYTHONPATH``), never into the plugin.

Before them, a group was given back after every test while another process waited for a GPU, even when the next
test needed it (and launched again for that test), and an idle group stayed pooled, holding its GPUs, until this
process released another group or needed the GPUs itself."""

from __future__ import annotations

from typing import Any

from pytest_sglworker.workers.pool import WorkerPool

_release = WorkerPool.release


def _release_before(self: WorkerPool, group: Any, *, failed: bool = False, needed_next: bool = False) -> None:
    _release(self, group, failed=failed)


def _yield_idle_before(self: WorkerPool, *, keep: Any = None) -> None:
    return None


WorkerPool.release = _release_before  # type: ignore[method-assign]
WorkerPool.yield_idle = _yield_idle_before  # type: ignore[method-assign]
