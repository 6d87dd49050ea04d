"""The memory ledger against the real sglang's own numbers, in the default run: ``tests/data/sglang_memory.json``
holds what sglang 0.5.23 computes for each serving mode (``null``, ``prefill``, ``decode``) and a few flag sets on
three card sizes (its resolved sizes, graph and DeepEP reserves and automatic ``--mem-fraction-static``), recorded
by ``tests/engine_scripts/record_sglang_memory.py`` in the real engine's Python. The simulated engine and the
ledger share their formulas, so their agreement cannot show a wrong one; these numbers are sglang's.

The ``real_engine`` tier records them again and checks the committed file is what sglang computes today."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.engine import sglang_facts as facts
from pytest_sglworker.engine.cpu_engine import real_engine_missing_reason, real_engine_python
from pytest_sglworker.engine.ledger import predict_memory

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "data" / "sglang_memory.json"
RECORDER = REPO / "tests" / "engine_scripts" / "record_sglang_memory.py"
DATA = json.loads(RECORDED.read_text(encoding="utf-8"))


def _id(case: dict[str, Any]) -> str:
    flags = " ".join(a for a in case["argv"] if a not in ("--disaggregation-mode", case["mode"])) or "defaults"
    return f"{case['gpu_total_mib']}MiB-{case['mode']}-{flags}"


def test_the_recording_covers_every_mode_and_flag_set() -> None:
    assert DATA["sglang"] == "0.5.23" and DATA["model"] in facts.MODEL_DIMS
    assert {c["mode"] for c in DATA["cases"]} == {"null", "prefill", "decode"}
    assert len(DATA["cases"]) == 54
    # the modes really differ: a formula that ignored the mode could not match them all
    by_mode = {m: [c["graph_reserve_mib"] for c in DATA["cases"] if c["mode"] == m]
               for m in ("null", "prefill", "decode")}
    assert len({tuple(v) for v in by_mode.values()}) == 3


@pytest.mark.parametrize("case", DATA["cases"], ids=_id)
def test_the_ledger_gives_sglangs_numbers(case: dict[str, Any]) -> None:
    ledger = predict_memory(facts.MODEL_DIMS[DATA["model"]], case["gpu_total_mib"], argv=case["argv"])
    ours = {
        "mode": ledger.mode,
        "chunked_prefill_size": ledger.chunked_prefill_size,
        "decode_max_bs": ledger.decode_max_bs,
        "prefill_buckets": ledger.prefill_buckets,
        "graph_reserve_mib": ledger.decode_graph_reserve_mib + ledger.prefill_graph_reserve_mib,
        "deepep_reserve_mib": ledger.deepep_reserve_mib,
        "mem_fraction_static": ledger.mem_fraction_static,
    }
    theirs = {key: case[key] for key in ours}
    assert ours == theirs


@pytest.mark.real_engine
def test_the_recording_is_what_the_real_sglang_computes_now() -> None:
    reason = real_engine_missing_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    env.pop("PYTHONPATH", None)  # sglang's numbers only: the recorder imports nothing of the plugin
    done = subprocess.run([str(real_engine_python()), str(RECORDER)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == DATA, f"sglang's numbers changed: re-record with {RECORDER.name}"
