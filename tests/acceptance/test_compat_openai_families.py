"""sglang's own OpenAI-server unittest files of the ``basic``, ``features`` and ``validation`` families, changed by
one import line, through ``pytest_sglworker.compat`` on the real sglang 0.5.23 on the CPU *and* on the simulated
engine, with the same tiny model: every upstream test that does not assert what a real model writes has the same
outcome on both (they all pass), and the tests that do are deselected with the reason (:data:`DESELECTED`).

The files (``MANIFEST.json``'s ``families``, upstream's bytes found as ``test_compat_real_engine.py`` finds its two,
not part of this repository; tests/data/sglang_tests/README.md
lists the files of the families not taken, each with why) run as ``test_compat_real_engine.py`` runs its own two:
copied with the one import changed into one inner pytest session per engine, a subprocess of the real engine's
Python (``sglang.test.test_utils`` needs ``datasets`` there, which the engine's recipe installs; a failure with
the fix otherwise). Besides the tiny
model's spec, the inner session says, without editing the files:

- ``SGLWORKER_COMPAT_MODELS``: ``DEFAULT_SMALL_MODEL_NAME_FOR_TEST`` (Llama-3.2-1B),
  ``DEFAULT_MODEL_NAME_FOR_TEST`` (Llama-3.1-8B, ``test_matched_stop.py``'s) and ``Qwen/Qwen2.5-0.5B-Instruct``
  (``test_watermark.py``'s own constant) are all served by the tiny model;
- ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``: ``test_request_length_validation.py`` asks for
  ``--context-length 1000``, over the tiny model's 512; sglang refuses that at startup outside its CI, where
  ``SGLANG_IS_IN_CI`` allows it (the sim refuses and allows it the same way).

``slow``: seven servers per engine, one after the other on sglang's test port (the real ones take 1-3 minutes each
on a loaded 2-core machine).
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
    cached_inner_run,
)

from pytest_sglworker.engine.cpu_engine import (
    real_engine_launcher,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.xdist_group("real-engine")]

FILES: dict[str, dict[str, Any]] = MANIFEST["families"]
MODELS = ("meta-llama/Llama-3.2-1B-Instruct=tiny-cpu,meta-llama/Llama-3.1-8B-Instruct=tiny-cpu,"
          "Qwen/Qwen2.5-0.5B-Instruct=tiny-cpu")

CONTEXT = "over the tiny model's 512-token context: a 400 without choices on both engines"
EAGLE = ("speculative decoding with an EAGLE draft model ({draft}) and its target ({target}): weights the tiny "
         "model has no counterpart of, and the CPU engine does not run speculative decoding")
#: upstream tests not run, by node id (a class: all its tests), and why; the same on both engines
DESELECTED: dict[str, str] = {
    "test_matched_stop.py::TestMatchedStop::test_finish_stop_str": (
        f"asserts the model writes a newline before 1,000 tokens; the 433-token prompt plus 1,000 tokens is {CONTEXT}"),
    "test_matched_stop.py::TestMatchedStop::test_finish_stop_regex_str": (
        "asserts the model writes 'and', 'or' or a sentence end before 1,000 tokens; the prompt plus 1,000 tokens "
        f"is {CONTEXT}"),
    "test_matched_stop.py::TestMatchedStop::test_finish_stop_eos": (
        "asserts the model ends on its own, with one of Llama-3's EOS ids (128000, 128009) or 2; the prompt plus "
        f"1,000 tokens is {CONTEXT}"),
    "test_openai_server_hidden_states.py::TestOpenAIServerWithEAGLEAndHiddenStatesEnabled": EAGLE.format(
        draft="DEFAULT_DRAFT_MODEL_EAGLE", target="DEFAULT_TARGET_MODEL_EAGLE"),
    "test_openai_server_hidden_states.py::TestOpenAIServerWithEAGLE3AndHiddenStatesEnabled": EAGLE.format(
        draft="jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B", target="meta-llama/Llama-3.1-8B-Instruct"),
    "test_openai_server_ebnf.py::TestOpenAIServerEBNF::test_ebnf_strict_json": (
        "asserts the model closes its '[A-Za-z]+' string within 64 tokens: the grammar allows any number of letters, "
        "and when the random-weight model stops writing them is what its weights say"),
    "test_anthropic_server.py::TestAnthropicServer::test_tool_result_image_content_conversion": (
        "a unit test of sglang's own AnthropicServing (no request to the server): it builds one with object() as its "
        "chat serving, and sglang 0.5.23's constructor reads its supports_inline_system (AttributeError), on "
        "either engine"),
    "test_watermark.py::TestWatermarkRequestEndpoint": (
        "launches with --enable-watermark, which sglang 0.5.23 refuses on any device but cuda ('--enable-watermark "
        "requires --device cuda'); its z-score test also asks for 512 new tokens, over the tiny model's 512-token "
        "context with the prompt"),
}
#: each file's tests that run and pass on both engines
PASSING: dict[str, int] = {
    "test_request_length_validation.py": 8,
    "test_matched_stop.py": 1,
    "test_openai_server_hidden_states.py": 8,
    "test_openai_server_ebnf.py": 1,
    "test_anthropic_server.py": 19,
    "test_watermark.py": 1,
}

INNER_CONFTEST = '''
from pytest_sglworker.engine.cpu_engine import cpu_engine_spec

MODEL = {model!r}


def pytest_sglworker_register_specs(registry):
    registry.add(cpu_engine_spec("tiny-cpu", MODEL))
'''

_RUNS = pytest.StashKey[dict[str, Any]]()


def _run(base: Path, python: Path, model: Path, sources: dict[str, Path], engine: str) -> InnerRun:
    env, command = _prepare_inner(base, python, model, sources, conftest=INNER_CONFTEST)
    env.update(SGLWORKER_COMPAT_MODELS=MODELS, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1")
    if engine == "sim":
        options = ["--sgl-engine", "sim", "--sgl-startup-timeout", "120"]
    else:
        options = ["--sgl-launcher", shlex.join(real_engine_launcher(python)), "--sgl-startup-timeout",
                   str(STARTUP_TIMEOUT)]
    args = [*command, *options, "--sgl-gpus", "sim:1", "--sgl-lease-timeout", "600",
            *[f"--deselect={nodeid}" for nodeid in DESELECTED], *sources]
    return _finish_inner(args, base, env, model, timeout=len(sources) * 2 * (STARTUP_TIMEOUT + 300))


@pytest.fixture(params=["real", "sim"])
def inner(request: pytest.FixtureRequest) -> InnerRun:
    """The inner session of one engine (``real``, ``sim``)."""
    return _cached_run(request, request.param)


def _cached_run(request: pytest.FixtureRequest, engine: str) -> InnerRun:
    """The inner session of ``engine``, run once per outer session (a failure is cached too)."""
    return cached_inner_run(request, _RUNS, engine, FILES, "compat-families", _run)


def _selected(run: InnerRun) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for name in FILES:
        outcomes.update(run.outcomes(name))
    return {nodeid: outcome for nodeid, outcome in outcomes.items()
            if not any(nodeid == d or nodeid.startswith(d + "::") for d in DESELECTED)}


def test_each_file_passes_its_selection(inner: InnerRun) -> None:
    """On each engine: every selected test of every file passes, as many as :data:`PASSING` says."""
    selected = _selected(inner)
    tail = "\n".join(inner.lines[-80:])
    assert selected and set(selected.values()) == {"PASSED"}, f"{selected}\n{tail}"
    counts = {name: sum(nodeid.startswith(name + "::") for nodeid in selected) for name in FILES}
    assert counts == PASSING, counts
    assert inner.ret == pytest.ExitCode.OK, tail
    assert "was still running after" not in inner.stdout  # every class ended its own server


def test_the_engines_have_the_same_outcomes(request: pytest.FixtureRequest) -> None:
    """The real engine and the sim: the same tests, each with the same outcome."""
    real, sim = _selected(_cached_run(request, "real")), _selected(_cached_run(request, "sim"))
    assert real == sim, {k: (real.get(k), sim.get(k)) for k in set(real) | set(sim) if real.get(k) != sim.get(k)}


def test_nothing_is_left_running(inner: InnerRun) -> None:
    assert not inner.leftovers, inner.leftovers
