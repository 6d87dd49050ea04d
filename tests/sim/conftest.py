"""The simulated engine's tests: the real engine and the sim side by side (``real_pair.py``), started once per
session for the differential tests that ask for ``servers`` (they share an xdist group)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from real_pair import Pair, started_pairs

from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    """The real sglang on the CPU and the sim, for a generation model and an embedding one (skipped without the
    real engine)."""
    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    with started_pairs(python, tmp_path_factory.mktemp("differential")) as pairs:
        yield pairs
