"""The pytest entry point of pytest-sglworker (``pytest11``: ``sglworker = pytest_sglworker.plugin``): it registers
the plugin objects (the session, collection, the reporter, the xdist hooks) and exposes the fixtures.

The pytest-facing layer, this package, is the only one that imports pytest. It is loaded into every pytest run of
an environment that installs the package, so it imports nothing heavy at module level: httpx, psutil, pynvml,
filelock and sglang are imported when a worker is first needed.
"""

from __future__ import annotations

import os

import pytest

from ..engine.specs import set_active_registry
from .collection import Collection
from .fixtures import SpawnWorker, sgl_model, sgl_registry, sgl_router, sgl_spawn_worker, sgl_worker, sgl_workers
from .keys import distributing, is_xdist_worker
from .markers import MARKER_DOCS
from .session import STATE_KEY, SglSession


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    from .options import add_options

    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    from .options import resolve_settings
    from .reporter import SglReporter

    for doc in MARKER_DOCS:
        config.addinivalue_line("markers", doc)
    session = SglSession(config, resolve_settings(config))
    config.stash[STATE_KEY] = session
    session.register_all()
    set_active_registry(session.registry)
    config.pluginmanager.register(session, "sglworker-session")
    config.pluginmanager.register(Collection(session), "sglworker-collection")
    if session.settings.report or session.settings.timeline or session.settings.trace:
        from .run_hooks import enable_run_hooks

        enable_run_hooks(session)  # every test's time goes into the run report (an xdist controller collects none)
    config.pluginmanager.register(SglReporter(session), "sglworker-reporter")
    if config.pluginmanager.hasplugin("xdist") and (distributing(config) or is_xdist_worker(config)):
        # a run without -n has nothing for them to do: not even a call per test report (cheap when unused)
        from .xdist_hooks import XdistHooks

        config.pluginmanager.register(XdistHooks(session), "sglworker-xdist")
    session.install_signal_handlers()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    warm = config.getoption("sgl_warm")
    if warm:
        from ..resources import state
        from .options import resolve_settings
        from .reporter import render_warm

        settings = resolve_settings(config)
        lock_dir = settings.lock_dir or state.default_lock_dir()
        if not os.path.lexists(lock_dir):  # a dangling symlink exists: it is refused below, never "none"
            print(f"pytest-sglworker warm workers in {lock_dir}:\n  none (no lock directory)")
            return 0
        try:  # the check of a session's lock directory, and its usage error (a symlink, writable by others)
            lock_dir = state.ensure_private_dir(lock_dir, what="lock directory",
                                                shared_ok=settings.lock_dir is not None)
        except state.UnsafeDirectory as exc:
            raise pytest.UsageError(str(exc)) from None
        text, code = render_warm(lock_dir, warm)
        print(text)
        return code
    if not config.getoption("sgl_list_models"):
        return None
    from .options import resolve_settings
    from .reporter import render_registry

    settings = resolve_settings(config)
    session = SglSession(config, settings)
    session.register_all()
    print(render_registry(session.registry, settings, verbose=config.get_verbosity() > 0))
    return 0


__all__ = ["SpawnWorker", "sgl_model", "sgl_registry", "sgl_router", "sgl_spawn_worker", "sgl_worker",
           "sgl_workers"]
