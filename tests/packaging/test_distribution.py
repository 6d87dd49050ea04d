"""The package as people who only ``pip install`` get it: ``python -m build`` (an isolated build, as a release
makes it) without warnings about the project's metadata, ``twine check --strict`` clean, a wheel that holds the
package data the plugin and ``sglworker`` read (and nothing of the checkout's tests, benchmarks or scripts), the
version written once; and (slow) a fresh venv outside any checkout in which ``pip install <wheel>`` gives a
working ``sglworker gpu-check --dry-run`` and a working simulated-engine test file."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib

import pytest_sglworker

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("build") is None or importlib.util.find_spec("twine") is None,
    reason="build and twine are missing: pip install -e '.[test]'")


def _clean_copy(folder: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked, and new ones git does not ignore): no build
    leftovers such as an editable install's ``*.egg-info``, whose file list setuptools would reuse."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, timeout=60, check=False)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    for name in listed.stdout.decode().split("\0"):
        if name and (REPO / name).is_file():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target)
    return folder


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m build`` of this checkout (the sdist, then the wheel from it): the folder and its output."""
    out = tmp_path_factory.mktemp("dist")
    source = _clean_copy(tmp_path_factory.mktemp("source"))
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(source)], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, done.stdout + done.stderr


def _wheel(dist: tuple[Path, str]) -> Path:
    wheels = sorted(dist[0].glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_build_has_no_metadata_warnings_and_twine_passes_strict(dist: tuple[Path, str]) -> None:
    folder, output = dist
    # e.g. setuptools' "`project.license` as a TOML table is deprecated" (builds stop working in 2027)
    warnings = [line for line in output.splitlines() if re.search(r"Deprecat|SetuptoolsWarning", line)]
    assert not warnings, "\n".join(warnings)
    files = sorted(str(p) for p in folder.iterdir())
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_the_wheel_holds_the_package_data_and_nothing_of_the_checkout(dist: tuple[Path, str]) -> None:
    names = set(zipfile.ZipFile(_wheel(dist)).namelist())
    package = REPO / "pytest_sglworker"
    needed = {"pytest_sglworker/py.typed", "pytest_sglworker/tools/cli.py"}
    needed |= {f"pytest_sglworker/engine/data/{p.name}" for p in (package / "engine" / "data").glob("*.json")}
    # what sglworker runs by path: every file of the GPU check and of the install recipes
    needed |= {p.relative_to(REPO).as_posix() for folder in ("gpu_check", "recipes")
               for p in (package / "tools" / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert len(needed) > 20  # the globs found the files
    assert needed <= names, sorted(needed - names)
    stray = sorted(n for n in names if n.split("/")[0] in ("tests", "bench", "scripts", "conftest_examples", "docs"))
    assert not stray, stray
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    metadata = zipfile.ZipFile(_wheel(dist)).read(f"pytest_sglworker-{pytest_sglworker.__version__}.dist-info/"
                                                  "METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Dist: platformdirs" in metadata


def test_the_version_is_written_once() -> None:
    """pyproject.toml takes the version from the package (``dynamic``), so the two cannot disagree."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pytest_sglworker.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pytest_sglworker.__version__)


SIM_TESTS = '''
import pytest

@pytest.mark.sgl_workers(count=2)
def test_two_workers(sgl_workers):
    for worker in sgl_workers:
        resp = worker.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200, resp.text

def test_one_worker(sgl_worker):
    assert sgl_worker.client.get("/health").status_code == 200
'''


@pytest.mark.slow
def test_a_fresh_venv_outside_any_checkout_gets_a_working_plugin_and_command(dist: tuple[Path, str],
                                                                              tmp_path: Path) -> None:
    """``pip install <wheel>`` (its dependencies from the package index, pip's cache allowed) into a new venv in a
    folder that is no checkout: ``sglworker gpu-check --dry-run`` passes every check, and a test file on the
    simulated engine passes."""
    home = tmp_path / "user"
    home.mkdir()
    assert not any((parent / ".git").exists() or (parent / "pyproject.toml").exists()
                   for parent in (home, *home.parents))
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and
           (not k.startswith(("SGLWORKER_", "PYTEST_", "GPU_CHECK_")) or k == "SGLWORKER_TEST_MARK")}
    env["XDG_CACHE_HOME"] = str(home / "cache")
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          str(_wheel(dist))], capture_output=True, text=True, timeout=600, env=env, cwd=home,
                         stdin=subprocess.DEVNULL)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]

    check = subprocess.run([str(venv / "bin" / "sglworker"), "gpu-check", "--dry-run", "--out", str(home / "out")],
                           capture_output=True, text=True, timeout=600, env=env, cwd=home, stdin=subprocess.DEVNULL)
    assert check.returncode == 0, check.stdout[-6000:] + check.stderr[-3000:]
    doc = json.loads((home / "out" / "gpu-check.json").read_text())
    assert doc["ok"] and doc["failed"] == [] and len(doc["checks"]) == 11
    environment = next(row for row in doc["checks"] if row["check"] == "environment")["data"]
    assert Path(environment["plugin_file"]).is_relative_to(venv)  # the installed plugin, not this checkout
    assert environment["plugin_loaded_by"] == "entry point (installed)"

    (home / "suite").mkdir()
    (home / "suite" / "test_on_the_sim.py").write_text(textwrap.dedent(SIM_TESTS))
    run = subprocess.run([str(venv / "bin" / "pytest"), "-p", "no:cacheprovider", "--sgl-engine", "sim",
                          "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:2", "--sgl-lock-dir", str(home / "locks"),
                          "--sgl-log-dir", str(home / "logs"), "-q", "-rs"], capture_output=True, text=True,
                         timeout=300, env={**env, "SGLSIM_STARTUP_SECONDS": "0.2"}, cwd=home / "suite",
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]
