"""The memory ledger of one member of a worker group: its own args, on its own first GPU of the group's lease.
The pool attaches it to a member's startup failure about memory, and records each member's actual KV cache size
against its prediction."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..engine.ledger import ledger_for_spec
from ..engine.log_lines import parse_kv_tokens
from ..errors import SglWorkerError
from .config import MemberPlan, WorkerConfig
from .errors import WorkerError
from .records import ConfigStats

if TYPE_CHECKING:
    from ..engine.ledger import MemoryLedger
    from ..resources.gpus import Lease
    from .launcher import ModelInstance

__all__ = ["attach_ledger", "record_kv_tokens"]


def _gpu_of(lease: Lease | None, first: int = 0) -> tuple[int, int] | None:
    """``(total, free)`` MiB of the lease's GPU ``first`` (a member's first GPU), else of its first GPU."""
    if lease is None or not lease.gpus:
        return None
    gpu = lease.gpus[first] if first < len(lease.gpus) else lease.gpus[0]
    return gpu.total_mib, gpu.free_mib


def _member_args(plan: MemberPlan) -> tuple[str, ...]:
    """A member's args after the spec's, as its engine gets them: the test's, its role's, then its kind's
    (``--disaggregation-mode prefill|decode``). The kind's port values are placeholders (0): no figure of the
    memory ledger reads a port."""
    try:
        kind_args = plan.kind.role_args(defaultdict(int))
    except Exception:  # a plugin's kind that needs real ports: its mode is unknown to the ledger
        kind_args = []
    return (*plan.extra_args, *kind_args)


def _member_ledger(config: WorkerConfig, plans: Sequence[MemberPlan], index: int,
                   lease: Lease | None) -> MemoryLedger | None:
    """The memory ledger of member ``index``: its own args, on its own first GPU of the group's lease."""
    gpu = _gpu_of(lease, sum(plan.gpus(config.spec) for plan in plans[:index]))
    if gpu is None:
        return None
    return ledger_for_spec(config.spec, gpu[0], gpu_free_mib=gpu[1], extra_args=_member_args(plans[index]))


def attach_ledger(exc: SglWorkerError, config: WorkerConfig, plans: Sequence[MemberPlan], index: int,
                   lease: Lease | None) -> None:
    """Give a member's startup failure whose diagnosis is about memory the memory ledger of that member."""
    diagnosis = getattr(exc, "diagnosis", None)
    if diagnosis is None or not diagnosis.memory_related or not isinstance(exc, WorkerError):
        return
    ledger = _member_ledger(config, plans, index, lease)
    if ledger is not None:
        exc.ledger = ledger


def record_kv_tokens(members: Sequence[ModelInstance], config: WorkerConfig, plans: Sequence[MemberPlan],
                      lease: Lease | None, stats: ConfigStats) -> None:
    """Each member's actual ``KV Cache is allocated ... #tokens: N`` against the ledger's prediction for that
    member (a prefill and a decode member of one group differ). The configuration has one figure: the first
    member that disagrees with its prediction, else the first member; a disagreement already recorded stays."""
    def differs(actual: int | None, predicted: int | None) -> bool:
        return actual is not None and predicted is not None and actual != predicted

    if differs(stats.kv_tokens_actual, stats.kv_tokens_predicted):
        return
    pairs: list[tuple[int, int | None]] = []
    for index, member in enumerate(members):
        actual = parse_kv_tokens(member.log_text(max_bytes=1024 * 1024))
        if actual is not None:
            ledger = _member_ledger(config, plans, index, lease)
            pairs.append((actual, ledger.kv_tokens if ledger is not None else None))
    if pairs:
        stats.kv_tokens_actual, stats.kv_tokens_predicted = next((p for p in pairs if differs(*p)), pairs[0])
