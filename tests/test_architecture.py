"""The package's layers, kept true by reading its imports (every ``import`` in every module: lazy ones inside
functions and ``TYPE_CHECKING`` ones included, as docs/ARCHITECTURE.md promises).

- Imports point down: each layer may import only the layers the table below allows; a lower layer never imports a
  higher one (it takes a callback or a small protocol instead).
- No two modules reach each other through imports: no circle anywhere, package ``__init__`` modules included.
- The simulated engine is a program of its own: nothing outside ``pytest_sglworker/sim/`` imports its internals,
  only its package surface (``pytest_sglworker.sim``).
- Only the pytest-facing layer (and the drop-ins for other suites' conventions above it, ``compat``) imports
  pytest.
- No module over 900 lines, and one over 600 says at its top why it is one module.

A module is what Python imports as part of the package: a ``.py`` file whose folders up to the package all have an
``__init__.py``. The programs the ``sglworker`` command runs by path (``tools/gpu_check/``) are not modules of it.

Each failure names the modules concerned.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_sglworker"
ROOT = PACKAGE.name

#: layer -> the layers its modules may import (besides their own layer)
ALLOWED: dict[str, set[str]] = {
    "tools": {"engine", "errors"},
    "compat": {"plugin", "workers", "resources", "engine", "errors", "sim"},
    "errors": set(),
    "engine": {"errors"},
    "resources": {"errors"},
    "sim": {"engine", "errors"},
    "workers": {"resources", "engine", "errors", "sim"},
    "plugin": {"workers", "resources", "engine", "errors", "sim"},
}
#: layers that may import only the package surface (``__init__``) of the simulated engine
SIM_SURFACE_ONLY = {"workers", "plugin", "compat"}
MAX_LINES = 900
REASON_LINES = 600


def _importable(path: Path) -> bool:
    """Every folder from ``path`` up to the package is a regular package (has an ``__init__.py``)."""
    return all((folder / "__init__.py").is_file() for folder in path.parents if folder.is_relative_to(PACKAGE))


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if not _importable(path):
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = modules()


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    if node.level:
        base = package[: len(package) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    targets = []
    for alias in node.names:
        candidate = f"{name}.{alias.name}"
        targets.append(candidate if candidate in MODULES else name)
    return targets


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports (an imported name that is a module counts as that module)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            targets = _resolve(module, node)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                found.add(target)
    return found


def external_imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def layer_of(module: str) -> str | None:
    """``engine``, ``workers``, ...; ``errors`` for the root errors module; None for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


EDGES = {module: imports_of(module) for module in MODULES}


def test_every_module_belongs_to_a_known_layer() -> None:
    unknown = sorted(m for m in MODULES if layer_of(m) is not None and layer_of(m) not in ALLOWED)
    assert not unknown, f"modules outside the layers of docs/ARCHITECTURE.md: {unknown}"


def test_imports_point_down() -> None:
    wrong = []
    for module, targets in sorted(EDGES.items()):
        layer = layer_of(module)
        if layer is None:
            continue  # the package root re-exports the public API from every layer
        for target in sorted(targets):
            other = layer_of(target)
            if other is None:
                wrong.append(f"{module} imports the package root {target} (a layer never imports the public API)")
            elif other != layer and other not in ALLOWED[layer]:
                wrong.append(f"{module} ({layer}) imports {target} ({other}): a layer may import only "
                             f"{sorted(ALLOWED[layer]) or 'nothing of the package'}")
    assert not wrong, "\n".join(wrong)


def test_nothing_outside_the_simulated_engine_imports_its_internals() -> None:
    wrong = [f"{module} imports {target}: use the package surface, {ROOT}.sim"
             for module, targets in sorted(EDGES.items()) if layer_of(module) in SIM_SURFACE_ONLY
             for target in sorted(targets) if layer_of(target) == "sim" and target != f"{ROOT}.sim"]
    assert not wrong, "\n".join(wrong)


def _circles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(EDGES[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    return found


def test_no_import_circle() -> None:
    circles = _circles()
    detail = [f"{' <-> '.join(c)}: " + "; ".join(f"{a} imports {b}" for a in c for b in sorted(EDGES[a] & set(c)))
              for c in circles]
    assert not circles, "import circles:\n" + "\n".join(detail)


def test_only_the_pytest_facing_layer_imports_pytest() -> None:
    wrong = sorted(m for m in MODULES if layer_of(m) not in ("plugin", "compat")
                   and external_imports(m) & {"pytest", "_pytest"})
    assert not wrong, f"these modules import pytest, which only {ROOT}.plugin may: {wrong}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module: str) -> None:
    text = MODULES[module].read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it by responsibility"
    if lines > REASON_LINES:
        doc = ast.get_docstring(ast.parse(text)) or ""
        assert "Why one module" in doc, (f"{module} has {lines} lines: over {REASON_LINES}, its docstring says "
                                         "why it is one module ('Why one module of this size: ...')")


def test_the_check_itself_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The walk counts imports inside functions and under ``if TYPE_CHECKING:`` (a circle hidden there is still
    a circle)."""
    assert f"{ROOT}.engine.diagnosis" in EDGES[f"{ROOT}.workers.health"]  # a module-level import
    lazy = [m for m, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef) and any(isinstance(n, ast.ImportFrom) and n.level
                                                         for n in ast.walk(node))]
    assert lazy, "no lazy import found: the check would not see them"
    module = lazy[0]
    function_imports = {t for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8")))
                        if isinstance(node, ast.FunctionDef)
                        for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and n.level
                        for t in _resolve(module, n)}
    assert {t for t in function_imports if t in MODULES} <= EDGES[module] | {module}


def test_the_programs_run_by_path_are_not_modules() -> None:
    """``tools/gpu_check/`` (a program with its own fake ``pynvml`` and inner pytest suite) is run by path, so its
    files are not modules of the package; the command that runs it is."""
    assert f"{ROOT}.tools.cli" in MODULES
    assert (PACKAGE / "tools" / "gpu_check" / "check.py").is_file()
    assert not [m for m in MODULES if ".gpu_check" in m or m.endswith(".pynvml")]


def test_the_architecture_docs_table_says_the_layers_as_they_are() -> None:
    """docs/ARCHITECTURE.md's layer table: each layer's "may import" cell is :data:`ALLOWED` (so the doc and the
    check cannot disagree), and its approximate size is within a fifth of the lines its modules have now."""
    import re

    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    rows = {m["layer"].removesuffix(".py"): (m["lines"], m["imports"]) for m in re.finditer(
        r"^\| `(?P<layer>[a-z_.]+)` \| ~?(?P<lines>[\d,]+) \| (?P<imports>[^|]*) \|$", doc, re.MULTILINE)}
    assert set(rows) == set(ALLOWED), f"layers in the doc's table: {sorted(rows)}, in the check: {sorted(ALLOWED)}"
    wrong = []
    for layer, (stated, imports) in rows.items():
        actual = sum(len(path.read_text(encoding="utf-8").splitlines())
                     for module, path in MODULES.items() if (layer_of(module) or "") == layer)
        said = set(re.findall(r"`([a-z]+)`", imports))
        if said != ALLOWED[layer]:
            wrong.append(f"{layer}: the doc says it may import {sorted(said)}, "
                         f"the check allows {sorted(ALLOWED[layer])}")
        if abs(int(stated.replace(",", "")) - actual) > actual / 5:
            wrong.append(f"{layer}: the doc says ~{stated} lines, its modules have {actual}")
    assert not wrong, "update the layer table of docs/ARCHITECTURE.md:\n" + "\n".join(wrong)
