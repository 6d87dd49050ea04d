"""What the plugin prints, and what a wheel user reads, points somewhere they have: neither the wheel nor the sdist
holds ``docs/``, so every pointer to a documentation page is an absolute URL under one base
(``pytest_sglworker.errors.DOCS_URL``) whose page exists in this checkout's ``docs/``; the README (the package's
long description) has no relative link; pyproject.toml's Project-URLs name the same base; every docs page can be
reached from the home page or the site's navigation."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import tomllib
import yaml

import pytest_sglworker
from pytest_sglworker.errors import DOCS_URL, PROJECT_URL

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pytest_sglworker"
#: ``docs/<page>.md`` or ``<name>.md`` named in a text
_PAGE = re.compile(r"(?:\S*/)?docs/[\w./-]+\.md|\b[A-Z_]+\.md\b")
_URL = re.compile(re.escape(PROJECT_URL) + r"/blob/main/([\w./-]+?)(?:#[\w-]*)?(?=[\s)`'\"]|$)")


def _not_printed(tree: ast.AST) -> set[int]:
    """Docstrings, and the page names given to ``docs_url`` (checked as pages)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "docs_url":
            ids.update(id(arg) for arg in node.args)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _printed_strings() -> list[tuple[str, str]]:
    """``(where, text)`` of every string literal of the package that is not a docstring (what it prints, raises
    or offers as help), f-strings' literal parts included."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _not_printed(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                found.append((f"{path.relative_to(REPO)}:{node.lineno}", node.value))
    return found


def _public_docstrings() -> list[tuple[str, str]]:
    """What ``help()`` and ``pytest --fixtures`` show: the public API's docstrings and the fixtures'."""
    from pytest_sglworker.plugin import fixtures

    found = [("pytest_sglworker", pytest_sglworker.__doc__ or "")]
    objects = [getattr(pytest_sglworker, name) for name in pytest_sglworker.__all__]
    objects += [obj for _, obj in inspect.getmembers(fixtures, callable)
                if getattr(obj, "__module__", "") == fixtures.__name__]
    for obj in objects:
        found.append((getattr(obj, "__qualname__", repr(obj)), inspect.getdoc(obj) or ""))
        if inspect.isclass(obj):
            found += [(f"{obj.__qualname__}.{name}", inspect.getdoc(member) or "")
                      for name, member in vars(obj).items() if not name.startswith("_") and inspect.getdoc(member)]
    return found


def test_the_base_is_absolute_and_the_one_of_the_project_urls() -> None:
    assert DOCS_URL.startswith(PROJECT_URL + "/") and PROJECT_URL.startswith("https://")
    urls = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
    assert urls and all(url.startswith(PROJECT_URL) for url in urls.values()), urls
    for url in urls.values():
        page = url.removeprefix(PROJECT_URL).removeprefix("/blob/main/")
        assert not page or (REPO / page).is_file(), url


def test_every_printed_docs_pointer_is_a_url_to_a_page_that_exists() -> None:
    """A pointer only a clone could follow (``See docs/GPU_CHECK.md``) fails; so does a URL to a page that is not
    in docs/. ``docs_url('page')`` calls are checked by their page."""
    relative, missing = [], []
    for where, text in [*_printed_strings(), *_public_docstrings()]:
        for match in _PAGE.finditer(_URL.sub("", text)):
            relative.append(f"{where}: {match.group(0)}")
        missing += [f"{where}: {m.group(1)}" for m in _URL.finditer(text) if not (REPO / m.group(1)).exists()]
    for path in sorted(PACKAGE.rglob("*.py")):
        for page in re.findall(r"docs_url\(['\"]([^'\"]+)['\"]\)", path.read_text(encoding="utf-8")):
            if not (REPO / "docs" / page).is_file():
                missing.append(f"{path.relative_to(REPO)}: docs_url({page!r})")
    assert not relative, f"docs pointers a wheel user cannot follow (use errors.docs_url): {relative}"
    assert not missing, f"pointers to pages that are not in docs/: {missing}"


def test_the_budget_error_and_the_gpu_check_help_point_at_the_docs_site() -> None:
    from pytest_sglworker.engine.budget import FIX

    assert f"{DOCS_URL}explanation/budget-and-ledger.md" in FIX
    check = (PACKAGE / "tools" / "gpu_check" / "check.py").read_text()
    assert "docs_url('GPU_CHECK.md')" in check


def test_the_readme_links_resolve_for_a_wheel_user() -> None:
    """The README is the package's long description: a relative link there is dead on the index page."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    relative = [link for link in links if not link.startswith(("https://", "http://", "#"))]
    assert not relative, relative
    ours = [m.group(1) for m in _URL.finditer(text)]
    assert ours and not [page for page in ours if not (REPO / page).exists()]


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return []


def test_every_docs_page_is_reachable_from_the_home_page_and_the_nav() -> None:
    """Every page of docs/ is in mkdocs.yml's nav and is linked from index.md (the home page a reader of the
    repository starts from), which the site's nav does not replace."""
    pages = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    assert sorted(_nav_pages(config["nav"])) == pages
    index = (REPO / "docs" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", index))
    assert [page for page in pages if page != "index.md" and page not in linked] == []


def _quoted(page: str, marker: str) -> list[str]:
    text = (REPO / "docs" / page).read_text()
    match = re.search(r"<!-- " + re.escape(marker) + r".*?-->\n```text\n(.*?)```", text, re.S)
    assert match, f"no block after '<!-- {marker}' in docs/{page}"
    return match.group(1).splitlines()


def test_the_oom_how_to_quotes_the_plugins_own_failure_text() -> None:
    snapshot = (REPO / "tests" / "data" / "failure_texts" / "rule_cuda_oom.txt").read_text().splitlines()
    quoted = _quoted("how-to/worker-oom.md", "failure text lines of: tests/data/failure_texts/rule_cuda_oom.txt")
    assert quoted and [line for line in quoted if line not in snapshot] == []


def test_the_oom_how_to_quotes_the_ledger_as_list_models_prints_it(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sgl-list-models", "--sgl-card", "L4", "-v")
    assert result.ret == 0, result.stdout.str()
    quoted = _quoted("how-to/worker-oom.md", "ledger lines of: pytest --sgl-list-models --sgl-card L4 -v")
    assert quoted and [line for line in quoted if line not in result.stdout.lines] == []
