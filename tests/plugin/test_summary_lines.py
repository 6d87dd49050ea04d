"""Lines around the run that say what the header or the summary could not say before: how many workers sglang's
unittest files will launch through the drop-in (after collection), and, at the end of a ``--sgl-keep-warm``
session, each configuration not kept warm and why."""

from __future__ import annotations

import pytest

from pytest_sglworker.resources.warm import stop_warm

SIM = ["--sgl-engine", "sim", "--sgl-gpus", "sim:2", "-p", "no:cacheprovider", "-p", "no:xdist"]


def test_the_compat_header_counts_the_workers_it_will_launch(pytester: pytest.Pytester,
                                                             sim_env: dict[str, str]) -> None:
    """A session of sglang's unittest files (their import line changed to the drop-in) says after collection how
    many servers their classes start (one per class whose setUpClass starts it), not that no worker test was
    collected."""
    pytester.makepyfile(test_suite_a="""
        import unittest
        from pytest_sglworker.compat import popen_launch_server

        class TestServed(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                cls.process = popen_launch_server("org/model", "http://127.0.0.1:1", timeout=1)

            def test_one(self):
                pass

            def test_two(self):
                pass

        class TestPlain(unittest.TestCase):
            def test_three(self):
                pass
    """, test_suite_b="""
        import unittest
        from pytest_sglworker.compat import popen_launch_server

        class Base(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                cls.process = popen_launch_server("org/model", "http://127.0.0.1:1", timeout=1)

        class TestFirst(Base):
            def test_four(self):
                pass

        class TestSecond(Base):
            def test_five(self):
                pass
    """, test_other="""
        import unittest

        class TestNotCompat(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                pass

            def test_six(self):
                pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--collect-only", timeout=60)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["collected 6 items",
                                 "sglworker: pytest_sglworker.compat starts the servers of 3 test classes in 2 files "
                                 "(popen_launch_server in setUpClass): about 3 workers, each one's flags checked by "
                                 "sglang's parser as it launches"])
    assert "no worker test collected" not in result.stdout.str()


def test_the_warm_summary_says_why_a_group_was_not_kept(pytester: pytest.Pytester, sim_env: dict[str, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration whose group a test stopped on purpose is not kept warm at the session's end: the summary
    says so, and why; the configuration that was kept is not listed as not kept."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("SGLWORKER_KEEP_WARM", raising=False)
    pytester.makepyfile(test_warm="""
        import pytest

        @pytest.mark.sgl_worker(env={"WARM_KIND": "stopped"})
        def test_stops_its_worker(sgl_worker):
            sgl_worker.kill()
            sgl_worker.process.wait(10)

        @pytest.mark.sgl_worker(env={"WARM_KIND": "kept"})
        def test_keeps_its_worker(sgl_worker):
            assert sgl_worker.client.get("/health").status_code == 200
    """)
    try:
        result = pytester.runpytest_subprocess(*SIM, "--sgl-model", "qwen3-0.6b", "--sgl-keep-warm=60",
                                               "--sgl-reorder", "off", timeout=120)
        result.assert_outcomes(passed=2)
        out = result.stdout.str()
        result.stdout.fnmatch_lines(["sglworker: kept warm until *: qwen3-0.6b env WARM_KIND=kept (pid *",
                                     "sglworker: not kept warm: qwen3-0.6b env WARM_KIND=stopped: a member was stopped "
                                     "on purpose (worker.kill(), or an exit it expected)"])
        assert "not kept warm: qwen3-0.6b env WARM_KIND=kept" not in out
    finally:
        stop_warm(sim_env["SGLWORKER_LOCK_DIR"])
