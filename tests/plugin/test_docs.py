"""The docs site: its reference pages are what scripts/gen_reference.py writes from the code (so they cannot drift
from it), and it builds with ``mkdocs build --strict`` (a broken link or anchor, a page left out of the nav, is an
error). The examples in its pages run in tests/plugin/test_readme_examples.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "scripts" / "gen_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_the_generated_one() -> None:
    generator = _generator()
    stale = [name for name, render in generator.PAGES.items()
             if (REPO / "docs" / "reference" / name).read_text(encoding="utf-8") != render()]
    assert not stale, f"docs/reference/{stale} differ from the code: run python scripts/gen_reference.py"
    assert sorted(p.name for p in (REPO / "docs" / "reference").glob("*.md")) == sorted(generator.PAGES)


def test_the_reference_covers_what_the_code_defines() -> None:
    """Every option, marker, fixture, public name and fault has its entry (the generator reads them all)."""
    import pytest_sglworker
    from pytest_sglworker.plugin.options import OPTIONS
    from pytest_sglworker.sim.faults import FAULTS

    pages = {p.name: p.read_text(encoding="utf-8") for p in (REPO / "docs" / "reference").glob("*.md")}
    assert all(f"`--sgl-{opt.name}" in pages["options.md"] and f"`{opt.env}`" in pages["options.md"]
               and f"`{opt.ini}`" in pages["options.md"] for opt in OPTIONS)
    assert all(f"| `{name}` |" in pages["api.md"] or f"| `{name}(" in pages["api.md"]
               for name in pytest_sglworker.__all__)
    assert all(f"`{fault.name}" in pages["sim-faults.md"] for fault in FAULTS)
    for name in ("sgl_worker", "sgl_workers", "sgl_router", "sgl_requires", "sgl_budget_opt_out"):
        assert f"## `{name}`" in pages["markers.md"], name
    for name in ("sgl_model", "sgl_registry", "sgl_worker", "sgl_workers", "sgl_router", "sgl_spawn_worker"):
        assert f"## `{name}`" in pages["fixtures.md"], name


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material are missing: pip install -e '.[docs]'")
def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "options" / "index.html").is_file()
