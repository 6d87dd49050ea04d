"""The simulated engine's command line: sglang's parser with the sim's own ``--help`` (the simulated engine's usage,
its ``SGLSIM_*`` variables and faults first, then sglang's flags) and ``--help-faults``, and the ``SGLSIM_*`` values
it reads from the environment.

Part of :mod:`pytest_sglworker.sim`; stdlib only. The parser is rebuilt from the flag table of
:mod:`pytest_sglworker.engine.sglang_facts`, so that the sim accepts and rejects exactly what the real engine does;
a bad ``SGLSIM_*`` value ends the program with one line (:func:`config_error`, exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ..engine.sglang_facts import PARSER_PROG, flag_table, human_readable_int
from .core import (
    CONTROL_PATH,
    ENV_FAULT,
    ENV_GPU_FREE,
    ENV_GPU_MEM,
    ENV_PD_WAIT,
    ENV_RECORD,
    ENV_STARTUP,
    ENV_TOKEN,
    ENV_WARMUP,
    WORKER_HEADER,
)
from .faults import FaultError, fault_help


def _human_readable_int(value: str) -> int:
    try:
        return human_readable_int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _graph_backend(raw: str) -> str:
    if raw == "tc_piecewise":
        raise argparse.ArgumentTypeError("tc_piecewise was removed; select breakable, full, or disabled")
    return raw


#: sglang's own flag types, by name (the table stores the type's ``__name__``); any other type is a string.
_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "human_readable_int": _human_readable_int,
    "parse_cuda_graph_backend_arg": _graph_backend,
}

#: The first line of ``--help``: the simulated engine's own usage (argparse's errors keep sglang's, ``sglang serve``).
USAGE = ("usage: python -m pytest_sglworker.sim [-h] [--help-faults] --model-path MODEL_PATH "
         "[sglang 0.5.23 flags ...]")

_INTRO = """\
pytest-sglworker's simulated sglang engine: a CPU-only stand-in for sglang 0.5.23's server (its flags, endpoints,
log lines, gRPC and PD protocols) on a real port, with switchable faults. --help-faults prints only the faults
and the SGLSIM_* variables below."""

#: The ``SGLSIM_*`` variables: (name=VALUE, what it does).
_VARIABLES = (
    (f"{ENV_STARTUP}=S", "total simulated startup (default 0.3; 70 % before binding)"),
    (f"{ENV_WARMUP}=S", "the warmup part after binding (default 30 % of the startup)"),
    (f"{ENV_GPU_MEM}=GIB", "the card size (default 80)"),
    (f"{ENV_GPU_FREE}=MIB", "memory free when the weights load (default 98.125 % of the card)"),
    (f"{ENV_TOKEN}=S", "time per generated token (default 0)"),
    (f"{ENV_PD_WAIT}=S", "how long a PD side waits for its peer (default 15)"),
    (f"{ENV_RECORD}=PATH", "append start/ready/exit events as JSON lines"),
    (f"{ENV_FAULT}=F1,F2=V,...", "faults, below"),
)

_FAULTS_HELP = f"""\
environment:
{chr(10).join(f"  {name:<28} {text}" for name, text in _VARIABLES)}

{{faults}}

control endpoint (exempt from the API key and the faults):
  GET  {CONTROL_PATH}   the request faults in force, counters since they were set, the worker
  POST {CONTROL_PATH}   {{"fail_first": 2, "latency": 0.1}}, {{"spec": "fail_first=2"}}, {{"reset": true}};
                      null clears one fault; a bad body answers 400 with the error
every response carries {WORKER_HEADER}: <port>/<pid>.
"""

#: The title of the section of sglang's own flags in ``--help``.
FLAGS_TITLE = "sglang 0.5.23's flags (accepted and rejected as its own parser does)"


def faults_help() -> str:
    """``--help-faults``: the ``SGLSIM_*`` variables, every fault (from :data:`~.faults.FAULTS`) and the control
    endpoint; a fixed width, whatever the terminal."""
    return _FAULTS_HELP.replace("{faults}", fault_help())


class SimParser(argparse.ArgumentParser):
    """sglang's parser (its usage and errors: ``sglang serve: error: ...``) whose ``--help`` puts the simulated
    engine first: its usage line, what it is, the variables and faults, then sglang's flags."""

    def format_help(self) -> str:
        formatter = self._get_formatter()
        for group in self._action_groups:
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
        return f"{USAGE}\n\n{_INTRO}\n\n{faults_help()}\n{formatter.format_help()}"


def build_parser() -> argparse.ArgumentParser:
    """sglang 0.5.23's ``ServerArgs.add_cli_args``, rebuilt from the flag table of :mod:`sglang_facts`: every
    flag the real parser accepts (abbreviations too), with its choices and defaults, so that the simulated
    engine accepts and rejects exactly what the real one does. Its ``--help`` documents the sim's own knobs
    first (:class:`SimParser`)."""
    p = SimParser(prog=PARSER_PROG, allow_abbrev=True, formatter_class=argparse.RawDescriptionHelpFormatter)
    p._optionals.title = FLAGS_TITLE
    for flag in flag_table().flags:
        longs = [o for o in flag.options if not o.startswith("--no-")]
        if not flag.takes_value:
            if len(longs) < len(flag.options):  # --x / --no-x
                p.add_argument(*longs, dest=flag.dest, action=argparse.BooleanOptionalAction, default=flag.default)
            else:
                p.add_argument(*longs, dest=flag.dest, action="store_true")
            continue
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": flag.default, "required": flag.required,
                                  "type": _TYPES.get(flag.type or "", str)}
        if flag.nargs is not None:
            kwargs["nargs"] = flag.nargs
        if flag.choices is not None:
            # the table keeps choices as text; a typed flag (--log-requests-level: int) compares converted values
            convert = kwargs["type"]
            try:
                kwargs["choices"] = [convert(c) for c in flag.choices] if flag.type in _TYPES else flag.choices
            except (ValueError, argparse.ArgumentTypeError):
                kwargs["choices"] = flag.choices
        p.add_argument(*longs, **kwargs)
    return p


def env_float(name: str, default: float | None) -> float | None:
    """A non-negative number from the environment (``default`` when unset); raises :class:`FaultError`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise FaultError(f"{name}: expected a number of seconds/GiB, got {raw!r}") from None
    if value < 0 or value != value:
        raise FaultError(f"{name}: expected a non-negative number, got {raw!r}")
    return value


def env_mib(name: str) -> int | None:
    """A whole non-negative number of MiB from the environment (None when unset); raises :class:`FaultError`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise FaultError(f"{name}: expected a whole number of MiB, got {raw!r}") from None
    if value < 0:
        raise FaultError(f"{name}: expected a non-negative number of MiB, got {raw!r}")
    return value


def config_error(message: str) -> int:
    """A bad ``SGLSIM_*`` value: one line on stderr (argparse-like) and the same as a log record."""
    sys.stderr.write(f"sglang serve (sim): error: {message}\n")
    sys.stderr.flush()
    try:
        sys.stdout.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] sglang serve (sim): error: {message}\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    return 2
