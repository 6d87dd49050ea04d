"""The mandatory memory budget: every worker argv keeps ``--mem-fraction-static <= 0.6`` and the prefill
CUDA graph disabled.

Why: the fraction is of the memory free when the worker starts; with the engine default (~0.83 on an 80 GB
card) the KV pool takes the slack that CUDA graph capture needs and the worker dies with -9 during
startup. Plain Python: no pytest here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .sglang_facts import flag_table
from .specs import CI_WORKER_ARGS, ModelSpec

FRACTION_FLAG = "--mem-fraction-static"
PREFILL_FLAG = "--cuda-graph-backend-prefill"
MAX_FRACTION = 0.6
_DESTS = {FRACTION_FLAG: "mem_fraction_static", PREFILL_FLAG: "cuda_graph_backend_prefill"}

FIX = (
    "add CI_WORKER_ARGS to the spec's worker_args "
    f"({' '.join(CI_WORKER_ARGS)}), or lower the fraction; see 'The budget and the memory ledger' in the docs "
    "(docs/explanation/budget-and-ledger.md)"
)


def flag_values(argv: Sequence[str]) -> dict[str, list[str | None]]:
    """Values given to the budget flags in ``argv``, in order (argparse keeps the last one).

    ``--flag=value``, ``--flag value`` and every abbreviation sglang's parser accepts (``--mem 0.9``): the
    flags are resolved by :mod:`sglang_facts`, which holds the parser's option table. ``None`` marks a flag
    given without a value.
    """
    parsed = flag_table().parse(argv)
    return {flag: parsed.all(dest) for flag, dest in _DESTS.items() if parsed.given(dest)}


@dataclass(frozen=True)
class BudgetProblem:
    flag: str
    problem: str

    def __str__(self) -> str:
        return f"{self.flag}: {self.problem}"


def check_argv(argv: Sequence[str]) -> list[BudgetProblem]:
    """Problems with the budget in an effective worker argv (spec args followed by extra args)."""
    problems: list[BudgetProblem] = []
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        problems.append(BudgetProblem("--config", "a config file can change the budget unseen; pass flags on the argv"))
    values = flag_values(argv)
    fractions = values.get(FRACTION_FLAG)
    if not fractions:
        problems.append(BudgetProblem(FRACTION_FLAG, f"missing (must be <= {MAX_FRACTION})"))
    else:
        last = fractions[-1]
        try:
            fraction = float(last) if last is not None else None
        except ValueError:
            fraction = None
        if fraction is None:
            problems.append(BudgetProblem(FRACTION_FLAG, f"value {last!r} is not a number"))
        elif fraction > MAX_FRACTION:
            problems.append(BudgetProblem(FRACTION_FLAG, f"{fraction:g} is above the budget of {MAX_FRACTION}"))
        elif not 0 < fraction <= MAX_FRACTION:  # zero, negative, or NaN
            problems.append(BudgetProblem(FRACTION_FLAG, f"{fraction:g} is not in (0, {MAX_FRACTION}]"))
    prefills = values.get(PREFILL_FLAG)
    if not prefills:
        problems.append(BudgetProblem(PREFILL_FLAG, "missing (must be 'disabled')"))
    elif prefills[-1] != "disabled":
        problems.append(
            BudgetProblem(PREFILL_FLAG, f"{prefills[-1]!r} re-enables the prefill CUDA graph (must be 'disabled')")
        )
    return problems


def check_spec(spec: ModelSpec) -> list[BudgetProblem]:
    """Problems with a spec's own worker_args."""
    return check_argv(spec.worker_args)


def describe_violation(subject: str, problems: Sequence[BudgetProblem], fix: str = FIX) -> str:
    """One message naming the subject, each problem, and the fix."""
    lines = [f"{subject} breaks the mandatory worker budget:"]
    lines += [f"  - {p}" for p in problems]
    lines.append(f"  fix: {fix}")
    return "\n".join(lines)
