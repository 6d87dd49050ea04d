"""A worker group: the running processes of one worker configuration, handed to a test as one object.

Plain Python, no pytest. A single worker is a group of one; ``sgl_workers`` hands the group itself to the test.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import WorkerConfig
    from .launcher import ModelInstance

__all__ = ["WorkerGroup"]


class WorkerGroup:
    """The running processes of one configuration: one worker, N regular workers, or a prefill/decode group.

    ``workers`` is every member in launch order; ``prefill`` and ``decode`` the members of those roles; a
    group is also a sequence of its members (``group[0]``, ``len(group)``, ``for w in group``)."""

    def __init__(self, config: WorkerConfig, members: Sequence[ModelInstance], group_id: str) -> None:
        self.config = config
        self.members = list(members)
        self.id = group_id

    @property
    def workers(self) -> list[ModelInstance]:
        return list(self.members)

    @property
    def prefill(self) -> list[ModelInstance]:
        return [m for m in self.members if m.role == "prefill"]

    @property
    def decode(self) -> list[ModelInstance]:
        return [m for m in self.members if m.role == "decode"]

    @property
    def regular(self) -> list[ModelInstance]:
        return [m for m in self.members if m.role == "worker"]

    @property
    def is_pd(self) -> bool:
        return bool(self.prefill)

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def is_alive(self) -> bool:
        return all(m.is_alive() for m in self.members)

    def __iter__(self) -> Iterator[ModelInstance]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: int) -> ModelInstance:
        return self.members[index]

    def __repr__(self) -> str:
        return f"<WorkerGroup {self.config.label}: {', '.join(m.describe() for m in self.members)}>"
