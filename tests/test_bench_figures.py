"""Figures that cannot go stale: every figure README.md, bench/README.md and docs/ quote is inside a marked region
that ``bench/render.py`` renders from the committed JSON of the run that measured it (issue 32). The committed
documents must be what their JSON renders, a figure edited by hand or a JSON measured again without rendering must
fail the check with a diff, and a region the renderer cannot render must be named with its line and the fix.
``bench/render.py`` runs as a program (as CI and ``bench/all.py`` run it), in this checkout or, with ``--root``,
in a copy of its documents and JSON.

Every region ends with a staleness line (issue 43): the commit its figures ran at and which of the modules they
measure (their benchmark's ``MEASURES``) changed since. The tests below pin its text in a git repository of their
own: a measured module changed in a later commit (or not yet committed) fails ``--check`` until the documents are
rendered again, an unmeasured one does not, and a shallow clone, a commit the history does not have and a copy that
is no git checkout get a line that says so, not a crash.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RENDER = REPO / "bench" / "render.py"


def _render(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RENDER), *map(str, args)], cwd=REPO, capture_output=True, text=True)


def _regions() -> dict[str, Any]:
    """bench/render.py's REGIONS, bench/all.py's parts, what each part's module declares it measures and
    bench/run.py's parts, read by a child interpreter (their imports put bench/ on sys.path, which this process
    keeps clean)."""
    code = ("import importlib, json, sys; sys.path.insert(0, 'bench'); import render; import all as bench_all; "
            "import run; print(json.dumps({'regions': {n: {'json': r.json, 'part': r.produced_by} "
            "for n, r in render.REGIONS.items()}, 'parts': list(bench_all.PARTS), 'measures': {p: "
            "getattr(importlib.import_module(p), 'MEASURES', None) for p in bench_all.PARTS}, "
            "'run_parts': list(run.PARTS), 'run_modules': [m.__name__ for m in run.PART_MODULES]}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def regions() -> dict[str, Any]:
    return _regions()


def test_the_committed_documents_quote_what_their_committed_json_renders() -> None:
    result = _render("--check")
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\nrerender with .venv/bin/python bench/render.py (or re-measure: "
        ".venv/bin/python bench/all.py --only PART) and commit the documents")
    assert result.stdout == ""


def test_every_region_is_measured_by_a_part_of_the_one_command(regions: dict[str, Any]) -> None:
    parts = set(regions["parts"])
    for name, region in regions["regions"].items():
        assert region["part"] in parts, f"region {name}: no part of bench/all.py writes {region['json']}"
        assert (REPO / region["json"]).is_file(), f"region {name}: {region['json']} is not committed"
    assert parts == {r["part"] for r in regions["regions"].values()}, "a part of bench/all.py feeds no region"


def _copy_checkout(tmp_path: Path, regions: dict[str, Any], names: list[str]) -> Path:
    """A checkout in ``tmp_path`` with the committed JSON and a README quoting the regions ``names``, empty."""
    root = tmp_path / "checkout"
    for region in regions["regions"].values():
        (root / region["json"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / region["json"], root / region["json"])
    body = "".join(f"Section {n}:\n\n<!-- figures:{n} -->\n<!-- /figures:{n} -->\n\nAfter {n}.\n\n" for n in names)
    (root / "README.md").write_text("# A checkout\n\n" + body)
    return root


def _rendered_checkout(tmp_path: Path, regions: dict[str, Any]) -> Path:
    """``_copy_checkout`` quoting every region, rendered."""
    root = _copy_checkout(tmp_path, regions, list(regions["regions"]))
    result = _render("--root", root)
    assert result.returncode == 0, result.stderr
    return root


def test_a_figure_edited_by_hand_fails_the_check_with_its_diff(tmp_path: Path,
                                                              regions: dict[str, Any]) -> None:
    root = _rendered_checkout(tmp_path, regions)
    readme = root / "README.md"
    assert _render("--check", "--root", root).returncode == 0
    text = readme.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("| 30 | "))  # the timeline's 30-launch row
    readme.write_text(text.replace(line, line.replace("| 30 |", "| 31 |")))

    result = _render("--check", "--root", root)

    assert result.returncode == 1
    assert f"-{line.replace('| 30 |', '| 31 |')}\n+{line}\n" in result.stdout
    assert "README.md (committed)" in result.stdout
    assert "stale figures in README.md" in result.stderr
    assert _render("--root", root).returncode == 0  # rendering again restores it
    assert readme.read_text() == text


def test_a_json_measured_again_without_rendering_fails_the_check(tmp_path: Path,
                                                                regions: dict[str, Any]) -> None:
    root = _rendered_checkout(tmp_path, regions)
    timeline = root / regions["regions"]["timeline"]["json"]
    data = json.loads(timeline.read_text())
    data["meta"]["date"] = "2030-01-01 00:00 UTC"
    timeline.write_text(json.dumps(data))

    result = _render("--check", "--root", root)

    assert result.returncode == 1
    assert "+" in result.stdout and "2030-01-01 00:00 UTC" in result.stdout


def test_a_region_no_document_quotes_is_named(tmp_path: Path, regions: dict[str, Any]) -> None:
    root = _copy_checkout(tmp_path, regions, [n for n in regions["regions"] if n != "warm"])

    result = _render("--check", "--root", root)

    assert result.returncode == 1
    assert "no document quotes the region(s) warm" in result.stderr


@pytest.mark.parametrize(("body", "expected"), [
    ("<!-- figures:nosuch -->\n<!-- /figures:nosuch -->\n", "README.md:3: unknown figures region 'nosuch'"),
    ("<!-- figures:timeline -->\ntext\n", "README.md:3: region 'timeline' is never closed; add "
                                          "'<!-- /figures:timeline -->'"),
    ("<!-- figures:timeline -->\n<!-- figures:warm -->\n", "README.md:4: region 'warm' opens inside region "
                                                            "'timeline' (opened on line 3)"),
    ("<!-- figures:timeline -->\n<!-- /figures:warm -->\n", "README.md:4: '<!-- /figures:warm -->' closes no open "
                                                             "region 'warm'"),
    ("See <!-- figures:timeline --> here.\n", "README.md:3: a figures mark must be a line of its own"),
])
def test_a_region_that_cannot_be_rendered_is_named_with_its_line(tmp_path: Path, body: str, expected: str) -> None:
    (tmp_path / "README.md").write_text("# Title\n\n" + body)

    result = _render("--check", "--root", tmp_path)

    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_a_region_whose_json_is_missing_names_the_command_that_measures_it(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("<!-- figures:warm -->\n<!-- /figures:warm -->\n")

    result = _render("--root", tmp_path)

    assert result.returncode == 2
    assert ("region 'warm' renders from bench/results/warm.json, which does not exist; measure it: "
            ".venv/bin/python bench/all.py --only warm") in result.stderr
    assert (tmp_path / "docs" / "page.md").read_text() == "<!-- figures:warm -->\n<!-- /figures:warm -->\n"


def test_the_one_command_names_an_unknown_part_and_measures_nothing() -> None:
    result = subprocess.run([sys.executable, str(REPO / "bench" / "all.py"), "--only", "run,nosuch"], cwd=REPO,
                            capture_output=True, text=True)

    assert result.returncode == 2
    assert ("unknown part(s) nosuch; choose from bound, run, warm, timeline, xdist_sched, ray_cluster"
            in result.stderr)
    assert "== run" not in result.stderr


def test_the_ray_bench_renders_its_json_again_without_measuring() -> None:
    # as bench/bound.py, warm.py and timeline.py: --render prints the section of a JSON it wrote (no cluster started)
    committed = REPO / "bench" / "results" / "ray_cluster.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "ray_cluster.py"), "--render", str(committed)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
    code = ("import json, sys; sys.path.insert(0, 'bench'); import ray_cluster; "
            f"sys.stdout.write(ray_cluster.markdown(json.load(open({str(committed)!r}))))")
    expected = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout == expected.stdout
    assert json.loads(committed.read_text())["meta"]["date"] in result.stdout
    assert "starting a local Ray cluster" not in result.stderr


def test_every_benchmark_declares_what_it_measures_and_every_path_exists(regions: dict[str, Any]) -> None:
    for part, declared in regions["measures"].items():
        assert declared, f"bench/{part}.py declares no MEASURES"
        for name, paths in declared.items():
            assert paths, f"bench/{part}.py: MEASURES[{name!r}] is empty"
            missing = [p for p in paths if not (REPO / p).exists()]
            assert not missing, f"bench/{part}.py: MEASURES[{name!r}] names {missing}, which do not exist"
    # bench/run.py: a module per part, each declaring its own part (the parts --only takes)
    assert list(regions["measures"]["run"]) == regions["run_parts"]
    assert len(regions["run_modules"]) == len(set(regions["run_modules"])) == len(regions["run_parts"])
    # bench/ray_cluster.py: by part, as its JSON lists them (a run of --only shard measures no Ray module)
    ray = json.loads((REPO / regions["regions"]["ray"]["json"]).read_text())
    assert sorted(regions["measures"]["ray_cluster"]) == sorted(ray["meta"]["parts"])


def test_every_committed_region_ends_with_its_staleness_line() -> None:
    text = (REPO / "bench" / "README.md").read_text() + (REPO / "README.md").read_text()
    bodies = re.findall(r"<!-- figures:([\w-]+) -->\n(.*?)<!-- /figures:\1 -->", text, re.S)
    assert bodies
    for name, body in bodies:
        last = body.strip().splitlines()[-1]
        assert re.fullmatch(r"Measured at commit `[0-9a-f]{7}`(; none of the modules these figures measure has "
                            r"changed since| ?[;,].*)\.", last), f"region {name}: {last!r}"


_GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "bench",
            "GIT_AUTHOR_EMAIL": "bench@example.invalid", "GIT_COMMITTER_NAME": "bench",
            "GIT_COMMITTER_EMAIL": "bench@example.invalid"}


def _git(root: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    return subprocess.run(["git", "-C", str(root), *args], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def _commit_all(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", message)
    return _git(root, "rev-parse", "--short=7", "HEAD")


def _name_commit(root: Path, regions: dict[str, Any], commit: str) -> None:
    """Every JSON of the checkout says its figures ran at ``commit`` (bench/bound.json in its machine line)."""
    for path in {r["json"] for r in regions["regions"].values()}:
        data = json.loads((root / path).read_text())
        if "meta" in data:
            data["meta"]["machine"]["commit"] = commit
        else:
            data["machine"] = re.sub(r"commit `[0-9a-f]+`", f"commit `{commit}`", data["machine"])
        (root / path).write_text(json.dumps(data, indent=1) + "\n")


def _line(root: Path, region: str) -> str:
    """The staleness line of ``region`` in the checkout's README (the last line of its body)."""
    text = (root / "README.md").read_text()
    body = text.split(f"<!-- figures:{region} -->")[1].split(f"<!-- /figures:{region} -->")[0]
    return body.strip().splitlines()[-1]


@pytest.fixture
def repo(tmp_path: Path, regions: dict[str, Any]) -> tuple[Path, str]:
    """A git repository quoting every region, with the module bench/timeline.py measures and one nothing
    measures; every JSON names its first commit; rendered and committed."""
    root = _copy_checkout(tmp_path, regions, list(regions["regions"]))
    (root / "pytest_sglworker" / "plugin").mkdir(parents=True)
    (root / "pytest_sglworker" / "plugin" / "timeline.py").write_text("RENDERER = 1\n")
    (root / "pytest_sglworker" / "unmeasured.py").write_text("NOTHING = 1\n")
    _git(root, "init", "-q")
    first = _commit_all(root, "the measured code")
    _name_commit(root, regions, first)
    assert _render("--root", root).returncode == 0
    _commit_all(root, "its figures")
    return root, first


def test_the_staleness_line_names_the_commit_and_that_nothing_it_measures_changed(repo: tuple[Path, str]) -> None:
    root, first = repo

    assert _render("--check", "--root", root).returncode == 0
    assert _line(root, "timeline") == (
        f"Measured at commit `{first}`; none of the modules these figures measure has changed since.")
    # a change nothing measures, committed: the figures are not stale
    (root / "pytest_sglworker" / "unmeasured.py").write_text("NOTHING = 2\n")
    _commit_all(root, "an unmeasured change")
    assert _render("--check", "--root", root).returncode == 0


def test_a_measured_module_changed_in_a_later_commit_fails_the_check_until_rendered(repo: tuple[Path, str]) -> None:
    root, first = repo
    (root / "pytest_sglworker" / "plugin" / "timeline.py").write_text("RENDERER = 2\n")
    _commit_all(root, "the timeline changed; its figures not rendered again")

    result = _render("--check", "--root", root)

    assert result.returncode == 1
    stale = (f"Measured at commit `{first}`; changed since, of the modules these figures measure: "
             "`pytest_sglworker/plugin/timeline.py`.")
    assert f"-Measured at commit `{first}`; none of the modules these figures measure has changed since.\n" \
           f"+{stale}\n" in result.stdout
    # bench/run.py's regions, by part: overhead measures the whole plugin directory
    assert (f"+Measured at commit `{first}`; changed since, of the modules these figures measure: overhead: "
            "`pytest_sglworker/plugin/timeline.py`; none for readiness, real, reuse, xdist, ahead, groups, soak.\n"
            in result.stdout)
    assert _render("--root", root).returncode == 0  # rendering measures nothing
    assert _line(root, "timeline") == stale
    assert _render("--check", "--root", root).returncode == 0


def test_an_uncommitted_change_counts_so_a_change_and_its_figures_go_in_one_commit(repo: tuple[Path, str]) -> None:
    root, first = repo
    (root / "pytest_sglworker" / "plugin" / "timeline.py").write_text("RENDERER = 2\n")
    (root / "pytest_sglworker" / "plugin" / "new_module.py").write_text("NEW = 1\n")  # untracked, not ignored

    assert _render("--check", "--root", root).returncode == 1
    assert _render("--root", root).returncode == 0
    assert _line(root, "timeline") == (
        f"Measured at commit `{first}`; changed since, of the modules these figures measure: "
        "`pytest_sglworker/plugin/timeline.py`.")
    assert "`pytest_sglworker/plugin/new_module.py`" in _line(root, "speed")
    _commit_all(root, "the change and its figures")
    assert _render("--check", "--root", root).returncode == 0


def test_a_shallow_clone_without_the_commit_gets_an_honest_line(repo: tuple[Path, str], tmp_path: Path) -> None:
    root, first = repo
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{root}", str(shallow)], check=True,
                   env={**os.environ, **_GIT_ENV})

    result = _render("--check", "--root", shallow)

    # CI may clone shallow: everything but the staleness lines is still checked there, and passes
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("the figures are what their JSON renders; their staleness lines cannot be checked here (this shallow "
            "clone's history does not have it (`git fetch --unshallow`)): run --check in a clone that has the "
            "figures' commits to check those too" in result.stderr), result.stderr
    assert "Traceback" not in result.stderr

    readme = shallow / "README.md"  # a figure edited by hand still fails there
    edit = "A figure edited by hand.\n\nMeasured at commit"
    readme.write_text(readme.read_text().replace("Measured at commit", edit, 1))
    edited = _render("--check", "--root", shallow)
    assert edited.returncode == 1
    assert "-A figure edited by hand.\n" in edited.stdout
    assert "stale figures in README.md: not what their committed JSON renders" in edited.stderr

    assert _render("--root", shallow).returncode == 0
    unknown = (f"Measured at commit `{first}`, but this shallow clone's history does not have it (`git fetch "
               "--unshallow`): whether the modules these figures measure changed since is not known here.")
    assert _line(shallow, "timeline") == unknown


def test_a_commit_the_history_does_not_have_and_a_copy_without_git_get_honest_lines(
        repo: tuple[Path, str], tmp_path: Path, regions: dict[str, Any]) -> None:
    root, _ = repo
    _name_commit(root, regions, "deadbee")
    assert _render("--root", root).returncode == 0
    assert _line(root, "timeline") == (
        "Measured at commit `deadbee`, but this checkout's history does not have it: whether the modules these "
        "figures measure changed since is not known here.")

    timeline = root / regions["regions"]["timeline"]["json"]
    data = json.loads(timeline.read_text())
    data["meta"]["machine"]["commit"] = "unknown"  # what bench/common.py's machine() records without git
    timeline.write_text(json.dumps(data))
    assert _render("--root", root).returncode == 0
    assert _line(root, "timeline") == (
        "Its JSON names no commit, so whether the modules these figures measure changed since is not known here.")

    copy = _rendered_checkout(tmp_path / "copy", regions)  # the committed JSON, in no git checkout

    commit = json.loads((REPO / regions["regions"]["timeline"]["json"]).read_text())["meta"]["machine"]["commit"]
    assert _line(copy, "timeline") == (
        f"Measured at commit `{commit}`, but this is not a git checkout of the repository: whether the modules "
        "these figures measure changed since is not known here.")
