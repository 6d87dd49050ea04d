"""What every pytest-facing module of the plugin reads: the typed stash keys (the session's own is
:data:`pytest_sglworker.plugin.session.STATE_KEY`), the plugin's fixture names, which model spec a test is
parametrized with, and what kind of pytest process this is (an xdist worker, an xdist controller that distributes
tests, or neither)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from ..engine.specs import ModelSpec

if TYPE_CHECKING:
    from ..workers.config import WorkerConfig  # noqa: F401 - named in a string annotation

__all__ = [
    "CONFIG_KEY",
    "ITEM_ERROR_KEY",
    "NEXT_KEY",
    "PLUGIN_FIXTURES",
    "REPORTS_KEY",
    "SHOWN_KEY",
    "SIGNALS_KEY",
    "WORKERS_KEY",
    "WORKER_FIXTURES",
    "distributing",
    "is_xdist_worker",
    "item_spec",
    "uses_plugin",
    "xdist_worker_id",
]

#: the processes a test used (workers and routers): their logs go into the test's failure report
WORKERS_KEY = pytest.StashKey[list[Any]]()
#: a problem found at collection that fails this test at setup (a bad marker; under xdist a usage error)
ITEM_ERROR_KEY = pytest.StashKey[str]()
#: the test's worker configuration, resolved at collection
CONFIG_KEY = pytest.StashKey["WorkerConfig"]()
#: the test's reports by phase (``setup``, ``call``, ``teardown``), for its fixtures' teardown
REPORTS_KEY = pytest.StashKey[dict[str, pytest.TestReport]]()
#: the test that runs after this one (what launch ahead looks at under xdist)
NEXT_KEY = pytest.StashKey["pytest.Item | None"]()
#: signals the test sent through os.kill/os.killpg during its call (``SignalSent`` records)
SIGNALS_KEY = pytest.StashKey[list[Any]]()
#: ids of the processes whose failure text (diagnosis and tail) a failure of this test already shows
SHOWN_KEY = pytest.StashKey[set[int]]()

#: the fixtures that launch workers, and the marker each one reads
WORKER_FIXTURES = ("sgl_worker", "sgl_workers", "sgl_router")
#: the group of the test's ``sgl_worker`` (the router fronts it when the test has no ``sgl_workers``)
WORKER_GROUP_KEY = pytest.StashKey[Any]()


def router_group_fixture(fixturenames: Any) -> str:
    """The fixture whose workers ``sgl_router`` fronts: ``sgl_worker`` when the test uses it and not
    ``sgl_workers``, else ``sgl_workers``."""
    return "sgl_worker" if "sgl_worker" in fixturenames and "sgl_workers" not in fixturenames else "sgl_workers"
#: every fixture of the plugin
PLUGIN_FIXTURES = frozenset({"sgl_model", "sgl_registry", "sgl_spawn_worker", *WORKER_FIXTURES})


def uses_plugin(item: pytest.Item) -> bool:
    """Whether a test asks for one of the plugin's fixtures; its markers mean nothing without one."""
    return not PLUGIN_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def item_spec(item: pytest.Item) -> ModelSpec | None:
    """The model spec ``item`` is parametrized with (``sgl_model``), or None."""
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("sgl_model") if callspec is not None else None
    return spec if isinstance(spec, ModelSpec) else None


def is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker (it cannot stop the session: per-test errors instead)."""
    return getattr(config, "workerinput", None) is not None


def xdist_worker_id(config: pytest.Config) -> str | None:
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput.get("workerid")) if isinstance(workerinput, dict) else None


def distributing(config: pytest.Config) -> bool:
    """Whether this process is an xdist controller that distributes tests (``-n N``/``--tx``)."""
    if is_xdist_worker(config):
        return False
    try:
        return (config.getoption("dist") not in (None, "no") and bool(config.getoption("tx"))
                and not config.getoption("collectonly"))
    except ValueError:  # pytest-xdist's options are not registered
        return False


#: ``workerinput`` key of the run's private directory, where xdist workers write their collection maps and the
#: controller its launch-ahead word (:mod:`.xdist_scheduling`, :mod:`.launch_hints`)
MAP_INPUT = "sglworker_collection_map"
#: the ``workerinput`` key of the run an xdist worker is part of (the controller's pid, start time and session id),
#: whose groups launched ahead are handed over within it (:mod:`..workers.pool_warm`)
RUN_INPUT = "sglworker_run"
