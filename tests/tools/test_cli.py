"""The ``sglworker`` console script: where its installs go when it is given no folder (the user's cache directory,
never the package's own folder), that the repository's scripts are the same command, and its usage errors. The
GPU check it runs is tested in tests/acceptance/test_gpu_check.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sglworker.engine import cpu_engine
from pytest_sglworker.engine.grpc_facts import router_vocab_dir
from pytest_sglworker.engine.install_dirs import default_real_engine_dir, default_router_vocab_dir

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pytest_sglworker"
COMMAND = [sys.executable, "-m", "pytest_sglworker.tools"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_ENCODINGS_BASE", "SGLWORKER_REAL_ENGINE")}
    return {**env, "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra}


def _without_npm(tmp_path: Path) -> str:
    """A PATH with bash and the basic tools but no npm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sha256sum", "mkdir", "cat", "cut", "dirname"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_the_defaults_are_in_the_users_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_real_engine_dir() == tmp_path / "pytest-sglworker" / "real-engine"
    assert default_router_vocab_dir() == tmp_path / "pytest-sglworker" / "tiktoken"
    for default in (default_real_engine_dir(), default_router_vocab_dir()):
        assert not default.is_relative_to(PACKAGE.parent)  # never the checkout's (or site-packages') folder
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    assert router_vocab_dir() is None  # nothing installed there
    assert "sglworker install-real-engine" in cpu_engine.real_engine_missing_reason(environ={})
    assert str(default_real_engine_dir()) in cpu_engine.real_engine_missing_reason(environ={})


def test_install_router_vocab_goes_to_the_cache_dir_by_default(tmp_path: Path) -> None:
    """Without npm the script says so, names the default file, and exits 0 (the tier is skipped without it)."""
    done = subprocess.run([*COMMAND, "install-router-vocab"], env=_env(tmp_path, PATH=_without_npm(tmp_path)),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    expected = tmp_path / "cache" / "pytest-sglworker" / "tiktoken" / "o200k_base.tiktoken"
    assert f"no npm here: the router's gRPC tests are skipped without {expected}" in done.stdout, done.stdout


def test_install_real_engine_goes_to_the_cache_dir_by_default(tmp_path: Path) -> None:
    """The recipe runs against the default folder (it fails here at once: the base python is ``false``)."""
    done = subprocess.run([*COMMAND, "install-real-engine"], env=_env(tmp_path, SGLWORKER_BASE_PYTHON="false"),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    venv = tmp_path / "cache" / "pytest-sglworker" / "real-engine"
    assert done.returncode != 0
    assert f"installing the real sglang 0.5.23 CPU engine into {venv} ..." in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("script", ["install-router-vocab.sh", "install-real-engine.sh"])
def test_the_checkout_scripts_are_the_same_command(tmp_path: Path, script: str) -> None:
    """The README's install commands in a clone run ``sglworker``: the same defaults."""
    env = _env(tmp_path, SGLWORKER_PYTHON=sys.executable, SGLWORKER_BASE_PYTHON="false")
    if script == "install-router-vocab.sh":
        env["PATH"] = _without_npm(tmp_path) + os.pathsep + str(Path(sys.executable).parent)
    done = subprocess.run(["bash", str(REPO / "scripts" / script)], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert str(tmp_path / "cache" / "pytest-sglworker") in done.stdout, done.stdout + done.stderr


def test_the_recipes_need_their_folder_and_the_command_its_subcommand(tmp_path: Path) -> None:
    for script in ("install-real-engine.sh", "install-router-vocab.sh"):
        done = subprocess.run(["bash", str(PACKAGE / "tools" / "recipes" / script)], capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert done.returncode == 2 and "gives it the default" in done.stderr, done.stderr
    done = subprocess.run(COMMAND, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "gpu-check" in done.stderr and "install-real-engine" in done.stderr


def test_install_script_and_marker_agree() -> None:
    script = (PACKAGE / "tools" / "recipes" / "install-real-engine.sh").read_text()
    assert f"MARKER_NAME={cpu_engine.REAL_ENGINE_MARKER}" in script
    assert "set -euo pipefail" in script
    subprocess.run(["bash", "-n", str(PACKAGE / "tools" / "recipes" / "install-real-engine.sh")], check=True)
