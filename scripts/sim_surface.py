"""Write what sglang's server offers a client, read from the installed real engine's own source, as data for the
simulated engine's coverage page (``docs/SIM_FLAGS.md``, rendered by ``tests/sim/surface.py``):

- every route of its HTTP server: the ``@app.<method>(path)`` and ``@app.api_route(path, methods=[...])``
  decorators of ``sglang/srt/entrypoints/http_server.py`` and the ``@router...`` ones of the routers it includes
  (``v1_loads.py``, ``elastic_ep.py``), read with ``ast`` (nothing is imported: a path given as
  ``os.environ.get(NAME, DEFAULT)`` is its default; one given by an environment variable with no default is kept
  with ``path: null`` and that variable);
- every ``ServerArgs`` flag: the ``dest`` of each entry of ``pytest_sglworker/engine/data/sglang_flags.json``,
  which ``scripts/dump-sglang-flags`` writes from ``ServerArgs.add_cli_args`` of the same engine.

    .venv/bin/python scripts/sim_surface.py [SGLANG_PACKAGE_DIR]   # writes tests/data/sim/server_surface.json

Without an argument the package is the real-engine venv's (``sglworker install-real-engine``). Run it after
upgrading the pinned sglang; ``tests/sim/test_sim_surface.py`` holds the page to the data.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "sim" / "server_surface.json"
FLAGS = REPO / "pytest_sglworker" / "engine" / "data" / "sglang_flags.json"
ROUTE_FILES = ("srt/entrypoints/http_server.py", "srt/entrypoints/v1_loads.py", "srt/entrypoints/elastic_ep.py")
DECORATED = ("app", "router")
METHODS = ("get", "post", "put", "delete", "patch", "head")


def _constant(node: ast.expr, names: dict[str, ast.expr]) -> tuple[str | None, str | None]:
    """(path, environment variable) of a decorator's path argument."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, None
    if isinstance(node, ast.Name) and node.id in names:
        return _constant(names[node.id], names)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and node.args and isinstance(node.args[0], ast.Constant)):
        default = node.args[1] if len(node.args) > 1 else None
        path = default.value if isinstance(default, ast.Constant) else None
        return path, str(node.args[0].value)
    return None, None


def routes_of(source: str, where: str) -> list[dict[str, Any]]:
    tree = ast.parse(source)
    names = {t.id: node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    found: list[dict[str, Any]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id in DECORATED and dec.args):
                continue
            kind = dec.func.attr
            if kind == "api_route":
                methods = next(([e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
                                for kw in dec.keywords if kw.arg == "methods" and isinstance(kw.value, ast.List)),
                               ["GET"])
            elif kind in METHODS:
                methods = [kind.upper()]
            else:
                continue
            path, env = _constant(dec.args[0], names)
            found.append({"path": path, "methods": sorted(str(m) for m in methods), "handler": node.name,
                          "file": where, **({"env": env} if env else {})})
    return found


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        package = Path(argv[1])
    else:
        sys.path.insert(0, str(REPO))
        from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python

        python = real_engine_python()
        if python is None:
            print(real_engine_missing_reason(), file=sys.stderr)
            return 2
        where = "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"
        package = Path(subprocess.run([str(python), "-c", where], capture_output=True, text=True, check=True,
                                      timeout=120).stdout.strip())
    routes: list[dict[str, Any]] = []
    for name in ROUTE_FILES:
        path = package / name
        if path.is_file():
            routes += routes_of(path.read_text(encoding="utf-8"), name)
    flags = json.loads(FLAGS.read_text(encoding="utf-8"))
    doc = {"sglang": flags["sglang"], "routes": routes, "flags": sorted({f["dest"] for f in flags["flags"]})}
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{len(routes)} routes and {len(doc['flags'])} flags of sglang {doc['sglang']} written to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
