"""The mandatory memory budget: every worker argv keeps ``--mem-fraction-static <= 0.6`` and the prefill
CUDA graph disabled.

Why: the fraction is of the memory free when the worker starts; with the engine default (~0.83 on an 80 GB
card) the KV pool takes the slack that CUDA graph capture needs and the worker dies with -9 during
startup. Plain Python: no pytest here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import docs_url
from .sglang_facts import flag_table
from .specs import CI_WORKER_ARGS, ModelSpec

FRACTION_FLAG = "--mem-fraction-static"
PREFILL_FLAG = "--cuda-graph-backend-prefill"
MAX_FRACTION = 0.6
_DESTS = {FRACTION_FLAG: "mem_fraction_static", PREFILL_FLAG: "cuda_graph_backend_prefill"}

FIX = (
    "add CI_WORKER_ARGS to the spec's worker_args "
    f"({' '.join(CI_WORKER_ARGS)}), or lower the fraction; see 'The budget and the memory ledger' in the docs "
    f"({docs_url('explanation/budget-and-ledger.md')})"
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
        why = fraction_problem(fraction)
        if fraction is None:
            problems.append(BudgetProblem(FRACTION_FLAG, f"value {last!r} is not a number"))
        elif why:
            problems.append(BudgetProblem(FRACTION_FLAG, f"{fraction:g} is {why}"))
    prefills = values.get(PREFILL_FLAG)
    if not prefills:
        problems.append(BudgetProblem(PREFILL_FLAG, "missing (must be 'disabled')"))
    elif prefills[-1] != "disabled":
        problems.append(
            BudgetProblem(PREFILL_FLAG, f"{prefills[-1]!r} re-enables the prefill CUDA graph (must be 'disabled')")
        )
    return problems


def fraction_problem(fraction: object) -> str | None:
    """Why a ``--mem-fraction-static`` value, given on an argv or reported by a running worker, breaks the budget
    (``"above the budget of 0.6"``, ``"not in (0, 0.6]"``, ``"not a number"``), or None when it keeps it. NaN
    compares false with every bound: only a value each bound allows passes, never one no bound refuses."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        return "not a number"
    if fraction > MAX_FRACTION:  # infinity too; an int is compared as it is (float() of a huge one overflows)
        return f"above the budget of {MAX_FRACTION}"
    if not fraction > 0:  # zero, negative, NaN
        return f"not in (0, {MAX_FRACTION}]"
    return None


def show_number(value: object) -> str:
    """A value for a message: ``0.85``, ``nan``, ``inf``; an int too long for a float named as one, anything else
    by its repr, cut short."""
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**15):
        return f"{value:g}"
    return "a huge integer" if isinstance(value, int) and not isinstance(value, bool) else f"{value!r:.80}"


def check_spec(spec: ModelSpec) -> list[BudgetProblem]:
    """Problems with a spec's own worker_args."""
    return check_argv(spec.worker_args)


def describe_violation(subject: str, problems: Sequence[BudgetProblem], fix: str = FIX) -> str:
    """One message naming the subject, each problem, and the fix."""
    lines = [f"{subject} breaks the mandatory worker budget:"]
    lines += [f"  - {p}" for p in problems]
    lines.append(f"  fix: {fix}")
    return "\n".join(lines)
