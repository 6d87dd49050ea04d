"""What ``pytest --markers``, ``pytest --help`` and the generated reference (docs/reference/) show as defaults are
the code's: every ``keyword=default`` of a marker's help line is the default of its typed object
(plugin/markers.py), so the help cannot show a default the plugin does not use (``policy='round_robin'`` while
the router's own policy applies), and an option's ``(default N)`` is its default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pytest_sglworker.plugin import markers

CASES = [(markers.WORKER_MARKER_DOC, markers.WorkerMarker), (markers.WORKERS_MARKER_DOC, markers.WorkersMarker),
         (markers.ROUTER_MARKER_DOC, markers.RouterMarker)]


@pytest.mark.parametrize(("doc", "cls"), CASES, ids=[cls.__name__ for _, cls in CASES])
def test_the_help_shows_the_real_defaults(doc: str, cls: type) -> None:
    signature = doc.split("):", 1)[0].split("(", 1)[1]
    shown = dict(re.findall(r"(\w+)=('[^']*'|\(\)|None|True|False|[\d.]+)", signature))
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    compared = {key: value for key, value in shown.items() if key in defaults}
    assert compared, shown
    assert {key: repr(defaults[key]) for key in compared} == compared


def test_pytest_markers_shows_the_routers_own_policy(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--markers")
    line = next(line for line in result.outlines if line.startswith("@pytest.mark.sgl_router("))
    assert "policy=None" in line and "the router's own" in line, line


def test_the_options_help_shows_the_real_defaults() -> None:
    """``(default 600)`` and ``'all' (default)`` in an option's help (and so in docs/reference/options.md) are the
    option's default in the code."""
    from pytest_sglworker.plugin.options import OPTIONS

    checked = 0
    for opt in OPTIONS:
        for shown in re.findall(r"\(default (\d+(?:\.\d+)?)\b", opt.help):
            parts = opt.default if isinstance(opt.default, tuple) else (opt.default,)  # --sgl-dist: ('auto', 4)
            assert float(shown) in [float(part) for part in parts if isinstance(part, (int, float))], (opt.name, shown)
            checked += 1
        for shown in re.findall(r"'([\w-]+)' \([^):]*\bdefault\b\)", opt.help):
            assert (opt.parse(shown) if opt.parse else shown) == opt.default, (opt.name, shown, opt.default)
            checked += 1
    assert checked >= 5


def test_the_worker_fixtures_name_what_a_test_uses() -> None:
    """``pytest --fixtures`` (and docs/reference/fixtures.md) says what ``sgl_worker`` and ``sgl_workers`` give:
    every attribute their docstrings name exists, and the ones users had to guess are named."""
    import inspect

    from pytest_sglworker.plugin import fixtures, hookspecs
    from pytest_sglworker.workers.group import WorkerGroup
    from pytest_sglworker.workers.launcher import ModelInstance

    def exists(cls: type, name: str) -> bool:
        return hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {})

    for fixture, cls in ((fixtures.sgl_worker, ModelInstance), (fixtures.sgl_workers, WorkerGroup)):
        doc = inspect.getdoc(fixture) or ""
        names = set(re.findall(r"``\.(\w+)", doc))
        assert names, doc
        missing = [n for n in names if not exists(cls, n) and not exists(ModelInstance, n)]
        assert not missing, (fixture, missing)
        for hook in re.findall(r"``(pytest_sglworker_\w+)\(", doc):
            assert hasattr(hookspecs, hook), hook
    worker_doc = Path(fixtures.__file__).read_text()  # the source, as scripts/gen_reference.py reads it
    for needed in ("``.log_path``", "``.log_tail(lines=40)``", "one string", "``.requests_served()``",
                   "``sgl_workers.prefill[0]``", "pytest_sglworker_worker_env", "pytest_sglworker_register_specs"):
        assert needed in worker_doc, needed
