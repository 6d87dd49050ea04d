"""Drop-ins for sglang's own unittest suites: run a file that starts its servers with ``popen_launch_server`` under
pytest, through the plugin, by changing one import line::

    from sglang.test.test_utils import (DEFAULT_SMALL_MODEL_NAME_FOR_TEST, DEFAULT_URL_FOR_TEST, CustomTestCase,
                                        popen_launch_server)
    # becomes
    from pytest_sglworker.compat import (DEFAULT_SMALL_MODEL_NAME_FOR_TEST, DEFAULT_URL_FOR_TEST, CustomTestCase,
                                         popen_launch_server)

Why a module that stands in for ``sglang.test.test_utils`` (and not a ``TestCase`` mixin): sglang's suites import
``popen_launch_server`` and the constants from that one module in one statement, so swapping the module is the
smallest change a file can take, and it keeps the file's classes, bases and ``setUpClass`` exactly as upstream
wrote them (a mixin would change every class line). The rest of the file stays sglang's: its
``from sglang.srt.utils import kill_process_tree`` still kills the server in ``tearDownClass``, and the plugin
notices (see :mod:`.launches`).

What this module gives:

- :func:`popen_launch_server`: sglang's signature; the server is a worker of the plugin: the model name resolved
  to a registered spec (:mod:`.models`), ``other_args`` held to the mandatory budget (a violation is an error that
  names the test class and the fix, unless :func:`budget_opt_out` or ``@pytest.mark.sgl_budget_opt_out`` says
  why) and to sglang's own parser, a GPU lease, the port of ``base_url`` (loopback only), a log file per port,
  the readiness wait that watches the process, a startup failure raised with its diagnosis and log tail, and the
  log section in the report of every failing test it served. Returns a ``Popen``-like :class:`ServerProcess`.
- :func:`kill_process_tree`: sglang's signature; ends one of those servers through the plugin (a stop, its lease
  given back), or any other tree as sglang does.
- :func:`map_model` / ``SGLWORKER_COMPAT_MODELS``: which spec serves a model name; :func:`budget_opt_out`: which
  tests may break the budget, and why; :func:`rename_flag`: a flag the engine's version renamed. Call them from a
  ``conftest.py``.
- Every other public name of ``sglang.test.test_utils`` (``CustomTestCase``, ``DEFAULT_URL_FOR_TEST``,
  ``DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH``, ...), read from sglang when first asked for (sglang must be importable
  for those). The ``DEFAULT_*MODEL*`` constants follow the spec mapping: one that a spec serves is the path that
  spec's worker loads, so that ``get_tokenizer(DEFAULT_SMALL_MODEL_NAME_FOR_TEST)`` in a test reads the model its
  server runs. A helper of that module that starts an engine itself (``run_bench_serving``,
  ``run_and_check_memory_leak``, ...) starts it through the plugin's launch, or is refused naming the supported
  path (:mod:`.helpers`).

Outside a pytest session with the plugin (``python -m unittest``), :func:`popen_launch_server` and
:func:`kill_process_tree` are sglang's own: the file runs as it did upstream.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ..engine.specs import SpecRegistry, active_registry
from .dropins import kill_process_tree, popen_launch_server
from .helpers import helper
from .models import ENV_MODELS, CompatError, budget_opt_out, map_model, mapped_constant, rename_flag

if sys.modules.get("pytest") is not None:
    # A pytest run: the runtime is registered with the session in progress and every session that starts. Elsewhere
    # (an engine's scheduler importing the test module to unpickle a logit processor) nothing needs pytest.
    from . import launches as _launches  # noqa: F401

__all__ = [
    "ENV_MODELS",
    "CompatError",
    "ServerProcess",
    "budget_opt_out",
    "kill_process_tree",
    "map_model",
    "popen_launch_server",
    "rename_flag",
]

#: the module whose public names this one re-exports
SGLANG_TEST_UTILS = "sglang.test.test_utils"


def __getattr__(name: str) -> Any:
    """A public name of ``sglang.test.test_utils``, read from sglang (a model constant follows the spec mapping).
    Without sglang, asking for one is an ``ImportError`` that says so (``from pytest_sglworker.compat import
    CustomTestCase`` shows it as it is)."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "ServerProcess":  # it needs pytest: imported when asked for
        from .launches import ServerProcess

        return ServerProcess
    try:
        module = importlib.import_module(SGLANG_TEST_UTILS)
    except Exception as exc:
        raise ImportError(f"pytest_sglworker.compat re-exports {name!r} from {SGLANG_TEST_UTILS}, which this Python "
                          f"cannot import ({type(exc).__name__}: {exc}); install sglang here, or import only the "
                          "drop-ins (popen_launch_server, kill_process_tree)", name=name) from None
    if not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (nor has {SGLANG_TEST_UTILS})")
    launching = helper(name, module)  # a helper that starts an engine: through the plugin, or refused
    if launching is not None:
        return launching
    return mapped_constant(name, getattr(module, name), _registry())


def _registry() -> SpecRegistry:
    """The running session's registry; the built-ins outside a pytest run."""
    if sys.modules.get("pytest") is not None:
        from ..plugin.session import active_session

        session = active_session()
        if session is not None:
            return session.registry
    return active_registry()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
