"""The launch-ahead fix the benchmark proposes, as a pytest plugin (``-p proposed_launch_ahead``, with ``bench/``
on ``PYTHONPATH``); ``bench/run.py`` part ``ahead`` runs it with ``--sgl-launch-ahead 2`` next to the plugin as
committed.

What it changes: the plugin considers a launch ahead only in ``pytest_runtest_call``, once a test's own workers
are in place. When a configuration's last test ends, its workers are retired and their GPU comes free, but
nothing is launched on it until the next test has its workers, and that test is waiting for the configuration
launched ahead, a whole startup. So on 2 GPUs with tests short next to the startup, each launch overlaps only
the previous configuration's tests. This plugin asks for the same launches ahead again right after each test's
teardown (when a GPU may just have come free). ``--sgl-launch-ahead 2`` because the next configuration is
usually the one already launching: with 1 the launch ahead looks no further.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    session = item.config.pluginmanager.get_plugin("sglworker-session")
    if session is None or nextitem is None:
        return
    # After this test's fixtures were torn down: its workers are pooled again, or retired if it was the last
    # test of their configuration, so a GPU may be free. The same choice as after a test's setup.
    session.pytest_runtest_call(item)
