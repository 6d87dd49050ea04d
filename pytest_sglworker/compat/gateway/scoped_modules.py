"""The modules ``fixtures`` and ``util`` of upstream's older gRPC suite, for its files only: while pytest imports a
test file under a folder named ``e2e_grpc`` (:func:`serving_e2e_grpc`), ``sys.modules`` holds the drop-in's
``fixtures`` (:func:`.e2e_grpc.popen_launch_workers_and_router`) and ``util`` (:mod:`.grpc_util`) under those names;
what it held before (a suite's own ``util``, or nothing) is put back right after, so every other file imports its
own. ``sys.modules`` is consulted before the path, so upstream's ``fixtures.py``/``util.py`` beside the files are not
imported for them (see :mod:`.e2e_grpc`).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Generator
from typing import Any

import pytest

from . import grpc_util
from .e2e_grpc import NOT_OFFERED, popen_launch_workers_and_router

__all__ = ["FIXTURES_MODULE", "SUITE_FOLDER", "UTIL_MODULE", "pytest_make_collect_report", "serving_e2e_grpc"]

#: the folder whose test files get the drop-in's ``fixtures`` and ``util``
SUITE_FOLDER = "e2e_grpc"
FIXTURES_MODULE = "fixtures"
UTIL_MODULE = "util"


def _fixtures_module() -> types.ModuleType:
    module = types.ModuleType(FIXTURES_MODULE, "upstream's e2e_grpc/fixtures.py, served by "
                                               "pytest_sglworker.compat.gateway.e2e_grpc")
    module.popen_launch_workers_and_router = popen_launch_workers_and_router  # type: ignore[attr-defined]
    module.__all__ = ["popen_launch_workers_and_router"]  # type: ignore[attr-defined]

    def __getattr__(name: str) -> Any:
        if name in NOT_OFFERED:
            raise ImportError(f"fixtures.{name} is upstream's own and pytest_sglworker.compat.gateway does not offer "
                              f"it: {NOT_OFFERED[name]}", name=name)
        raise AttributeError(f"module 'fixtures' (pytest_sglworker.compat.gateway.e2e_grpc) has no attribute "
                             f"{name!r}")

    setattr(module, "__getattr__", __getattr__)  # noqa: B010  (a module's own __getattr__, PEP 562)
    return module


def _dropin_modules() -> dict[str, types.ModuleType]:
    return {FIXTURES_MODULE: _fixtures_module(), UTIL_MODULE: grpc_util}


def serving_e2e_grpc(path: Any) -> bool:
    """Whether the test file at ``path`` is one of the e2e_grpc suite's: under a folder named ``e2e_grpc``."""
    return SUITE_FOLDER in getattr(path, "parts", ())[:-1]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    """While pytest imports a test file of the e2e_grpc suite, ``fixtures`` and ``util`` are the drop-in's; what
    ``sys.modules`` held under those names before is put back after."""
    if not (isinstance(collector, pytest.Module) and serving_e2e_grpc(collector.path)):
        return (yield)
    saved = {name: sys.modules.get(name) for name in (FIXTURES_MODULE, UTIL_MODULE)}
    sys.modules.update(_dropin_modules())
    try:
        return (yield)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
