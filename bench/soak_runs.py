#!/usr/bin/env python
"""Part ``soak`` of ``bench/run.py``: bench/soak.py and bench/soak.py --hostile at their defaults (``--quick``: 40
launches each), their summary lines. What each figure means: bench/README.md, "7. Soak". (Not in bench/soak.py,
which is the soak itself: this runs it.)

    .venv/bin/python bench/soak_runs.py             # this part alone: bench/run.py --only soak
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import BENCH, REPO, Plan, clean_env, progress

NAME = "soak"
#: What its figures measure (bench/render.py says in each region which of these changed since the figures' commit)
MEASURES = {NAME: ("pytest_sglworker/workers/launcher.py", "pytest_sglworker/workers/process.py",
                   "pytest_sglworker/resources/processes.py", "pytest_sglworker/resources/pidrefs.py",
                   "pytest_sglworker/resources/ports.py", "pytest_sglworker/resources/reaper.py",
                   "pytest_sglworker/resources/gpus")}


def measure(plan: Plan, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    settings = ["--launches", str(plan.soak_launches), "-n", "2", "--gpus", "2"]  # soak.py's defaults but --quick
    for name, extra in (("plain", settings), ("hostile", ["--hostile", *settings])):
        progress(f"soak: bench/soak.py {' '.join(extra)}")
        out = workdir / f"soak-{name}.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(BENCH / "soak.py"), *extra, "--json", str(out)], cwd=REPO,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = proc.stdout.splitlines()
        result[name] = {"rc": proc.returncode, "seconds": time.perf_counter() - t0, "args": extra,
                        "figures": json.loads(out.read_text()) if out.exists() else None,
                        "summary": [line for line in lines if not line.startswith("  ..")][-16:]}
    return result


def soak_lines(sk: dict[str, Any]) -> list[str]:
    lines = []
    for name in ("plain", "hostile"):
        s = sk.get(name)
        if not s or not s["figures"]:
            continue
        f = s["figures"]
        fds = sum(v["fd_growth"] for v in f["fd_growth"].values())
        leases = len(f["leaked_lease_records"]) + len(f["held_locks"])
        text = (f"`bench/soak.py {' '.join(s['args'])}`: {f['launch_attempts']} launches and teardowns in "
                f"{f['wall_seconds']:.0f} s ({f['launches']} healthy, {f['failed_launches']} failed to start on "
                f"purpose); leaked {len(f['leaked_processes'])} processes, {fds} file descriptors, "
                f"{len(f['leaked_ports'])} ports, {leases} leases, {len(f['leftover_logs'])} logs")
        if name == "hostile":
            text += (f"; {f['failures_reported_correctly']} of {f['expected_failures']} failures reported correctly, "
                     f"a startup failure at most {f['longest_past_deadline_s']:.2f} s past its deadline, a stopped "
                     f"worker's teardown at most {f['longest_stopped_teardown_s']:.2f} s, "
                     f"{len(f['listened_after_teardown'])} ports listened on after their teardown")
        lines.append(text + f" (exit {s['rc']}).")
    return lines


# ---------------------------------------------------------------------------------------------- figures


def speed_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Its rows of the README's ``## Speed`` table: none (its lines come after the table)."""
    return []


def speed_notes(results: dict[str, Any]) -> list[str]:
    """Its lines under the README's ``## Speed`` table: a line per soak."""
    sk = results.get(NAME)
    return ["", *soak_lines(sk)] if sk else []


def details(results: dict[str, Any]) -> list[str]:
    """Its block of bench/README.md's ``## Latest figures``."""
    sk = results.get(NAME)
    return ["**7. Soak**:", "", *[f"- {line}" for line in soak_lines(sk)], ""] if sk else []


def failures(results: dict[str, Any]) -> list[str]:
    """What of its run failed (bench/run.py's exit status is 1 when anything did)."""
    return [f"soak {k}" for k, v in results.get(NAME, {}).items() if isinstance(v, dict) and v.get("rc")]


if __name__ == "__main__":  # this part alone, as bench/run.py --only soak runs it
    import run

    sys.exit(run.main(sys.argv[1:], only="soak"))
