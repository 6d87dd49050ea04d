"""Options, model selection, the collection-time budget check and marker errors, through real pytest
sessions (no worker is launched here)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")

SPEC_CONFTEST = """
from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec("tiny", "org/tiny", 1, features={{"chat"}}, worker_args={args!r}))
"""


def test_list_models_prints_registry_and_exits(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SPEC_CONFTEST.format(args=("--mem-fraction-static=0.5", "--cuda-graph-backend-prefill",
                                                     "disabled")))
    pytester.makepyfile("def test_never_runs(): raise AssertionError")
    compact = pytester.runpytest("--sgl-list-models")
    assert compact.ret == 0
    compact.stdout.fnmatch_lines([
        "pytest-sglworker model registry (memory ledger for: *):",
        "  name*model*GPUs x memory*features*budget*ledger verdict",
        "  llama-1b *meta-llama/Llama-3.2-1B-Instruct *1 x 4 GB *chat, streaming *ok *fits (KV *tokens)",
        "  tiny *org/tiny *ok *unknown model dims",
        "(-v: every spec in full, with its memory ledger)",
    ])
    assert "->" not in compact.stdout.str() and "ledger:" not in compact.stdout.str()
    result = pytester.runpytest("--sgl-list-models", "-v")
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "pytest-sglworker model registry*",
        "  llama-1b", "*model:*meta-llama/Llama-3.2-1B-Instruct*", "*memory:*4 GB*tp: 1*",
        "*features:*chat, streaming*", "*worker_args: --mem-fraction-static=0.6 --cuda-graph-backend-prefill=disabled",
        "*budget:      ok",
        "  tiny", "*model:*org/tiny*",
    ])
    result.stdout.no_fnmatch_line("*test_never_runs*")


def test_models_parametrize_sgl_model_with_spec_names(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        def test_model(sgl_model):
            assert sgl_model.name in ("qwen3-0.6b", "llama-1b")
    """)
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b", "--sgl-model=llama-1b", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*test_model[[]qwen3-0.6b[]]", "*test_model[[]llama-1b[]]"])
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b,llama-1b", "-v")
    result.assert_outcomes(passed=2)


def test_no_model_selected_skips_with_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_model(sgl_model): pass")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no sglang model selected: run with --sgl-model NAME*"])


def test_unknown_model_is_usage_error_listing_known(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--sgl-model", "qwen3-06b")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sgl-model: unknown model(s) 'qwen3-06b'; known: llama-1b, llama-8b, qwen3-0.6b*"])


def test_models_from_env_and_ini_with_precedence(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nsgl_models = llama-8b\n")
    pytester.makepyfile("def test_model(sgl_model): print('MODEL', sgl_model.name)")
    result = pytester.runpytest("-s")
    result.stdout.fnmatch_lines(["*MODEL llama-8b*"])
    monkeypatch.setenv("SGLWORKER_MODELS", "llama-1b")
    result = pytester.runpytest("-s")
    result.stdout.fnmatch_lines(["*MODEL llama-1b*"])
    result = pytester.runpytest("-s", "--sgl-model", "qwen3-0.6b")
    result.stdout.fnmatch_lines(["*MODEL qwen3-0.6b*"])


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--mem-fraction-static=0.6",), ["--cuda-graph-backend-prefill: missing"]),
        (("--cuda-graph-backend-prefill=disabled",), ["--mem-fraction-static: missing"]),
        (("--mem-fraction-static", "0.8", "--cuda-graph-backend-prefill", "disabled"), ["0.8 is above the budget"]),
        (("--mem-fraction-static=0.6", "--cuda-graph-backend-prefill", "breakable"), ["'breakable' re-enables"]),
    ],
)
def test_spec_without_budget_stops_the_session(pytester: pytest.Pytester, args: tuple[str, ...],
                                               fragments: list[str]) -> None:
    pytester.makeconftest(SPEC_CONFTEST.format(args=args))
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*model spec 'tiny' (org/tiny) breaks the mandatory worker budget:*"])
    for fragment in fragments:
        result.stderr.fnmatch_lines([f"*{fragment}*"])
    result.stderr.fnmatch_lines(["*fix: add CI_WORKER_ARGS*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_spec_in_subdirectory_conftest_is_checked_too(pytester: pytest.Pytester) -> None:
    sub = pytester.mkpydir("sub")
    (sub / "conftest.py").write_text(SPEC_CONFTEST.format(args=("--mem-fraction-static=0.9",)))
    (sub / "test_sub.py").write_text("def test_x(): pass\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*model spec 'tiny'*breaks the mandatory worker budget*"])


def test_marker_args_that_loosen_budget_are_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(args=["--mem-fraction-static", "0.85"])
        def test_loose(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--mem-fraction-static", "0.4", "--max-total-tokens", "256"])
        def test_tight(sgl_worker): pass
    """)
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*test_loose[[]qwen3-0.6b[]]*breaks the mandatory worker budget*",
        "*0.85 is above the budget of 0.6*",
        "*sgl_budget_opt_out(reason=*",
    ])
    assert "test_tight" not in result.stderr.str()


def test_unknown_marker_kwarg_is_a_clear_error_on_that_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(argz=["--x"])
        def test_typo(sgl_worker): pass

        def test_other(): pass
    """)
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*sgl_worker got unknown argument(s) argz; known: allow_foreign_host, args, env*"])


def test_opt_out_marker_needs_a_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_budget_opt_out()
        @pytest.mark.sgl_worker(args=["--mem-fraction-static", "0.85"])
        def test_loose(sgl_worker): pass
    """)
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*sgl_budget_opt_out needs a reason*"])


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--sgl-engine", "gpu", "'gpu' is not an engine; choose 'real' or 'sim'"),
        ("--sgl-startup-timeout", "soon", "'soon' is not a number of seconds"),
        ("--sgl-startup-timeout", "0", "must be greater than 0"),
        ("--sgl-lease-timeout", "-5", "must be greater than 0"),
        ("--sgl-launcher", "'unbalanced", "cannot split launcher"),
        ("--sgl-tail-lines", "many", "is not an integer"),
        ("--sgl-reuse", "maybe", "is not 'on' or 'off'"),
    ],
)
def test_bad_option_values_are_usage_errors(pytester: pytest.Pytester, option: str, value: str,
                                            fragment: str) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(f"{option}={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{option}: invalid value*{fragment}*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_bad_env_value_names_the_variable(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLWORKER_STARTUP_TIMEOUT", "abc")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*SGLWORKER_STARTUP_TIMEOUT: invalid value 'abc'*"])


def test_bad_ini_value_names_the_key(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nsgl_engine = fake\n")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini sgl_engine: invalid value 'fake'*"])


def test_requires_marker_skips_models_without_the_feature(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SPEC_CONFTEST.format(args=("--mem-fraction-static=0.6",
                                                     "--cuda-graph-backend-prefill=disabled")))
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_requires("streaming")
        def test_stream(sgl_model): pass
    """)
    result = pytester.runpytest("--sgl-model", "qwen3-0.6b,tiny", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*model tiny lacks feature(s) streaming required by @pytest.mark.sgl_requires*"])


def test_header_shows_models_and_engine(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--sgl-model", "llama-1b", "--sgl-engine", "sim")
    result.stdout.fnmatch_lines(["sglworker: models: llama-1b; engine: sim (simulated engine)*"])


def test_plugin_is_quiet_when_unused(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # no option of the plugin's set by the environment either (the suite's conftest sets a port range under xdist;
    # the test mark is no option)
    for key in [k for k in os.environ if k.startswith("SGLWORKER_") and k != "SGLWORKER_TEST_MARK"]:
        monkeypatch.delenv(key)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "sglang workers" not in result.stdout.str()
    assert "sglworker:" not in result.stdout.str()


def test_budget_violation_under_xdist_fails_the_test_not_the_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(args=["--mem-fraction-static", "0.85"])
        def test_loose(sgl_worker): pass

        def test_other(): pass
    """)
    result = pytester.runpytest_subprocess("-n", "2", "--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*0.85 is above the budget of 0.6*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_model_selection_all_feature_and_did_you_mean(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
        from pytest_sglworker import ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("embed-a", "org/embed", 4, features={"embedding"}))
    """)
    pytester.makepyfile("def test_m(sgl_model): print('MODEL', sgl_model.name)")
    everything = pytester.runpytest("--sgl-model", "all", "--collect-only", "-q")
    assert {line.split("[")[1].rstrip("]") for line in everything.outlines if "test_m[" in line} == {
        "embed-a", "llama-1b", "llama-8b", "qwen3-0.6b"}
    embedding = pytester.runpytest("--sgl-model", "feature:embedding,qwen3-0.6b", "--collect-only", "-q")
    assert [line for line in embedding.outlines if "test_m[" in line] == [
        "test_model_selection_all_feature_and_did_you_mean.py::test_m[embed-a]",
        "test_model_selection_all_feature_and_did_you_mean.py::test_m[qwen3-0.6b]"]
    typo = pytester.runpytest("--sgl-model", "qwen3-06b", "--collect-only")
    typo.stderr.fnmatch_lines(["*unknown model(s) 'qwen3-06b'; known: *; did you mean 'qwen3-0.6b'?*"])
    none = pytester.runpytest("--sgl-model", "feature:vision", "--collect-only")
    none.stderr.fnmatch_lines(["*no registered model has feature 'vision'; features: chat, embedding, streaming*"])


UNUSED_PROBE = """
import sys

def pytest_sessionfinish(session):
    loaded = sorted(m for m in sys.modules if m.startswith("pytest_sglworker."))
    run_hooks = session.config.pluginmanager.get_plugin("sglworker-run") is not None
    print(f"\\nMODULES {' '.join(loaded)}\\nRUN_HOOKS {run_hooks}")
"""


def test_a_run_that_asks_for_no_worker_stays_cheap(pytester: pytest.Pytester) -> None:
    """Installed but unused (the plugin is loaded into every pytest run of its environment): no per-test hook is
    registered, and neither the collection-time work, the pool, the launcher, attached workers nor the xdist
    scheduler is imported. A run with a worker test registers the per-test hooks."""
    pytester.makeconftest(UNUSED_PROBE)
    pytester.makepyfile(test_plain="def test_a(): pass\ndef test_b(): pass\n")
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    modules = set(next(line for line in result.outlines if line.startswith("MODULES")).split()[1:])
    heavy = {f"pytest_sglworker.{m}" for m in ("collection", "pool", "launcher", "attached", "xdist_scheduling",
                                                "health", "kinds", "grpc_worker", "gpus")}
    assert not modules & heavy, sorted(modules & heavy)
    result.stdout.fnmatch_lines(["RUN_HOOKS False"])
    pytester.makepyfile(test_worker="def test_w(sgl_worker): pass\n")
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-model",
                                           "qwen3-0.6b", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["RUN_HOOKS True"])
