"""sglang's own unittest files of ``test_compat_real_engine.py``, unchanged but for their one import line, on the
*simulated* engine (``--sgl-engine sim``) with the same tiny model: every upstream test that the real-engine tier
runs has the same outcome here (all pass), except those that need what only real logits give, deselected with the
reason (:data:`DESELECTED`, on top of the real tier's own).

The files import sglang, so the inner session runs in the real engine's Python (``sglang.test.test_utils`` needs
``datasets`` there, as for the real tier; skipped with the fix otherwise); only the servers are simulated. One
inner session for both files (``slow``: five classes, five servers, one after the other on sglang's test port).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_compat_real_engine import (
    BOOT,
    INNER_CONFTEST,
    LAUNCHED,
    MANIFEST,
    MARK,
    InnerRun,
    _inner_env,
    _leftovers,
    _upstream_file,
    _with_one_import_changed,
)
from test_compat_real_engine import (
    DESELECTED as REAL_DESELECTED,
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
    base = pytester.path
    pytester.makeconftest(INNER_CONFTEST.format(model=str(model)))
    for name, path in sources.items():
        (base / name).write_text(_with_one_import_changed(path.read_text(encoding="utf-8")), encoding="utf-8")
    env = _inner_env(model, base)
    probe = subprocess.run([str(python), "-c", "import sglang.test.test_utils"], env=env, capture_output=True,
                           text=True, timeout=600, check=False)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import sglang.test.test_utils, which the files import: "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[-1]} (install the missing package into the "
                    "engine's venv, e.g. 'pip install datasets', or put a folder holding it on PYTHONPATH)")
    site = str(Path(pytest.__file__).resolve().parents[1])
    args = [str(python), "-c", BOOT.format(site=site), "-p", "pytest_sglworker.plugin", "-rA", "-p", "no:cacheprovider",
            "--sgl-engine", "sim", "--sgl-gpus", "sim:1", "--sgl-startup-timeout", "120", "--sgl-lease-timeout", "600",
            *[f"--deselect={nodeid}" for nodeid in DESELECTED], *sources]
    since = time.time()
    start = time.monotonic()
    result = subprocess.run(args, cwd=base, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            timeout=len(LAUNCHED) * 300, check=False)
    run = InnerRun(ret=result.returncode, lines=result.stdout.splitlines(), seconds=time.monotonic() - start,
                   report={}, base=base)
    deadline = time.monotonic() + 15
    while True:
        run.leftovers = _leftovers(os.environ[MARK], since, [str(model)])
        if not run.leftovers or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


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
