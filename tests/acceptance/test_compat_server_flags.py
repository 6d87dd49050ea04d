"""Five sglang unittest files that exercise server flags and routes (``MANIFEST.json``'s ``server_flags``:
``core/test_input_embeddings.py``, ``sampling/test_penalty.py``, ``tokenizer/test_skip_tokenizer_init.py``,
``sessions/test_session_control.py``, ``scheduler/test_abort.py``), changed by one import line, through
``pytest_sglworker.compat`` on the real sglang 0.5.23 on the CPU *and* on the simulated engine, with the same tiny
model. They run as ``test_compat_openai_families.py`` runs its files (one inner session per engine, in the real
engine's Python), and every test has the outcome :data:`OUTCOMES` says on each engine: the same on both, except
where ``docs/SIM_FLAGS.md`` explains the difference (:data:`DIFFERENCES`). What a file needs that the tiny model or
the CPU cannot give is deselected with the reason (:data:`DESELECTED`).

The inner session maps ``DEFAULT_SMALL_MODEL_NAME_FOR_TEST`` and ``DEFAULT_MODEL_NAME_FOR_TEST`` to the tiny model,
renames ``--cuda-graph-max-bs`` (``test_input_embeddings.py`` still passes it; 0.5.23 split it) and gives uvicorn's
workers time to import sglang (:data:`WORKER_HEALTHCHECK`).

``slow``: ten servers per engine, one after the other (the real ones take 1-3 minutes each on a loaded 2-core
machine).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
from test_compat_real_engine import (
    MANIFEST,
    STARTUP_TIMEOUT,
    InnerRun,
    _finish_inner,
    _prepare_inner,
    _upstream_file,
)

from pytest_sglworker.engine.cpu_engine import (
    build_tiny_model,
    real_engine_launcher,
    real_engine_missing_reason,
    real_engine_python,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.xdist_group("real-engine")]

FILES: dict[str, dict[str, Any]] = MANIFEST["server_flags"]
MODELS = "meta-llama/Llama-3.2-1B-Instruct=tiny-cpu,meta-llama/Llama-3.1-8B-Instruct=tiny-cpu"

#: ``--tokenizer-worker-num 4`` (test_skip_tokenizer_init.py) runs four uvicorn workers, each importing sglang
#: afresh; uvicorn's supervisor kills one that does not answer its liveness ping within sglang's
#: ``SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT`` (10 s), and an import takes longer than that on a loaded 2-core
#: machine: every worker is killed and restarted, every 10 s, and the server never becomes ready
WORKER_HEALTHCHECK = "300"

#: upstream tests not run, by node id (a class: all its tests), and why; the same on both engines
DESELECTED: dict[str, str] = {
    "test_skip_tokenizer_init.py::TestSkipTokenizerInitVLM": (
        "a vision-language model (DEFAULT_SMALL_VLM_MODEL_NAME_FOR_TEST) and an image downloaded from the internet: "
        "the tiny model is a text-only causal LM, and the tests reach no network"),
    "test_session_control.py::TestSessionControlVision": (
        "OpenGVLab/InternVL2-2B's weights and images downloaded from the internet: the tiny model is text-only, and "
        "the tests reach no network"),
}

#: every selected test's outcome, (real engine, sim)
OUTCOMES: dict[str, tuple[str, str]] = {}
#: the tests whose outcome differs between the engines, and the line of docs/SIM_FLAGS.md that explains it
DIFFERENCES: dict[str, str] = {}

INNER_CONFTEST = '''
from pytest_sglworker.compat import rename_flag
from pytest_sglworker.engine.cpu_engine import cpu_engine_spec

MODEL = {model!r}


def pytest_sglworker_register_specs(registry):
    registry.add(cpu_engine_spec("tiny-cpu", MODEL))


rename_flag("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode",
            reason="sglang 0.5.23 split it into -decode and -prefill; upstream's test still passes the old name")
'''

_RUNS = pytest.StashKey[dict[str, Any]]()


def _run(base: Path, python: Path, model: Path, sources: dict[str, Path], engine: str) -> InnerRun:
    env, command = _prepare_inner(base, python, model, sources, conftest=INNER_CONFTEST)
    env.update(SGLWORKER_COMPAT_MODELS=MODELS, SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT=WORKER_HEALTHCHECK)
    if engine == "sim":
        options = ["--sgl-engine", "sim", "--sgl-startup-timeout", "120"]
    else:
        options = ["--sgl-launcher", shlex.join(real_engine_launcher(python)), "--sgl-startup-timeout",
                   str(STARTUP_TIMEOUT)]
    args = [*command, *options, "--sgl-gpus", "sim:1", "--sgl-lease-timeout", "600",
            *[f"--deselect={nodeid}" for nodeid in DESELECTED], *sources]
    return _finish_inner(args, base, env, model, timeout=10 * (STARTUP_TIMEOUT + 300))


def _cached_run(request: pytest.FixtureRequest, engine: str) -> InnerRun:
    """The inner session of ``engine``, run once per outer session (a failure is cached too)."""
    runs = request.config.stash.setdefault(_RUNS, {})
    if engine not in runs:
        try:
            runs[engine] = _inner_run(request, engine)
        except Exception as exc:  # a skip is not an Exception: skipped again by the next test that asks
            runs[engine] = exc
    cached = runs[engine]
    if isinstance(cached, BaseException):
        pytest.fail(f"the {engine} engine's inner session could not run: {cached!r}")
    assert isinstance(cached, InnerRun)
    return cached


def _inner_run(request: pytest.FixtureRequest, engine: str) -> InnerRun:
    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    sources: dict[str, Path] = {}
    for name, info in FILES.items():
        path, why = _upstream_file(name, info)
        if path is None:
            pytest.skip(why)
        sources[name] = path
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    model = build_tiny_model(python, factory.getbasetemp() / "compat-flags-tiny")
    return _run(factory.mktemp(f"compat-flags-{engine}"), python, model, sources, engine)


def _selected(run: InnerRun) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for name in FILES:
        outcomes.update(run.outcomes(name))
    return {nodeid: outcome for nodeid, outcome in outcomes.items()
            if not any(nodeid == d or nodeid.startswith(d + "::") for d in DESELECTED)}


@pytest.mark.parametrize("engine", ["real", "sim"])
def test_each_test_has_its_outcome(request: pytest.FixtureRequest, engine: str) -> None:
    """On each engine, every selected test has the outcome :data:`OUTCOMES` gives it."""
    run = _cached_run(request, engine)
    selected = _selected(run)
    expected = {nodeid: pair[0 if engine == "real" else 1] for nodeid, pair in OUTCOMES.items()}
    tail = "\n".join(run.lines[-80:])
    assert selected == expected, (
        {k: (selected.get(k), expected.get(k)) for k in set(selected) | set(expected)
         if selected.get(k) != expected.get(k)}, tail)
    assert "was still running after" not in run.stdout  # every class ended its own server


def test_the_engines_differ_only_where_sim_flags_explains(request: pytest.FixtureRequest) -> None:
    """The real engine and the sim: the same outcome for every test, except :data:`DIFFERENCES`, each of which
    differs and names a line of docs/SIM_FLAGS.md that says why."""
    real, sim = _selected(_cached_run(request, "real")), _selected(_cached_run(request, "sim"))
    differing = {k for k in set(real) | set(sim) if real.get(k) != sim.get(k)}
    assert differing == set(DIFFERENCES), {k: (real.get(k), sim.get(k)) for k in differing ^ set(DIFFERENCES)}
    page = (Path(__file__).resolve().parents[2] / "docs" / "SIM_FLAGS.md").read_text(encoding="utf-8")
    for nodeid, line in DIFFERENCES.items():
        assert line in page, (nodeid, line)


@pytest.mark.parametrize("engine", ["real", "sim"])
def test_nothing_is_left_running(request: pytest.FixtureRequest, engine: str) -> None:
    assert not _cached_run(request, engine).leftovers
