"""The readiness code before the fixes the benchmark found, applied as patches in the bench process only, so
that ``bench/run.py`` measures the committed code against what it replaced, in the same run ("previous" rows).

1. **The ownership check through psutil** (:func:`psutil_owns_port`): ``ModelInstance.owns_port`` asked psutil
   for the listening sockets of each process of the worker's tree, twice (``processes.listening_pids``, then
   ``processes.socket_inodes``). psutil's ``Process.net_connections`` reads ``/proc/net/tcp`` and
   ``/proc/net/tcp6``, and a read of either makes the kernel walk its whole TCP hash table, milliseconds
   whatever the number of sockets, plus psutil's parsing of every line; before that,
   ``psutil.Process.children(recursive=True)`` reads the stat file of every process of the machine. The
   committed check asks the kernel for the port's listeners with one ``sock_diag`` netlink request per address
   family (what ``ss -l`` does) and looks for their inodes among the root's fds first.

2. **The ``/health_generate`` probe** (:class:`PreviousWorker`): sglang 0.5.23's ``/health_generate`` (and
   ``/health``) schedules a one-token generation and then sleeps 1 s (``await asyncio.sleep(1)``,
   ``http_server.py``) before it answers 200: confirming readiness with it cost a generation and at least 1 s.
   The committed probe is ``GET /ready``, answered from the tokenizer manager's state. The simulated engine
   answers both at once, so this part shows only against the real engine (``bench/run.py`` part ``real``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from pytest_sglworker.engine.sglang_facts import HEALTH_PATH
from pytest_sglworker.resources.processes import listening_pids, socket_inodes
from pytest_sglworker.workers.health import HttpHealth
from pytest_sglworker.workers.kinds import HttpWorker


def psutil_owns_port(self: Any) -> bool:
    """``ModelInstance.owns_port`` as it was: psutil's connections of every process of the tree."""
    pids = listening_pids(self._tree(sweep=False), self.port)
    for pid in pids:
        self.listen_inodes |= socket_inodes(pid, self.port)
    return bool(pids)


@contextlib.contextmanager
def previous_owns_port() -> Iterator[None]:
    """``ModelInstance.owns_port`` replaced by :func:`psutil_owns_port` for the duration."""
    from pytest_sglworker.workers.launcher import ModelInstance

    original: Callable[[Any], bool] = ModelInstance.owns_port
    ModelInstance.owns_port = psutil_owns_port  # type: ignore[method-assign]
    try:
        yield
    finally:
        ModelInstance.owns_port = original  # type: ignore[method-assign]


class PreviousWorker(HttpWorker):
    """The regular worker kind probing ``/health_generate`` only (passed to ``spawn_worker(kind=)``)."""

    def readiness(self) -> HttpHealth:
        return HttpHealth(path=HEALTH_PATH)
