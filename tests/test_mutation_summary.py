"""The mutation run of the core promises (scripts/mutation.py, docs/TESTING.md).

By default (cheap): the committed summary covers every target the script defines, each with at least the goal's
share of its mutants killed, its counts adding up, its scope naming definitions that exist, and every surviving
mutant explained in docs/TESTING.md. In the slow tier: the script runs one target end to end on a copy of the
checkout (it mutates files in place; other tests running meanwhile must never import a mutant) and writes a summary
of that shape meeting the goal.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Targets whose last run is below the goal, every survivor of them explained in docs/TESTING.md, each with why the
#: goal is not met. None today; the check fails once such a target reaches the goal, so that it leaves this list.
BELOW_GOAL: dict[str, str] = {}
SUMMARY = REPO / "tests" / "data" / "mutation" / "summary.json"
TESTING_DOC = REPO / "docs" / "TESTING.md"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglworker_mutation_script", REPO / "scripts" / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def check_summary(summary: dict[str, object], script: ModuleType, names: list[str],
                  below_goal: Collection[str] = ()) -> None:
    modules = summary["modules"]
    assert isinstance(modules, dict)
    assert sorted(modules) == sorted(names)
    assert summary["tool"].startswith("cosmic-ray ")  # type: ignore[union-attr]
    for name, result in modules.items():
        target = script.TARGETS[name]
        assert result["path"] == target.path and (REPO / target.path).is_file()
        assert result["mutants"] > 0, name
        assert result["killed"] + result["survived"] == result["mutants"], name
        assert result["timeouts"] <= result["killed"], name
        assert len(result["survivors"]) == result["survived"], name
        reached = result["killed"] / result["mutants"] >= summary["goal"] >= 0.9  # type: ignore[operator]
        assert reached is (name not in below_goal), (
            f"{name}: {result['killed']} of {result['mutants']} mutants killed"
            + (", below the goal" if not reached else ": the goal is reached, take it off BELOW_GOAL"))
        for survivor in result["survivors"]:
            assert {"line", "operator", "mutated"} <= set(survivor), name


def test_the_committed_summary_meets_the_goal_for_every_target() -> None:
    script = load_script()
    summary = json.loads(SUMMARY.read_text())
    check_summary(summary, script, list(script.TARGETS), below_goal=BELOW_GOAL)
    for name, target in script.TARGETS.items():
        script.scope_ranges(REPO / target.path, target.scope)  # every scoped definition still exists
        assert summary["modules"][name]["scope"] == (list(target.scope) if target.scope else None), (
            f"{name}: the summary was made with another scope; rerun scripts/mutation.py --module {name}")
        assert summary["modules"][name]["tests"] == list(target.tests)


def test_every_line_left_unmutated_is_in_the_summary_and_explained() -> None:
    """A line marked ``# pragma: no mutate`` (a grace's length) is one the last run of its target left out, and
    docs/TESTING.md names it: a new mark needs a new run and a reason in words."""
    script = load_script()
    summary = json.loads(SUMMARY.read_text())
    doc = TESTING_DOC.read_text()
    for name, target in script.TARGETS.items():
        lines = script.excluded_lines(REPO / target.path, target.scope)
        assert summary["modules"][name].get("not_mutated_lines", []) == lines, (
            f"{name}: the lines marked {script.NO_MUTATE!r} changed; rerun scripts/mutation.py --module {name}")
        missing = [n for n in lines if f"`{target.path}:{n}`" not in doc]
        assert missing == [], f"{name}: lines left unmutated that docs/TESTING.md does not name: {missing}"


def test_every_survivor_is_explained_in_the_testing_doc() -> None:
    summary = json.loads(SUMMARY.read_text())
    doc = TESTING_DOC.read_text()
    missing = [f"{m['path']}:{s['line']} {s['operator']}" for m in summary["modules"].values()
               for s in m["survivors"] if f"`{m['path']}:{s['line']}`" not in doc]
    assert missing == [], "surviving mutants docs/TESTING.md does not explain"


@pytest.mark.slow
def test_the_script_runs_one_target_end_to_end(tmp_path: Path) -> None:
    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv", ".git", "site", "*.egg-info")
    for part in ("pytest_sglworker", "scripts", "tests"):
        shutil.copytree(REPO / part, copy / part, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", copy / "pyproject.toml")
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run([sys.executable, str(copy / "scripts" / "mutation.py"), "--module", "warm_identity",
                          "--summary", str(out)], cwd=copy, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    check_summary(summary, load_script(), ["warm_identity"])
    assert summary["runs"]["warm_identity"]["load_average"]
    assert (copy / "pytest_sglworker" / "resources" / "warm_records.py").read_text() == (
        REPO / "pytest_sglworker" / "resources" / "warm_records.py").read_text()  # every mutant put back
