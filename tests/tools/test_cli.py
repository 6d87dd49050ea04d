"""The ``sglworker`` console script: where its installs go when it is given no folder (the user's cache directory,
never the package's own folder), that the repository's scripts are the same command, and its usage errors. The
GPU check it runs is tested in tests/acceptance/test_gpu_check.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
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


# A driver that runs the command with its recipes taken from another folder (a fake recipe, not the real
# multi-gigabyte install) and a short grace between the signals it sends after an interrupt.
_DRIVER = """
import sys
from pathlib import Path
import pytest_sglworker.tools.cli as cli
cli.RECIPES = Path(sys.argv[1])
cli.GRACE_S = 2.0
sys.exit(cli.main(sys.argv[2:]))
"""

# An install that runs a child in the foreground (pip, say) and one in the background that ignores SIGINT, and
# says so by writing their pids once both run.
_SLOW_RECIPE = """set -euo pipefail
(trap '' INT; exec sleep 1000) &
echo $! > "$1.background"
sh -c 'echo $$ > "$1"; exec sleep 1000' sh "$1.foreground"
"""


def _wait_for(path: Path, process: subprocess.Popen[str], deadline_s: float = 60.0) -> int:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return int(path.read_text())
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"the fake install never wrote {path}")


def _slow_install(tmp_path: Path, driver: str) -> tuple[subprocess.Popen[str], Path]:
    """``driver`` running ``install-real-engine`` with :data:`_SLOW_RECIPE` as its recipe; the install's folder."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "install-real-engine.sh").write_text(_SLOW_RECIPE)
    folder = tmp_path / "engine"
    process = subprocess.Popen([sys.executable, "-c", driver, str(recipes), "install-real-engine", str(folder)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    return process, folder


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_install_ends_its_whole_process_group(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C (SIGINT to the command) or SIGTERM during an install: one line, exit 128 + the signal, and no process
    of the install left running, neither the recipe's foreground child nor one that ignores SIGINT."""
    process, folder = _slow_install(tmp_path, _DRIVER)
    try:
        background = _wait_for(Path(f"{folder}.background"), process)
        foreground = _wait_for(Path(f"{folder}.foreground"), process)
        process.send_signal(sig)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + sig, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"sglworker install-real-engine: interrupted ({sig.name})"), err
    assert [pid for pid in (background, foreground) if _running(pid)] == []


# The driver again, with the interrupt landing while the recipe starts: sent from inside ``Popen``, after the recipe
# began and before ``Popen`` returned (on a busy machine its first lines run that early: it was once left running)
_DRIVER_EARLY = _DRIVER.replace("sys.exit(", """import os, signal, subprocess
real = subprocess.Popen
class Early(real):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
cli.subprocess.Popen = Early
sys.exit(""", 1)


def test_an_interrupt_while_the_recipe_starts_still_ends_its_group(tmp_path: Path) -> None:
    process, folder = _slow_install(tmp_path, _DRIVER_EARLY)
    try:
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGINT, err
    assert err.startswith("sglworker install-real-engine: interrupted (SIGINT)"), err
    for name in ("background", "foreground"):  # what the recipe started by then is gone
        path = Path(f"{folder}.{name}")
        assert not (path.is_file() and path.read_text().strip() and _running(int(path.read_text()))), name


def test_the_checkout_command_works_without_its_venv(tmp_path: Path) -> None:
    """A clone without ``.venv``, another venv activated (its ``python3`` first on PATH): ``scripts/gpu-check``
    picks that python by its bare name, which exec does not look up on PATH."""
    clone = tmp_path / "clone"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "scripts", clone / "scripts", ignore=ignore)
    shutil.copytree(PACKAGE, clone / "pytest_sglworker", ignore=ignore)
    env = {**_env(tmp_path), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for name in ("SGLWORKER_PYTHON", "GPU_CHECK_PYTHON", "PYTHONPATH"):
        env.pop(name, None)
    done = subprocess.run(["bash", str(clone / "scripts" / "gpu-check"), "--help"], env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and "--dry-run" in done.stdout, done.stdout + done.stderr
    # the console script's own lookup, given the bare name
    done = subprocess.run([*COMMAND, "gpu-check", "--help"], env={**env, "GPU_CHECK_PYTHON": "python3"},
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and "--dry-run" in done.stdout, done.stdout + done.stderr
    done = subprocess.run([*COMMAND, "gpu-check", "--help"], env={**env, "GPU_CHECK_PYTHON": "no-such-python"},
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "cannot run no-such-python: not found on PATH" in done.stderr, done.stderr


def test_the_recipes_pip_does_not_see_the_checkout(tmp_path: Path) -> None:
    """``scripts/sglworker`` puts the checkout on PYTHONPATH to run this command; the recipe's environment (a venv
    of its own, built by its pip) must not see the checkout's metadata, else pip reports the plugin's
    dependencies as missing (``ERROR: pip's dependency resolver ...``) on an install that succeeded. The fake
    recipe builds a bare venv and lists what its python sees; with the real engine installed, its pip's check
    names no pytest-sglworker either."""
    assert list(REPO.glob("*.egg-info")), "the checkout holds no metadata: install it with pip install -e ."
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "install-real-engine.sh").write_text("""set -euo pipefail
echo "PYTHONPATH=${PYTHONPATH:-}"
"$SGLWORKER_BASE_PYTHON" -m venv --without-pip "$1"
"$1/bin/python" -c 'import importlib.metadata as m; print("sees:", sorted(d.name for d in m.distributions()))'
if [[ -x "${REAL_ENGINE:-}/bin/python" ]]; then "$REAL_ENGINE/bin/python" -m pip check || true; fi
""")
    env = {**_env(tmp_path), "PYTHONPATH": str(REPO), "REAL_ENGINE": str(default_real_engine_dir())}
    env["XDG_CACHE_HOME"] = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    done = subprocess.run([sys.executable, "-c", _DRIVER, str(recipes), "install-real-engine", str(tmp_path / "e")],
                          env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PYTHONPATH=\n" in done.stdout and "sees: []" in done.stdout, done.stdout
    assert "pytest-sglworker" not in done.stdout + done.stderr


def test_the_recipe_environment_keeps_the_users_pythonpath(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the folder that holds this package leaves the recipe's PYTHONPATH."""
    from pytest_sglworker.tools import cli

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(PACKAGE.parent), f"{PACKAGE.parent}/"]))
    assert cli._recipe_environ("SGLWORKER_BASE_PYTHON")["PYTHONPATH"] == str(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(PACKAGE.parent))
    assert "PYTHONPATH" not in cli._recipe_environ("SGLWORKER_BASE_PYTHON")
