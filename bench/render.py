#!/usr/bin/env python
"""Every figure the documents quote, rendered from the committed JSON of the run that measured it.

    .venv/bin/python bench/render.py            # rewrite every marked region of the documents from its JSON
    .venv/bin/python bench/render.py --check    # write nothing; exit 1 with a diff when a region differs
    .venv/bin/python bench/render.py --check --root DIR   # the documents and JSON of another checkout

A document quotes figures only inside a marked region::

    <!-- figures:NAME -->

    (what the renderer of NAME makes of its JSON: never edited by hand)

    <!-- /figures:NAME -->

``REGIONS`` says, for each NAME, which JSON (every one of them names the commit, the machine, the settings, the
date and the load average of its run) and which benchmark's ``render`` make it. The documents are ``README.md``,
``bench/README.md`` and every page under ``docs/``. ``bench/all.py`` re-runs the benchmarks, writes their JSON
and then renders; CI and ``tests/test_bench_figures.py`` run ``--check``, so a document whose figures are not
what its committed JSON renders fails the test run.

Every region ends with its **staleness line** (:func:`staleness_line`): the commit its figures ran at and which of
the paths they measure differ now from that commit. What a benchmark measures is its module's ``MEASURES`` (the
module of bench/ that writes the JSON, ``Region.produced_by``: a dict, for each of its parts, of paths relative to
the repository root, files or directories); the paths that differ are git's (``git diff --name-only COMMIT --
PATHS``: the working tree against that commit, so that a change and its re-rendered figures go in one commit, and
the untracked files git does not ignore under those paths). A change to a measured module changes the line, so
``--check`` fails until the documents are rendered again (rendering measures nothing). A checkout that cannot say
(not a git checkout, a shallow clone without that commit, a commit its history does not have) gets a line that
says so instead, and ``--check`` there checks everything but the staleness lines (and says so on stderr).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
if str(BENCH) not in sys.path:  # the benchmarks import each other as bench/run.py's siblings
    sys.path.insert(0, str(BENCH))


@dataclass(frozen=True)
class Region:
    json: str  # relative to the repository root
    renderer: str  # "module:function" of bench/, called with the JSON's content; returns markdown
    produced_by: str  # the bench/all.py part that writes the JSON: bench/<part>.py, which declares its MEASURES


REGIONS: dict[str, Region] = {
    "speed": Region("bench/results/run.json", "run:readme_section", "run"),
    "latest": Region("bench/results/run.json", "run:details_section", "run"),
    "warm": Region("bench/results/warm.json", "warm:render", "warm"),
    "timeline": Region("bench/results/timeline.json", "timeline:render", "timeline"),
    "xdist-sched": Region("bench/results/xdist_sched.json", "xdist_sched:render", "xdist_sched"),
    "ray": Region("bench/results/ray_cluster.json", "ray_cluster:markdown", "ray_cluster"),
    "ray-summary": Region("bench/results/ray_cluster.json", "render:ray_summary", "ray_cluster"),
    "bound": Region("bench/bound.json", "bound:render", "bound"),
    "box-suites": Region("bench/results/box_suites.json", "box_suites:render", "box_suites"),
}

_OPEN = re.compile(r"^<!-- figures:([A-Za-z0-9_-]+) -->$")
_CLOSE = re.compile(r"^<!-- /figures:([A-Za-z0-9_-]+) -->$")
_ANY_MARK = re.compile(r"<!--\s*/?\s*figures\b")
_CODE_SPAN = re.compile(r"`[^`]*`")


class FiguresError(Exception):
    """A region, a document or a JSON the renderer cannot work with; the message names it and the fix."""


def documents(root: Path = REPO) -> list[Path]:
    """The documents that may quote figures: the two READMEs and every page of the docs site."""
    return [path for path in (root / "README.md", root / "bench" / "README.md") if path.is_file()] + sorted(
        (root / "docs").rglob("*.md"))


def ray_summary(results: dict[str, Any]) -> str:
    """The Ray path's cost and the shard balance in one paragraph (README.md, docs/RAY.md)."""
    from common import fmt_ratio, fmt_s

    meta = results["meta"]
    m = meta["machine"]
    commit = f"commit `{m['commit']}`" + (" plus uncommitted changes" if m["dirty"] else "")
    parts = [f"Measured by `bench/ray_cluster.py` on {m['cores']} CPUs ({commit}, {meta['date']}, {meta['reps']} "
             f"rounds, simulated startup 1 s, load average {meta['load_before']} before):"]
    r = results.get("ray")
    if r:
        rows = r["rows"]
        total, spawn = rows["total"], rows["spawn"]
        extra = None if total["ray"] is None or total["local"] is None else total["ray"] - total["local"]
        parts.append(f"8 worker configurations under `-n 4` on a local Ray cluster with 4 declared GPUs against local "
                     f"file leases: a launch from its lease request to ready takes "
                     f"**{fmt_ratio(total['ratio'], total['range'])}** as long on Ray ({fmt_s(extra)} more a worker, "
                     f"medians; from the lease to the engine's process start, where Ray starts the worker's actor, "
                     f"{fmt_s(spawn['ray'])} against {fmt_s(spawn['local'])}), the whole run "
                     f"**{fmt_ratio(rows['wall']['ratio'], rows['wall']['range'])}**.")
    s = results.get("shard")
    if s:
        plans = s["plans"]

        def balance(plan: str) -> str:
            p = plans[plan]
            return f"**{p['balance']:.2f}** ({p['balance_range'][0]:.2f}-{p['balance_range'][1]:.2f})"

        whole = all(p["union_is_selection"] and p["disjoint"] and p["configs_whole"] for p in plans.values())
        parts.append(f"`--sgl-shard k/4` on that suite: the largest shard's measured cost over a quarter of the "
                     f"total is {balance('measured')} balanced by an earlier run's report, against "
                     f"{balance('count')} by test count; the union of the shards is the unsharded selection: "
                     f"{'yes' if whole else '**no**'}.")
    return " ".join(parts) + "\n"


def figure_commit(data: dict[str, Any]) -> str | None:
    """The commit a JSON's figures ran at: ``meta.machine.commit`` (bench/common.py's ``machine``), or the commit
    named in bench/bound.json's ``machine`` line; None when it names none."""
    meta = data.get("meta")
    if isinstance(meta, dict) and isinstance(meta.get("machine"), dict):
        commit = meta["machine"].get("commit")
    else:
        found = re.search(r"commit `([0-9a-f]{4,40})`", str(data.get("machine", "")))
        commit = found.group(1) if found else None
    return commit if isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{4,40}", commit) else None


def measures(name: str, data: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """What the figures of region ``name`` measure, by part: the ``MEASURES`` of the module that writes its JSON,
    less the parts the JSON says its run left out (``meta.parts``, where it lists them)."""
    try:
        module = importlib.import_module(REGIONS[name].produced_by)
    except ModuleNotFoundError as exc:
        raise FiguresError(f"region {name!r} is produced by part {REGIONS[name].produced_by!r}, but bench/ has no "
                           f"module {exc.name!r}: a part's script is bench/<part>.py") from exc
    declared: Mapping[str, Sequence[str]] | None = getattr(module, "MEASURES", None)
    if not declared:
        raise FiguresError(f"bench/{REGIONS[name].produced_by}.py (region {name!r}) declares no MEASURES: add "
                           "MEASURES = {PART: (PATH, ...)}, the paths its figures measure")
    parts = (data.get("meta") or {}).get("parts")
    return {part: tuple(paths) for part, paths in declared.items() if not isinstance(parts, list) or part in parts}


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None


@functools.cache
def _why_unknown(commit: str, root: Path) -> str | None:
    """Why git cannot say here what changed since ``commit`` (None when it can)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return "this is not a git checkout of the repository"
    found = _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    if found is not None and found.returncode == 0:
        return None
    shallow = _git(root, "rev-parse", "--is-shallow-repository")
    if shallow is not None and shallow.stdout.strip() == "true":
        return "this shallow clone's history does not have it (`git fetch --unshallow`)"
    return "this checkout's history does not have it"


def changed_since(commit: str, paths: Sequence[str], root: Path = REPO) -> list[str] | str:
    """The files under ``paths`` that differ in the working tree from ``commit`` (changed, added or removed,
    untracked ones git does not ignore included), sorted; or why git cannot say here."""
    why = _why_unknown(commit, root)
    if why is not None:
        return why
    diff = _git(root, "diff", "--no-renames", "--name-only", "-z", commit, "--", *paths)
    new = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *paths)
    if diff is None or new is None or diff.returncode != 0 or new.returncode != 0:
        return f"git could not compare it with this checkout ({((diff and diff.stderr) or '').strip() or 'no git'})"
    return sorted({p for out in (diff.stdout, new.stdout) for p in out.split("\0") if p})


def staleness_line(commit: str | None, measured: Mapping[str, Sequence[str]], root: Path = REPO,
                   cache: dict[str, Any] | None = None) -> str:
    """The last line of every region: the commit its figures ran at, and which of the paths they measure (by
    part, where they are several) changed since; the same text as long as the same files differ."""
    if commit is None:
        return ("Its JSON names no commit, so whether the modules these figures measure changed since is not known "
                "here.")
    cache = {} if cache is None else cache
    changes: dict[str, list[str]] = {}
    for part, paths in measured.items():
        key = f"git {commit} {' '.join(paths)}"
        if key not in cache:
            cache[key] = changed_since(commit, paths, root)
        found = cache[key]
        if isinstance(found, str):
            return (f"Measured at commit `{commit}`, but {found}: whether the modules these figures measure changed "
                    "since is not known here.")
        changes[part] = found
    if not any(changes.values()):
        return f"Measured at commit `{commit}`; none of the modules these figures measure has changed since."
    head = f"Measured at commit `{commit}`; changed since, of the modules these figures measure: "
    if len(changes) == 1:
        return head + ", ".join(f"`{p}`" for p in next(iter(changes.values()))) + "."
    stale = [f"{part}: {', '.join(f'`{p}`' for p in paths)}" for part, paths in changes.items() if paths]
    fresh = [part for part, paths in changes.items() if not paths]
    return head + "; ".join(stale) + (f"; none for {', '.join(fresh)}" if fresh else "") + "."


def _renderer(name: str) -> Callable[[dict[str, Any]], str]:
    module, function = REGIONS[name].renderer.split(":")
    if module == "render":
        return globals()[function]  # type: ignore[no-any-return]
    return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


def render_region(name: str, root: Path = REPO, cache: dict[str, Any] | None = None) -> str:
    """The text of region ``name`` as its committed JSON renders it."""
    region = REGIONS[name]
    cache = {} if cache is None else cache
    if region.json not in cache:
        path = root / region.json
        if not path.is_file():
            raise FiguresError(f"region {name!r} renders from {region.json}, which does not exist; measure it: "
                               f".venv/bin/python bench/all.py --only {region.produced_by}")
        try:
            cache[region.json] = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise FiguresError(f"{region.json} (region {name!r}) is not JSON: {exc}") from exc
    data = cache[region.json]
    line = staleness_line(figure_commit(data), measures(name, data), root, cache)
    return _renderer(name)(data).rstrip("\n") + "\n\n" + line + "\n"


def regions_of(text: str, where: str) -> list[tuple[str, int, int]]:
    """The regions of a document: (name, the line of its opening mark, the line of its closing mark), 0-based.
    A mark that is not on a line of its own, an unknown name, a region left open, nested or closed under another
    name is an error naming the document's line."""
    found: list[tuple[str, int, int]] = []
    lines = text.splitlines()
    open_at: tuple[str, int] | None = None
    for i, line in enumerate(lines):
        opened, closed = _OPEN.match(line), _CLOSE.match(line)
        if not opened and not closed:
            if _ANY_MARK.search(_CODE_SPAN.sub("", line)):  # a mark quoted as `code` is prose
                raise FiguresError(f"{where}:{i + 1}: a figures mark must be a line of its own, exactly "
                                   "'<!-- figures:NAME -->' or '<!-- /figures:NAME -->'")
            continue
        name = (opened or closed).group(1)  # type: ignore[union-attr]
        if name not in REGIONS:
            raise FiguresError(f"{where}:{i + 1}: unknown figures region {name!r}; known: {', '.join(REGIONS)} "
                               "(bench/render.py's REGIONS)")
        if opened:
            if open_at is not None:
                raise FiguresError(f"{where}:{i + 1}: region {name!r} opens inside region {open_at[0]!r} (opened "
                                   f"on line {open_at[1] + 1}); close that one first")
            open_at = (name, i)
        else:
            if open_at is None or open_at[0] != name:
                raise FiguresError(f"{where}:{i + 1}: '<!-- /figures:{name} -->' closes no open region {name!r}")
            found.append((name, open_at[1], i))
            open_at = None
    if open_at is not None:
        raise FiguresError(f"{where}:{open_at[1] + 1}: region {open_at[0]!r} is never closed; add "
                           f"'<!-- /figures:{open_at[0]} -->' after it")
    return found


def rendered_document(text: str, where: str, root: Path = REPO, cache: dict[str, Any] | None = None) -> str:
    """The document with every region's body replaced by what its JSON renders (a blank line around it)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    last = 0
    cache = {} if cache is None else cache
    for name, start, end in regions_of(text, where):
        body = render_region(name, root, cache).strip("\n")
        out += lines[last:start + 1]
        out.append("\n" + body + "\n\n")
        last = end
    out += lines[last:]
    return "".join(out)


def stale(paths: Iterable[Path], root: Path = REPO, cache: dict[str, Any] | None = None) -> dict[Path, str]:
    """Per document whose committed text differs from its rendering: the unified diff (committed -> rendered)."""
    cache = {} if cache is None else cache
    diffs: dict[Path, str] = {}
    for path in paths:
        where = _where(path, root)
        text = path.read_text(encoding="utf-8")
        new = rendered_document(text, where, root, cache)
        if new != text:
            diffs[path] = "".join(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True),
                                                       f"{where} (committed)", f"{where} (rendered from its JSON)"))
    return diffs


def _where(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


_STALENESS = re.compile(r"^(Measured at commit `[^`]*`[;,] |Its JSON names no commit, ).*$", re.MULTILINE)


def _only_staleness_differs(path: Path, root: Path, cache: dict[str, Any]) -> bool:
    """Whether ``path`` differs from its rendering in nothing but staleness lines (what a checkout without the
    figures' commits cannot compute)."""
    text = path.read_text(encoding="utf-8")
    new = rendered_document(text, _where(path, root), root, cache)
    return _STALENESS.sub("", text) == _STALENESS.sub("", new)


def unused_regions(paths: Iterable[Path], root: Path = REPO) -> list[str]:
    """The names of ``REGIONS`` that no document quotes (a JSON measured for nothing, or a region lost)."""
    used = {name for path in paths for name, _, _ in regions_of(path.read_text(encoding="utf-8"), _where(path, root))}
    return [name for name in REGIONS if name not in used]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a diff when a document's figures differ from its JSON's")
    parser.add_argument("--root", type=Path, default=REPO,
                        help="the repository whose documents and JSON to use (default: this one)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    paths = documents(root)
    try:
        checked: dict[str, Any] = {}
        diffs = stale(paths, root, checked)
        unused = unused_regions(paths, root)
    except FiguresError as exc:
        print(f"bench/render.py: {exc}", file=sys.stderr)
        return 2
    if unused:
        print(f"bench/render.py: no document quotes the region(s) {', '.join(unused)}: mark where they belong, or "
              "drop them from REGIONS", file=sys.stderr)
        return 1
    if args.check:
        unknown = sorted({why for key, why in checked.items() if key.startswith("git ") and isinstance(why, str)})
        if diffs and unknown:  # rendering here would only write that it cannot tell: check all but those lines
            diffs = {path: diff for path, diff in diffs.items() if not _only_staleness_differs(path, root, checked)}
            if not diffs:
                print(f"bench/render.py: the figures are what their JSON renders; their staleness lines cannot be "
                      f"checked here ({'; '.join(unknown)}): run --check in a clone that has the figures' commits "
                      "to check those too", file=sys.stderr)
                return 0
        for diff in diffs.values():
            sys.stdout.write(diff)
        if diffs:
            where = ", ".join(str(p.relative_to(root)) for p in diffs)
            print(f"stale figures in {where}: not what their committed JSON renders; rerender them: "
                  ".venv/bin/python bench/render.py", file=sys.stderr)
            return 1
        return 0
    cache: dict[str, Any] = {}
    for path in paths:
        if path in diffs:
            text = rendered_document(path.read_text(encoding="utf-8"), str(path.relative_to(root)), root, cache)
            path.write_text(text, encoding="utf-8")
            print(f"rendered {path.relative_to(root)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
