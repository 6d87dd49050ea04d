"""Mutation testing of the plugin's core promises, with cosmic-ray: every mutant of the code that carries a promise
must make that promise's own fast tests fail.

    python scripts/mutation.py                          # every target; writes tests/data/mutation/summary.json
    python scripts/mutation.py --module budget          # one target (repeatable); the others stay in the summary
    python scripts/mutation.py --list                   # the targets, their scope and their test commands
    python scripts/mutation.py --summary PATH --timeout 60

cosmic-ray mutates the file **in place** (and puts it back after each mutant), so the editable install sees each
mutant everywhere: in the test process and in every process a test starts (workers, keepers, inner sessions).
A tool that imports mutants through its own copy of the sources (mutmut 3) leaves the code run in those
subprocesses unmutated, and its mutants survive there falsely.

Each target is one module and the functions, methods or classes of it that carry the promise (``scope``; None: the
whole module), with the targeted tests that must kill its mutants (run as ``pytest -n 0 -p no:cacheprovider -x
-q``, under a per-mutant timeout). The operators are cosmic-ray's core operators, one replacement each (the
boundary and the negation of a comparison, one arithmetic swap, ...), plus the statement deletion cosmic-ray has
none of: a call made for its effect or an assignment into an attribute, an item or a variable that already holds
one (``env["PYTHONUNBUFFERED"] = "1"``, ``procs.update(...)``) becomes ``pass`` -- the hole an audit found.

The summary (per target: mutants, killed, survived, timeouts, and each survivor's place, operator and line; the
commit, cosmic-ray's version, the date and the machine) is committed; docs/TESTING.md says why each survivor left
is equivalent. tests/test_mutation_summary.py checks the committed summary meets the goal (and, in the slow tier,
runs this script on one target end to end).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SUMMARY = REPO / "tests" / "data" / "mutation" / "summary.json"
GOAL = 0.90
#: What every test command runs with: no xdist, no cache written into the checkout, no hypothesis plugin (half of
#: the start of a run on a loaded machine; the targeted tests use none), stop at the first failure.
PYTEST_ARGS = ("-n", "0", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-x", "-q", "-m", "not slow")
#: Set in the environment of every test command: whatever it starts carries it, so leftovers of a mutant that hung
#: (and was killed by the timeout, its own process group only) are found and ended by pid.
RUN_MARK = "SGLWORKER_MUTATION_RUN"


@dataclass(frozen=True)
class Target:
    path: str
    #: the promise, in words (docs/TESTING.md lists it too)
    promise: str
    #: the targeted tests: pytest node ids or files
    tests: tuple[str, ...]
    #: qualified names (``process_tree``, ``LeaseManager.acquire``, ``Lease``) whose lines are mutated; None: all
    scope: tuple[str, ...] | None = None


TARGETS: dict[str, Target] = {
    "budget": Target(
        "pytest_sglworker/engine/budget.py",
        "the budget check: a worker argv without --mem-fraction-static <= 0.6 and a disabled prefill CUDA graph, or "
        "with a config file, is refused with each problem named",
        ("tests/engine/test_specs_budget.py",),
        ("flag_values", "check_argv", "fraction_problem", "describe_violation"),
    ),
    "launch_env": Target(
        "pytest_sglworker/workers/process.py",
        "the launch environment and the log files: a worker inherits the main thread's environment less pytest's "
        "per-test variables, with its own env on top, PYTHONUNBUFFERED=1 and a fresh owner tag; it runs in a "
        "session of its own with stdin closed, stdout and stderr appended to a private log that never overwrites "
        "a kept one",
        ("tests/workers/test_launch_env.py",),
        ("inherited_environ", "unused_log_path", "_private_file", "popen", "start_process"),
    ),
    "teardown": Target(
        "pytest_sglworker/resources/processes.py",
        "process-tree teardown and the marker sweep: the root gets SIGTERM first, then its group, every descendant "
        "and every process carrying its owner tag, then SIGKILL for what is left; the session sweep ends every "
        "process tagged with the session; a tag is matched whole; every signal reaches only a process proven ours at "
        "that moment (a reused pid, another user's process, a group whose leader is gone: never by number)",
        ("tests/resources/test_teardown.py", "tests/resources/test_pid_reuse.py"),
        ("find_tagged_processes", "find_session_processes", "process_tree", "terminate_tree", "_terminate",
         "sweep_session"),
    ),
    "gpu_leases": Target(
        "pytest_sglworker/resources/gpus/leases.py",
        "GPU leases: tp GPUs with enough free memory each, locked across processes, never two holders of one "
        "GPU, CUDA_VISIBLE_DEVICES naming exactly the leased ones, released once",
        ("tests/resources/test_gpus.py",
         "tests/plugin/test_xdist_gpus.py::test_gpu_of_a_dead_holder_stays_busy_while_its_workers_run"),
        ("Lease.env", "LeaseManager._attempt", "LeaseManager._lock_group", "_let_go"),
    ),
    "port_blocks": Target(
        "pytest_sglworker/resources/ports.py",
        "port blocks: a block of consecutive free ports locked across processes, never handed to two holders, "
        "quarantined blocks never handed out again, released once",
        ("tests/resources/test_ports.py",),
        ("PortBlock.release", "_scan"),
    ),
    "warm_identity": Target(
        "pytest_sglworker/resources/warm_records.py",
        "warm records and adoption identity: a record is adopted only when its config, namespace and keeper match "
        "and its keeper lives; a record that fails to parse is refused",
        ("tests/resources/test_warm_records.py",),
        ("WarmEntry", "keeper_alive", "adopter_alive", "matching"),
    ),
    "adoption_proof": Target(
        "pytest_sglworker/resources/processes.py",
        "adoption identity: a process is adopted only when its pid, start time, uid and owner tag all match the "
        "record (a reused pid is never signalled)",
        ("tests/resources/test_teardown.py", "tests/resources/test_pid_reuse.py", "-k", "adopt or proven"),
        ("AdoptedProcess._prove", "AdoptedProcess.poll", "AdoptedProcess.send_signal", "prove_process"),
    ),
    "headline": Target(
        "pytest_sglworker/plugin/deaths.py",
        "the failure headline: a test failing because its worker died leads with the death, not the client's "
        "connection error",
        ("tests/plugin/test_death_headline.py",),
        ("_chain", "_connection_port", "_died", "dead_processes"),
    ),
    "diagnosis": Target(
        "pytest_sglworker/engine/diagnosis.py",
        "diagnosis selection: of the errors in a worker log, the cause (the first fatal error, not a later "
        "symptom) is the one named",
        ("tests/engine/test_diagnosis.py",),
        ("diagnose", "_secondary"),
    ),
}


# ------------------------------------------------------------------------------------------------ operators


def _operators() -> list[tuple[str, Any]]:
    """(name, operator instance): cosmic-ray's core operators, one replacement each, and the statement deletion."""
    import cosmic_ray.plugins

    names = [
        # comparisons: the boundary and the negation
        "ReplaceComparisonOperator_Eq_NotEq", "ReplaceComparisonOperator_NotEq_Eq",
        "ReplaceComparisonOperator_Lt_LtE", "ReplaceComparisonOperator_Lt_GtE",
        "ReplaceComparisonOperator_LtE_Lt", "ReplaceComparisonOperator_LtE_Gt",
        "ReplaceComparisonOperator_Gt_GtE", "ReplaceComparisonOperator_Gt_LtE",
        "ReplaceComparisonOperator_GtE_Gt", "ReplaceComparisonOperator_GtE_Lt",
        "ReplaceComparisonOperator_Is_IsNot", "ReplaceComparisonOperator_IsNot_Is",
        # arithmetic: one swap each
        "ReplaceBinaryOperator_Add_Sub", "ReplaceBinaryOperator_Sub_Add", "ReplaceBinaryOperator_Mul_Div",
        "ReplaceBinaryOperator_Div_Mul", "ReplaceBinaryOperator_FloorDiv_Mul", "ReplaceBinaryOperator_Mod_Mul",
        "ReplaceBinaryOperator_BitOr_BitAnd", "ReplaceBinaryOperator_BitAnd_BitOr",
        "ReplaceUnaryOperator_USub_UAdd", "ReplaceUnaryOperator_Delete_Not",
        # logic and control flow
        "AddNot", "ReplaceTrueWithFalse", "ReplaceFalseWithTrue", "ReplaceAndWithOr", "ReplaceOrWithAnd",
        "ReplaceBreakWithContinue", "ReplaceContinueWithBreak", "ExceptionReplacer", "NumberReplacer",
        "ZeroIterationForLoop",
    ]
    ops: list[tuple[str, Any]] = [(f"core/{n}", cosmic_ray.plugins.get_operator(f"core/{n}")()) for n in names]
    ops.append(("local/DeleteStatement", _delete_statement()))
    return ops


def _delete_statement() -> Any:
    """An operator (cosmic-ray's interface) that turns a statement made for its effect into ``pass``: a call
    (``proc.kill()``), an augmented assignment, or an assignment into an attribute or an item. A plain name's
    assignment is left out (deleting it raises NameError: killed by any test that runs the line, noise)."""
    from cosmic_ray.operators.operator import Example, Operator
    from parso.python.tree import Keyword

    def deletable(node: Any) -> bool:
        if node.type not in ("expr_stmt", "atom_expr", "power"):
            return False
        if node.parent is None or node.parent.type != "simple_stmt":
            return False
        if node.type == "expr_stmt":
            target = node.children[0]
            augmented = node.children[1].type == "operator" and node.children[1].value not in ("=", ":")
            return augmented or target.type in ("atom_expr", "power")
        return node.children[-1].type == "trailer" and node.children[-1].children[0].value == "("

    class DeleteStatement(Operator):
        def mutation_positions(self, node: Any) -> Iterator[tuple[Any, Any]]:
            if deletable(node):
                yield (node.start_pos, node.end_pos)

        def mutate(self, node: Any, index: int) -> Any:
            return Keyword("pass", node.start_pos, prefix=node.get_first_leaf().prefix)

        @classmethod
        def examples(cls) -> tuple[Any, ...]:
            return (Example("x.y = 1\n", "pass\n"), Example("f(x)\n", "pass\n"))

    return DeleteStatement()


# ------------------------------------------------------------------------------------------------ mutants


@dataclass(frozen=True)
class Mutant:
    operator: str
    instance: Any
    occurrence: int
    line: int
    column: int
    definition: str


def scope_ranges(path: Path, scope: tuple[str, ...] | None) -> list[tuple[int, int]]:
    """The line ranges of ``scope``'s definitions in ``path`` (decorators included); all lines when None. An unknown
    name is an error (a renamed function must not leave its promise untested in silence)."""
    if scope is None:
        return [(1, 10**9)]
    tree = ast.parse(path.read_text())
    found: dict[str, tuple[int, int]] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found[name] = (start, child.end_lineno or child.lineno)
                walk(child, f"{name}.")

    walk(tree, "")
    missing = [name for name in scope if name not in found]
    if missing:
        raise SystemExit(f"{path}: no definition named {', '.join(missing)} (update TARGETS in {__file__})")
    return [found[name] for name in scope]


#: A line that ends with this comment is not mutated: the one kind of line that carries it is a grace's length
#: (how long a wait may last, never whether it happens), each on a line of its own; docs/TESTING.md lists them.
NO_MUTATE = "# pragma: no mutate"


def excluded_lines(path: Path, scope: tuple[str, ...] | None) -> list[int]:
    """The lines of ``scope`` that carry :data:`NO_MUTATE`."""
    ranges = scope_ranges(path, scope)
    return [n for n, line in enumerate(path.read_text().splitlines(), 1)
            if line.rstrip().endswith(NO_MUTATE) and any(low <= n <= high for low, high in ranges)]


def mutants(path: Path, scope: tuple[str, ...] | None) -> list[Mutant]:
    """Every mutant of ``path`` whose line lies in ``scope``; docstring-free lines only (operators never touch
    strings), none on a line marked :data:`NO_MUTATE`."""
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    from cosmic_ray.ast.ast_query import ASTQuery
    from cosmic_ray.mutating import mutate_code

    ranges = scope_ranges(path, scope)
    source = path.read_text()
    skipped = set(excluded_lines(path, scope))
    module_ast = get_ast_from_path(path)
    found: list[Mutant] = []
    for name, operator in _operators():
        positions = ((node, start) for node in ast_nodes(module_ast) for start, _ in operator.mutation_positions(node))
        for occurrence, (node, start) in enumerate(positions):
            if name == "core/NumberReplacer" and occurrence % 2:
                continue  # n - 1: of n + 1 and n - 1 (cosmic-ray's two, in turn), one is enough to check a number
            if any(low <= start[0] <= high for low, high in ranges) and start[0] not in skipped \
                    and not _in_signature(node):
                try:  # cosmic-ray's ExceptionReplacer fails on a dotted name in a tuple (psutil.Error, OSError)
                    mutate_code(source, operator, occurrence)
                except Exception:
                    continue
                definition = ASTQuery(node).get_definition_name() or ""
                found.append(Mutant(name, operator, occurrence, start[0], start[1], definition))
    return sorted(found, key=lambda m: (m.line, m.column, m.operator))


def _in_signature(node: Any) -> bool:
    """Whether ``node`` is part of a parameter list (a default value: the tests pass their own values, and which
    default a function has is a choice, not a promise) or of an annotation (never evaluated: every module has
    ``from __future__ import annotations``)."""
    while node.parent is not None:
        parent = node.parent
        if node.type in ("param", "parameters"):  # a bare * or / too
            return True
        siblings = parent.children
        i = siblings.index(node)
        if parent.type == "funcdef" and i > 0 and getattr(siblings[i - 1], "value", None) == "->":
            return True
        if parent.type == "annassign" and i == 1:
            return True
        node = parent
    return False


# ------------------------------------------------------------------------------------------------ running


def test_command(target: Target) -> str:
    return shlex.join([sys.executable, "-m", "pytest", *PYTEST_ARGS, *target.tests])


def end_leftovers(mark: str) -> list[int]:
    """End (by pid, SIGKILL) every process a test command of this run left behind: they carry ``RUN_MARK``."""
    import psutil

    ended = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get(RUN_MARK) == mark:
                proc.kill()
                ended.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return ended


@contextlib.contextmanager
def private_bytecode() -> Iterator[Path]:
    """Bytecode of the mutants goes to a throwaway folder (PYTHONPYCACHEPREFIX), never next to the sources: a
    mutant compiled within the same second as the original is put back, with the same size, would otherwise be
    taken for the original's bytecode by every later run (tests/conftest.py compiles the package on purpose)."""
    folder = Path(tempfile.mkdtemp(prefix="sglworker-mutation-pyc-"))
    old = os.environ.get("PYTHONPYCACHEPREFIX")
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    try:
        yield folder
    finally:
        if old is None:
            os.environ.pop("PYTHONPYCACHEPREFIX", None)
        else:
            os.environ["PYTHONPYCACHEPREFIX"] = old
        shutil.rmtree(folder, ignore_errors=True)


def _forget_bytecode(folder: Path, path: Path) -> None:
    for pyc in (folder / path.resolve().parent.relative_to("/")).glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def _mutated_line(diff: str) -> str:
    return next((line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")),
                "")


def run_target(name: str, target: Target, timeout: float | None, log: Any) -> dict[str, Any]:
    from cosmic_ray.mutating import use_mutation
    from cosmic_ray.testing import run_tests
    from cosmic_ray.work_item import TestOutcome

    path = REPO / target.path
    command = test_command(target)
    found = mutants(path, target.scope)
    mark = uuid.uuid4().hex
    os.environ[RUN_MARK] = mark
    # this checkout's package first, in the test process and every process it starts, whichever checkout the
    # environment's (editable) install names
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    started = time.monotonic()
    with private_bytecode() as pyc:
        t0 = time.monotonic()
        outcome, output = run_tests(command, None)
        baseline = time.monotonic() - t0
        if outcome != TestOutcome.SURVIVED:
            raise SystemExit(f"{name}: the tests fail without a mutant ({command}):\n{output[-3000:]}")
        per_mutant = timeout if timeout is not None else max(20.0, 3 * baseline)
        print(f"{name}: {len(found)} mutants, baseline {baseline:.1f} s, timeout {per_mutant:.0f} s", file=log,
              flush=True)
        killed = timeouts = 0
        survivors: list[dict[str, Any]] = []
        for i, m in enumerate(found, 1):
            with use_mutation(path, m.instance, m.occurrence) as (original, mutated):
                if mutated is None:
                    raise SystemExit(f"{name}: {m.operator} #{m.occurrence} applied nothing")
                _forget_bytecode(pyc, path)
                outcome, output = run_tests(command, per_mutant)
                diff = "\n".join(line for line in __import__("difflib").unified_diff(
                    original.splitlines(), mutated.splitlines(), lineterm="", n=0))
            _forget_bytecode(pyc, path)
            end_leftovers(mark)
            if outcome == TestOutcome.INCOMPETENT:
                raise SystemExit(f"{name}: the test command could not run:\n{output}")
            if outcome == TestOutcome.KILLED:
                killed += 1
                timeouts += output == "timeout"
                verdict = "timeout" if output == "timeout" else "killed"
            else:
                verdict = "SURVIVED"
                survivors.append({"line": m.line, "column": m.column, "operator": m.operator,
                                  "definition": m.definition, "mutated": _mutated_line(diff)})
            print(f"  [{i}/{len(found)}] {verdict:8} {target.path}:{m.line}:{m.column} {m.operator}", file=log,
                  flush=True)
    os.environ.pop(RUN_MARK, None)
    total = len(found)
    return {
        "path": target.path, "promise": target.promise, "scope": list(target.scope) if target.scope else None,
        "tests": list(target.tests), "mutants": total, "killed": killed, "survived": len(survivors),
        "timeouts": timeouts, "score": round(killed / total, 4) if total else 1.0,
        "not_mutated_lines": excluded_lines(path, target.scope),
        "baseline_seconds": round(baseline, 1), "seconds": round(time.monotonic() - started, 1),
        "survivors": survivors,
    }


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(TARGETS), help="a target (repeatable)")
    parser.add_argument("--summary", type=Path, default=SUMMARY, help=f"the summary to write (default {SUMMARY})")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x the baseline, >= 20)")
    parser.add_argument("--list", action="store_true", help="print the targets and their mutant counts, run nothing")
    args = parser.parse_args(argv)
    names = args.module or sorted(TARGETS)
    if args.list:
        for name in names:
            t = TARGETS[name]
            print(f"{name}: {t.path} {','.join(t.scope or ['(all)'])}: {len(mutants(REPO / t.path, t.scope))} "
                  f"mutants\n  {test_command(t)}")
        return 0
    dirty = _git("status", "--porcelain", "--", *{TARGETS[n].path for n in names})
    if dirty:
        raise SystemExit(f"uncommitted changes in the mutated files (a crash would mix them up):\n{dirty}")
    try:
        previous = json.loads(args.summary.read_text())
    except (OSError, ValueError):
        previous = {}
    modules = dict(previous.get("modules", {})) if args.module else {}
    runs = dict(previous.get("runs", {})) if args.module else {}
    commit = _git("rev-parse", "HEAD")
    for name in names:  # the summary is written after each target: a run cut short keeps what it finished
        modules[name] = run_target(name, TARGETS[name], args.timeout, sys.stdout)
        runs[name] = {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "load_average": [round(x, 2) for x in os.getloadavg()]}
        write_summary(args.summary, modules, runs, commit)
    below = [name for name, m in modules.items() if m["score"] < GOAL]
    print(f"\n{'target':16} {'mutants':>8} {'killed':>7} {'survived':>9} {'timeouts':>9} {'score':>6}")
    for name, m in sorted(modules.items()):
        print(f"{name:16} {m['mutants']:8} {m['killed']:7} {m['survived']:9} {m['timeouts']:9} {m['score']:6.1%}")
    print(f"summary: {args.summary}" + (f"; below the {GOAL:.0%} goal: {', '.join(below)}" if below else ""))
    return 1 if below else 0


def write_summary(path: Path, modules: dict[str, Any], runs: dict[str, Any], commit: str) -> None:
    import cosmic_ray

    modules = {name: modules[name] for name in sorted(modules) if name in TARGETS}
    summary = {
        "tool": f"cosmic-ray {getattr(cosmic_ray, '__version__', None) or _version('cosmic-ray')}",
        "goal": GOAL,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.system()},
        "pytest_args": list(PYTEST_ARGS),
        "operators": [name for name, _ in _operators()],
        "runs": {name: runs[name] for name in modules if name in runs},
        "modules": modules,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a killed run still puts the mutated file back
    sys.exit(main())
