"""The only glue a router suite needs: the workers come from pytest-sglworker's fixtures."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from router import RoundRobinRouter


@pytest.fixture
def router(sgl_worker) -> Iterator[RoundRobinRouter]:  # type: ignore[no-untyped-def]
    """A router in front of one worker of the selected model (reused across tests by the pool)."""
    r = RoundRobinRouter([sgl_worker.url])
    yield r
    r.close()
