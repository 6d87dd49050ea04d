"""sglang's own unittest files of ``test_compat_real_engine.py``, unchanged but for their one import line, on the
*simulated* engine (``--sgl-engine sim``) with the same tiny model: every upstream test that the real-engine tier
runs has the same outcome here (all pass), except those that need what only real logits give, deselected with the
reason (:data:`DESELECTED`, on top of the real tier's own).

The files import sglang, so the inner session runs in the real engine's Python (``sglang.test.test_utils`` needs
``datasets`` there, as for the real tier; a failure with the fix otherwise); only the servers are simulated. One
inner session for both files (``slow``: five classes, five servers, one after the other on sglang's test port).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_compat_real_engine import (
    DESELECTED as REAL_DESELECTED,
)
from test_compat_real_engine import (
    LAUNCHED,
    MANIFEST,
    InnerRun,
    _finish_inner,
    _prepare_inner,
    _upstream_file,
)

from pytest_sglworker.engine.cpu_engine import build_tiny_model, real_engine_missing_reason, real_engine_python

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.xdist_group("real-engine")]

LOGITS = ("the sim does not run custom logit processors: the real engine unpickles the test's processor and applies "
          "it to the model's logits, which a simulated engine without a model does not have")
DESELECTED: dict[str, str] = {
    **REAL_DESELECTED,
    "test_openai_server.py::TestOpenAIServerCustomLogitProcessor::test_custom_logit_processor": LOGITS,
    "test_srt_endpoint.py::TestSRTEndpoint::test_custom_logit_processor": LOGITS,
    "test_srt_endpoint.py::TestSRTEndpoint::test_custom_logit_processor_batch_mixed": LOGITS,
}


def _run(pytester: pytest.Pytester, python: Path, model: Path, sources: dict[str, Path]) -> InnerRun:
    env, command = _prepare_inner(pytester.path, python, model, sources)
    args = [*command, "--sgl-engine", "sim", "--sgl-gpus", "sim:1", "--sgl-startup-timeout", "120",
            "--sgl-lease-timeout", "600", *[f"--deselect={nodeid}" for nodeid in DESELECTED], *sources]
    return _finish_inner(args, pytester.path, env, model, timeout=len(LAUNCHED) * 300)


@pytest.fixture
def inner(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InnerRun]:
    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    sources: dict[str, Path] = {}
    for name, info in MANIFEST["files"].items():
        path, why = _upstream_file(name, info)
        if path is None:
            pytest.skip(why)
        sources[name] = path
    model = build_tiny_model(python, tmp_path_factory.mktemp("compat-sim") / "tiny")
    yield _run(pytester, python, model, sources)


def test_upstream_files_have_the_real_tiers_outcomes_on_the_sim(inner: InnerRun) -> None:
    outcomes = {**inner.outcomes("test_openai_server.py"), **inner.outcomes("test_srt_endpoint.py")}
    selected = {nodeid: outcome for nodeid, outcome in outcomes.items()
                if not any(nodeid == d or nodeid.startswith(d + "::") for d in DESELECTED)}
    tail = "\n".join(inner.lines[-60:])
    assert selected and set(selected.values()) == {"PASSED"}, f"{selected}\n{tail}"
    # every class of the real tier's selection ran (the custom-logit-processor class keeps no test: not launched)
    ran = {nodeid.rsplit("::", 1)[0] for nodeid in selected}
    assert ran == set(LAUNCHED) - {"test_openai_server.py::TestOpenAIServerCustomLogitProcessor"}, ran
    assert inner.ret == 0, tail
    assert not inner.leftovers, inner.leftovers
