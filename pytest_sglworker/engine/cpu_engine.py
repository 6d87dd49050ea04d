"""The recipe for running the real sglang server on a CPU through the plugin's normal mechanisms.

sglang 0.5.23 serves a tiny model on a CPU-only machine when (see ``sglworker install-real-engine``):

- its venv has the CPU build of torch, torchvision with two fake-op registrations guarded, and a
  placeholder ``sgl_kernel`` in site-packages (PyPI has no CPU build of it);
- the worker's environment has ``SGLANG_USE_CPU_ENGINE=1`` (:data:`CPU_ENGINE_ENV`): without it sglang's
  ``is_cpu()`` is false and model building imports CUDA-only ops;
- its argv has ``--device cpu`` and the plain-torch backends (:data:`CPU_ENGINE_ARGS`), on top of the
  mandatory budget flags (:data:`~pytest_sglworker.engine.specs.CI_WORKER_ARGS`) that every spec carries.

:func:`cpu_engine_spec` makes a :class:`~pytest_sglworker.engine.specs.ModelSpec` of that recipe,
:func:`real_engine_python` finds the installed venv, :func:`real_engine_launcher` is the launcher argv,
and :func:`build_tiny_model` writes the tiny random-weight model (``tiny_model.py``, run in that venv).

Plain Python: no pytest, no torch, no sglang in this process.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from ..errors import SglWorkerError
from .install_dirs import default_real_engine_dir
from .sglang_facts import worker_ranks
from .specs import CI_WORKER_ARGS, ModelSpec

__all__ = [
    "CPU_ENGINE_ARGS",
    "CPU_ENGINE_ENV",
    "CPU_ENGINE_FEATURES",
    "CPU_RANK_BINDING_VAR",
    "INSTALL_COMMAND",
    "REAL_ENGINE_ENV_VAR",
    "REAL_ENGINE_MARKER",
    "TINY_MODEL_SCRIPT",
    "TinyModelError",
    "build_tiny_model",
    "cpu_engine_spec",
    "cpu_rank_binding",
    "cpu_rank_env",
    "real_engine_launcher",
    "real_engine_missing_reason",
    "real_engine_python",
]

#: Added to the worker's environment: makes sglang's ``is_cpu()`` true.
CPU_ENGINE_ENV: Mapping[str, str] = MappingProxyType({"SGLANG_USE_CPU_ENGINE": "1"})

#: sglang's variable that names each rank's CPU cores (``0-3|4-7``): required by its CPU engine when a worker has
#: more ranks (tp x pp x dp) than the machine has NUMA nodes ("SGLANG_CPU_OMP_THREADS_BIND is not set, in this
#: case, the total number of ranks ... should be smaller than or equal to number of numa node")
CPU_RANK_BINDING_VAR = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_rank_binding(ranks: int, cpus: Sequence[int] | None = None) -> dict[str, str]:
    """The environment that lets a CPU worker run ``ranks`` ranks (``--tp-size 2``) on a machine with fewer NUMA
    nodes: :data:`CPU_RANK_BINDING_VAR` splitting ``cpus`` (default: this process's affinity) into one share per
    rank, in order; with fewer cores than ranks, ranks share cores. Nothing for one rank."""
    if ranks <= 1:
        return {}
    cores = sorted(cpus if cpus is not None else os.sched_getaffinity(0)) or [0]
    shares = [cores[i * len(cores) // ranks:(i + 1) * len(cores) // ranks] or [cores[i % len(cores)]]
              for i in range(ranks)]

    def text(share: list[int]) -> str:
        if len(share) > 1 and share == list(range(share[0], share[-1] + 1)):
            return f"{share[0]}-{share[-1]}"
        return ",".join(map(str, share))

    return {CPU_RANK_BINDING_VAR: "|".join(text(share) for share in shares)}



def cpu_rank_env(argv: Sequence[str], env: Mapping[str, str], environ: Mapping[str, str],
                 cpus: Sequence[int] | None = None) -> dict[str, str]:
    """What a worker launched with ``argv`` needs beyond ``env`` (its own variables, over the inherited
    ``environ``) to start its ranks (:func:`~.sglang_facts.worker_ranks`: ``--tp-size 2``, ``--dp-size 2``) on
    sglang's CPU engine: :func:`cpu_rank_binding` when that environment is the CPU engine's
    (:data:`CPU_ENGINE_ENV`) and names no binding itself (:data:`CPU_RANK_BINDING_VAR` set by the spec, the test
    or the user wins); nothing for one rank or another engine."""
    combined = {**environ, **env}
    if any(combined.get(k) != v for k, v in CPU_ENGINE_ENV.items()) or CPU_RANK_BINDING_VAR in combined:
        return {}
    return cpu_rank_binding(worker_ranks(argv), cpus)

#: The engine flags of the CPU recipe (the budget flags come from ``CI_WORKER_ARGS``).
CPU_ENGINE_ARGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--cuda-graph-backend-decode=disabled",
    "--max-total-tokens",
    "1024",
    # sglang's scheduler polls its sockets in a busy loop between requests: an idle tiny-model engine used
    # 77-102 % of a core (measured on 2 cores), which a reused or kept-warm engine then takes from the tests.
    # With this flag it waits on its sockets (zmq poll, woken by the next request): 2 % idle, same answers.
    "--sleep-on-idle",
)

CPU_ENGINE_FEATURES: frozenset[str] = frozenset({"chat", "streaming"})

#: Names the real-engine venv (the folder ``sglworker install-real-engine`` was given).
REAL_ENGINE_ENV_VAR = "SGLWORKER_REAL_ENGINE"

#: The file the install script writes last, with the versions it installed.
REAL_ENGINE_MARKER = ".sglworker-real-engine"

#: The command that installs it (the ``sglworker`` console script of this package).
INSTALL_COMMAND = "sglworker install-real-engine"


def _install_hint() -> str:
    return (f"install it with '{INSTALL_COMMAND} [VENV_DIR]' and point {REAL_ENGINE_ENV_VAR} at VENV_DIR "
            f"(default {default_real_engine_dir()}, found without the variable)")


#: The standalone tiny-model builder, run with the real engine's python.
TINY_MODEL_SCRIPT = Path(__file__).resolve().with_name("tiny_model.py")


class TinyModelError(SglWorkerError):
    """The tiny model could not be built. ``str(err)`` carries the builder's output."""


def cpu_engine_spec(
    name: str,
    model_path: str,
    *,
    features: Iterable[str] = CPU_ENGINE_FEATURES,
    extra_args: Sequence[str] = (),
    memory_gb: float = 1,
    description: str = "",
) -> ModelSpec:
    """A spec that runs the real sglang on a CPU: worker_args ``CI_WORKER_ARGS + CPU_ENGINE_ARGS +
    extra_args`` (the budget flags stay mandatory) and env :data:`CPU_ENGINE_ENV`."""
    if isinstance(extra_args, str):
        extra_args = extra_args.split()
    return ModelSpec(
        name=name,
        model=str(model_path),
        memory_gb=memory_gb,
        tp=1,
        features=frozenset(features),
        worker_args=(*CI_WORKER_ARGS, *CPU_ENGINE_ARGS, *extra_args),
        env=dict(CPU_ENGINE_ENV),
        description=description or "the real sglang engine on a CPU (SGLANG_USE_CPU_ENGINE=1)",
    )


def _venv_python(venv: Path) -> Path | None:
    for name in ("python", "python3"):
        candidate = venv / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def real_engine_python(root: Path | str | None = None, *, environ: Mapping[str, str] | None = None) -> Path | None:
    """The python of the installed real-engine venv, or None.

    ``root`` names the venv (or a repository root with a finished ``.cache/real-engine``); without it,
    ``$SGLWORKER_REAL_ENGINE``; without that, the default install location
    (:func:`~pytest_sglworker.engine.install_dirs.default_real_engine_dir`), used only when the install there
    finished (its marker file is present). The path is absolute but symlinks are kept: a venv's python is a link
    to the base interpreter, and only the link's location makes it use the venv.
    """
    environ = os.environ if environ is None else environ
    if root is None and environ.get(REAL_ENGINE_ENV_VAR):
        root = environ[REAL_ENGINE_ENV_VAR]
    if root is not None:
        folder = Path(os.path.abspath(os.path.expanduser(str(root))))
        found = _venv_python(folder)
        if found is None and (folder / ".cache" / "real-engine" / REAL_ENGINE_MARKER).is_file():
            found = _venv_python(folder / ".cache" / "real-engine")  # a repository root
        return found
    default = default_real_engine_dir()
    if not (default / REAL_ENGINE_MARKER).is_file():
        return None
    return _venv_python(default)


def real_engine_missing_reason(root: Path | str | None = None, *, environ: Mapping[str, str] | None = None) -> str:
    """Why :func:`real_engine_python` finds nothing (a skip reason), or "" when it finds the venv."""
    environ = os.environ if environ is None else environ
    if real_engine_python(root, environ=environ) is not None:
        return ""
    hint = _install_hint()
    if root is not None:
        return f"no python in the real-engine venv {root} (expected {Path(root) / 'bin' / 'python'}); {hint}"
    if environ.get(REAL_ENGINE_ENV_VAR):
        venv = environ[REAL_ENGINE_ENV_VAR]
        return f"{REAL_ENGINE_ENV_VAR}={venv} has no bin/python; {hint}"
    default = default_real_engine_dir()
    if default.exists():
        return f"the real-engine install in {default} is unfinished (no marker file); {hint}"
    return f"the real sglang engine is not installed; {hint}"


def real_engine_launcher(python: Path | str) -> list[str]:
    """The launcher argv for the real engine: ``[python, "-m", "sglang.launch_server"]``."""
    return [str(python), "-m", "sglang.launch_server"]


def build_tiny_model(python: Path | str, out_dir: Path | str, timeout: float = 300) -> Path:
    """Write the tiny random-weight Llama into ``out_dir`` with the real engine's ``python`` (it has torch
    and transformers) by running ``tiny_model.py`` there; does nothing when a finished build of the same
    recipe is there already. Raises :class:`TinyModelError` with the builder's output on failure."""
    out = Path(os.path.abspath(os.path.expanduser(str(out_dir))))
    argv = [str(python), str(TINY_MODEL_SCRIPT), str(out)]
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        output = e.output if isinstance(e.output, str) else (e.output or b"").decode("utf-8", "replace")
        raise TinyModelError(
            f"building the tiny model in {out} with {python} took longer than {timeout:g} s\n{_tail(output)}"
        ) from None
    except OSError as e:
        raise TinyModelError(f"cannot run {python} to build the tiny model: {e}") from None
    if proc.returncode != 0 or not (out / "config.json").is_file():
        raise TinyModelError(
            f"building the tiny model in {out} with {python} failed (exit code {proc.returncode}):\n"
            f"{_tail(proc.stdout)}"
        )
    return out


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
