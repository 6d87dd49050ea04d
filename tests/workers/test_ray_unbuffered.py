"""The Ray path's engines log unbuffered, as the local path's do (``test_worker_lifecycle.py``'s never-flushing
launcher): a Ray host actor starts its engine with ``PYTHONUNBUFFERED=1``, so an engine that prints its last words
and is then SIGKILLed (the OOM killer) has them in its log, and in the startup failure's tail.

Its own module (and so its own local cluster, from ``test_ray_cluster.py``'s fixtures, used as they are), started
without ``PYTHONUNBUFFERED`` in its environment: a variable the cluster's processes inherited from this test run
would hide a host actor that does not set it."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray")]  # one local cluster at a time

pytest.importorskip("ray", reason="Ray is not installed: pip install 'pytest-sglworker[ray]'")

from test_ray_cluster import SIM, on_ray, ray_address  # noqa: E402, F401  (the cluster fixtures, as they are)

UNFLUSHED = Path(__file__).resolve().parents[1] / "engine_scripts" / "unflushed.py"
LAST_WORDS = "unflushed engine: loading the weights failed, dying now"


@pytest.fixture(scope="module", autouse=True)
def _buffered_cluster() -> Iterator[None]:
    """The cluster of this module (started after this fixture) and its inner sessions run without
    ``PYTHONUNBUFFERED``, as most do: only the plugin can have set it for the engine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PYTHONUNBUFFERED", raising=False)
        yield


def test_an_engine_that_never_flushes_has_its_last_line_in_the_tail_on_ray(pytester: pytest.Pytester,
                                                                          on_ray: Path) -> None:  # noqa: F811
    assert "PYTHONUNBUFFERED" not in os.environ
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess(*SIM, "-p", "no:xdist", "--sgl-launcher", f"{sys.executable} {UNFLUSHED}",
                                           timeout=180)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*exited during startup with code -9 (SIGKILL)*", "*last lines of the log*:"])
    out = result.stdout.str()
    assert "Ray node" in out, out
    tail = list(itertools.takewhile(lambda line: line.startswith("    "),
                                    out.split("last lines of the log", 1)[1].splitlines()[1:]))
    assert tail and tail[-1].strip() == LAST_WORDS, out
