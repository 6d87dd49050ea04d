"""Figures that cannot go stale: every figure README.md, bench/README.md and docs/ quote is inside a marked region
that ``bench/render.py`` renders from the committed JSON of the run that measured it (issue 32). The committed
documents must be what their JSON renders, a figure edited by hand or a JSON measured again without rendering must
fail the check with a diff, and a region the renderer cannot render must be named with its line and the fix.
``bench/render.py`` runs as a program (as CI and ``bench/all.py`` run it), in this checkout or, with ``--root``,
in a copy of its documents and JSON.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RENDER = REPO / "bench" / "render.py"


def _render(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RENDER), *map(str, args)], cwd=REPO, capture_output=True, text=True)


def _regions() -> dict[str, dict[str, str]]:
    """bench/render.py's REGIONS and bench/all.py's parts, read by a child interpreter (their imports put bench/
    on sys.path, which this process keeps clean)."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import render; import all as bench_all; "
            "print(json.dumps({'regions': {n: {'json': r.json, 'part': r.produced_by} "
            "for n, r in render.REGIONS.items()}, 'parts': list(bench_all.PARTS)}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def regions() -> dict[str, dict[str, str]]:
    return _regions()


def test_the_committed_documents_quote_what_their_committed_json_renders() -> None:
    result = _render("--check")
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\nrerender with .venv/bin/python bench/render.py (or re-measure: "
        ".venv/bin/python bench/all.py --only PART) and commit the documents")
    assert result.stdout == ""


def test_every_region_is_measured_by_a_part_of_the_one_command(regions: dict[str, dict[str, str]]) -> None:
    parts = set(regions["parts"])
    for name, region in regions["regions"].items():
        assert region["part"] in parts, f"region {name}: no part of bench/all.py writes {region['json']}"
        assert (REPO / region["json"]).is_file(), f"region {name}: {region['json']} is not committed"
    assert parts == {r["part"] for r in regions["regions"].values()}, "a part of bench/all.py feeds no region"


def _copy_checkout(tmp_path: Path, regions: dict[str, dict[str, str]], names: list[str]) -> Path:
    """A checkout in ``tmp_path`` with the committed JSON and a README quoting the regions ``names``, empty."""
    root = tmp_path / "checkout"
    for region in regions["regions"].values():
        (root / region["json"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / region["json"], root / region["json"])
    body = "".join(f"Section {n}:\n\n<!-- figures:{n} -->\n<!-- /figures:{n} -->\n\nAfter {n}.\n\n" for n in names)
    (root / "README.md").write_text("# A checkout\n\n" + body)
    return root


def _rendered_checkout(tmp_path: Path, regions: dict[str, dict[str, str]]) -> Path:
    """``_copy_checkout`` quoting every region, rendered."""
    root = _copy_checkout(tmp_path, regions, list(regions["regions"]))
    result = _render("--root", root)
    assert result.returncode == 0, result.stderr
    return root


def test_a_figure_edited_by_hand_fails_the_check_with_its_diff(tmp_path: Path,
                                                              regions: dict[str, dict[str, str]]) -> None:
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
                                                                regions: dict[str, dict[str, str]]) -> None:
    root = _rendered_checkout(tmp_path, regions)
    timeline = root / regions["regions"]["timeline"]["json"]
    data = json.loads(timeline.read_text())
    data["meta"]["date"] = "2030-01-01 00:00 UTC"
    timeline.write_text(json.dumps(data))

    result = _render("--check", "--root", root)

    assert result.returncode == 1
    assert "+" in result.stdout and "2030-01-01 00:00 UTC" in result.stdout


def test_a_region_no_document_quotes_is_named(tmp_path: Path, regions: dict[str, dict[str, str]]) -> None:
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
