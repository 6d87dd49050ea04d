"""Worker flags checked by sglang's own parser at collection, before any GPU time is spent."""

from __future__ import annotations

import sys

import pytest

from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python

REAL_PY = real_engine_python()
needs_sglang = pytest.mark.skipif(REAL_PY is None, reason=real_engine_missing_reason() or "no real engine")


def _launcher() -> str:
    return f"{REAL_PY} -m sglang.launch_server"


@pytest.mark.real_engine
@needs_sglang
def test_misspelt_marker_flag_is_usage_error_quoting_sglang(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(args=["--max-totl-tokens", "512"])
        def test_typo(sgl_worker): pass

        @pytest.mark.sgl_worker(args=["--cuda-graph-backend-decode", "sometimes"])
        def test_choice(sgl_worker): pass
    """)
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-launcher", _launcher(),
                                           "--sgl-gpus", "sim:1", "--collect-only", timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "test test_misspelt_marker_flag_is_usage_error_quoting_sglang.py::test_typo[qwen3-0.6b]" in err
    assert "unrecognized arguments: --max-totl-tokens" in err
    assert "invalid choice: 'sometimes' (choose from 'full', 'breakable', 'disabled')" in err
    assert "INTERNALERROR" not in err + result.stdout.str()


@pytest.mark.real_engine
@needs_sglang
def test_misspelt_spec_flag_is_usage_error_and_header_shows_version(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
        from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("typo", "org/typo", 1, worker_args=(*CI_WORKER_ARGS, "--chunked-prefil-size", "1")))
    """)
    pytester.makepyfile("def test_x(sgl_worker): pass")
    # every registered spec is checked, not only the selected ones (as the budget check does)
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-launcher", _launcher(),
                                           "--sgl-gpus", "sim:1", "--collect-only", timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*model spec 'typo': sglang 0.5.23 rejects its worker args:*",
                                 "*unrecognized arguments: --chunked-prefil-size*"])
    # without the bad spec the session runs, and the header says the flags were checked by sglang's parser
    (pytester.path / "conftest.py").unlink()
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-launcher", _launcher(),
                                           "--sgl-gpus", "sim:1", "--collect-only", timeout=300)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["sglworker: worker flags checked by sglang 0.5.23's own parser"])


def test_header_says_flags_not_checked_without_sglang(pytester: pytest.Pytester) -> None:
    """On the simulated engine that is information, not a problem: the sim parses sglang's flags as each worker
    starts. Another launcher (the real engine's python without sglang) is not checked, and the header says why."""
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim", "--collect-only")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["sglworker: worker flags checked by the simulated engine as each worker starts *"])
    assert "not checked" not in result.stdout.str()
    result = pytester.runpytest_subprocess("--sgl-model", "qwen3-0.6b", "--sgl-engine", "sim", "--sgl-launcher",
                                           f"{sys.executable} -m pytest_sglworker.sim", "--collect-only")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["sglworker: worker flags not checked: sglang is not importable by *"])
