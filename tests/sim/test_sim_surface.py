"""The simulated engine's coverage of sglang 0.5.23's server flags and routes (``tests/sim/surface.py``): every
route and every flag read from the real engine's source has exactly one class and a reason, the page
``docs/SIM_FLAGS.md`` is rendered from them, a flag the sim is said to simulate names a test that exists, and,
where the real engine is installed, the committed list is what its source says today."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import surface

REPO = Path(__file__).resolve().parents[2]


def _surface() -> dict[str, object]:
    return dict(json.loads(surface.DATA.read_text(encoding="utf-8")))


def test_every_flag_and_route_has_a_class_and_a_reason() -> None:
    data = _surface()
    served = surface.sim_routes()
    flags = [(f, surface.flag_verdict(f)) for f in data["flags"]]  # type: ignore[attr-defined]
    routes = [(r, surface.route_verdict(r, served)) for r in data["routes"]]  # type: ignore[attr-defined]
    assert [f for f, v in flags if v is None] == []
    assert [r["path"] for r, v in routes if v is None] == []
    for _, verdict in [*flags, *routes]:
        assert verdict is not None and verdict[0] in surface.CLASSES and verdict[1]
    assert not set(surface.FLAGS) - set(data["flags"]), "a classified flag sglang does not have"  # type: ignore[arg-type]
    known_paths = {r["path"] for r in data["routes"]}  # type: ignore[attr-defined]
    assert not set(surface.ROUTES_NOT_SIMULATED) - known_paths, "a route entry sglang does not have"


def test_what_the_sim_simulates_names_a_test_that_holds_it() -> None:
    """A simulated or refused flag names the test file that uses it, or says that none does yet."""
    for dest, (cls, why) in surface.FLAGS.items():
        if cls not in (surface.SIMULATED, surface.REFUSED):
            continue
        named = re.findall(r"tests/\w+/\w+\.py", why)
        if not named:
            assert surface._UNTESTED in why, dest
            continue
        texts = [(REPO / path).read_text(encoding="utf-8") for path in named]
        flag = "--" + dest.replace("_", "-")
        assert any(flag in text or f'"{dest}"' in text for text in texts), (dest, named)


def test_the_page_is_rendered_from_the_data() -> None:
    expected = surface.render(_surface(), surface.sim_routes())
    stale = "docs/SIM_FLAGS.md is stale: run python tests/sim/surface.py"
    assert surface.DOC.read_text(encoding="utf-8") == expected, stale
    assert ", 0 unclassified. Flags" in expected and ", 0 unclassified; " in expected


@pytest.mark.real_engine
def test_the_committed_list_is_the_installed_engines(tmp_path: Path) -> None:
    from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python

    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    where = "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"
    package = subprocess.run([str(python), "-c", where], capture_output=True, text=True, check=True,
                             timeout=120).stdout.strip()
    sys.path.insert(0, str(REPO / "scripts"))
    import sim_surface

    routes = []
    for name in sim_surface.ROUTE_FILES:
        path = Path(package) / name
        if path.is_file():
            routes += sim_surface.routes_of(path.read_text(encoding="utf-8"), name)
    def key(route: dict[str, object]) -> str:
        return json.dumps(route, sort_keys=True)

    assert sorted(routes, key=key) == sorted(_surface()["routes"], key=key), (  # type: ignore[arg-type]
        "the installed sglang's routes differ: run .venv/bin/python scripts/sim_surface.py")
