"""``sglang_facts`` pinned to the real sglang (the ``real_engine`` tier): the committed flag table, the
abbreviations, the capture sizes, the graph and DeepEP reserves and the automatic ``--mem-fraction-static``
are compared with sglang's own code, run in the real engine's Python. A new sglang that changes any of them
fails here (regenerate the table with ``scripts/dump-sglang-flags``, then fix the formulas)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python

pytestmark = [pytest.mark.real_engine]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def findings() -> dict[str, Any]:
    reason = real_engine_missing_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SGLANG_USE_CPU_ENGINE": "1"}
    done = subprocess.run([str(real_engine_python()), str(REPO / "tests" / "engine_scripts" / "pin_sglang_facts.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    line = next((x for x in done.stdout.splitlines() if x.startswith("@@FINDINGS@@ ")), None)
    assert line is not None, f"the pin script failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(line.split(" ", 1)[1])  # type: ignore[no-any-return]


def test_flag_table_is_the_real_parser(findings: dict[str, Any]) -> None:
    assert findings["sglang"] == "0.5.23"
    assert findings["flags_equal"], "the committed flag table is not sglang's parser: run scripts/dump-sglang-flags"
    assert findings["abbreviations_mismatched"] == []


def test_capture_sizes_are_sglangs(findings: dict[str, Any]) -> None:
    assert findings["prefill_sizes_equal"] and findings["decode_sizes_equal"]


def test_reserves_are_sglangs(findings: dict[str, Any]) -> None:
    assert findings["reserve_cases"] == 288 and findings["reserve_mismatches"] == []


def test_automatic_fraction_is_sglangs(findings: dict[str, Any]) -> None:
    # every card size, serving mode, graph backend, tp, DeepEP and DP-attention combination
    assert findings["fraction_cases"] == 2304 and findings["fraction_mismatches"] == []
