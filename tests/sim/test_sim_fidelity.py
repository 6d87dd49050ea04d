"""Every request field of sglang 0.5.23's protocol, sent to the real engine and to the sim (``fidelity.py`` says
how, ``fidelity_cases.py`` with what), each ending "same" or as the named known difference of its row; none may
end unexplained.

One real engine and one sim for a generation model and an embedding one, shared with the corpus of
``test_sim_differential.py`` (``conftest.py``'s session fixture ``servers``). With
``SGLWORKER_SIM_FIDELITY_WRITE=1`` the run rewrites ``tests/data/sim/fidelity_results.json`` (the commit, the
engine version, each field's verdict); render ``docs/SIM_FIDELITY.md`` from it with
``python tests/sim/fidelity_doc.py`` (``test_sim_fidelity_table.py`` checks the two agree).

Run: ``pytest tests/sim/test_sim_fidelity.py -m 'real_engine and slow' -n 0`` (skipped without the real engine).
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from fidelity import REPO, RESULTS_FILE, request_fields, run_row, verdict
from fidelity_cases import TABLE
from real_pair import Pair

from pytest_sglworker.engine.cpu_engine import REAL_ENGINE_MARKER, real_engine_python

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.xdist_group("real-engine")]

WRITE_ENV = "SGLWORKER_SIM_FIDELITY_WRITE"


def _commit() -> str:
    """HEAD, with ``+dirty`` when the sim or these tests have changes not committed."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "pytest_sglworker/sim", "tests/sim")
    return git("rev-parse", "--short=12", "HEAD") + ("+dirty" if dirty else "")


def _engine_version() -> str:
    python = real_engine_python()
    marker = python.parent.parent / REAL_ENGINE_MARKER if python is not None else None
    if marker is not None and marker.is_file():
        for line in marker.read_text(encoding="utf-8").splitlines():
            if line.startswith("sglang="):
                return line.split("=", 1)[1]
    return json.loads((REPO / "tests" / "data" / "sim" / "request_fields.json").read_text())["sglang"]


def test_every_request_field_answers_as_the_real_engine(servers: dict[str, Pair]) -> None:
    urls = {kind: (pair.real.url, pair.sim.url) for kind, pair in servers.items()}
    fields = request_fields()
    results: dict[str, Any] = {}
    for model, rows in TABLE.items():
        for row in rows:
            results[f"{model}.{row.name}"] = verdict(row, run_row(urls, model, row))
    missing = [f"{m}.{f['name']}" for m, fs in fields.items() for f in fs if f"{m}.{f['name']}" not in results]
    assert not missing, f"fields without a row in fidelity_cases.py: {missing}"
    if os.environ.get(WRITE_ENV) == "1":
        doc = {"commit": _commit(), "sglang": _engine_version(), "fields": results}
        RESULTS_FILE.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    unexplained = {k: v["differences"] for k, v in results.items() if v["verdict"] == "unexplained"}
    assert not unexplained, "fields the sim answers differently, with no known reason:\n" + "\n".join(
        f"{k}:\n  " + "\n  ".join(v) for k, v in unexplained.items())
