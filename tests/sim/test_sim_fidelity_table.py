"""The bookkeeping of the sim's fidelity table, in every run (no engine needed): the committed field list is
sglang 0.5.23's (247 fields in five models), every field has exactly one row in ``fidelity_cases.py``, the
committed result of the last real-engine run (``tests/data/sim/fidelity_results.json``) has a verdict for each,
none unexplained, each known one with its row's reason, and ``docs/SIM_FIDELITY.md`` is what
``fidelity_doc.py`` renders from it."""

from __future__ import annotations

import json
from collections import Counter

from fidelity import BASE, DOC_FILE, FIELDS_FILE, RESULTS_FILE, request_body, request_fields
from fidelity_cases import TABLE, rows
from fidelity_doc import render

#: sglang 0.5.23's request models and their field counts (the issue's census)
COUNTS = {"ChatCompletionRequest": 76, "CompletionRequest": 56, "EmbeddingRequest": 10, "GenerateReqInput": 72,
          "SamplingParams": 33}


def test_the_field_list_is_sglangs_protocol() -> None:
    fields = request_fields()
    assert {m: len(fs) for m, fs in fields.items()} == COUNTS
    assert sum(COUNTS.values()) == 247
    doc = json.loads(FIELDS_FILE.read_text(encoding="utf-8"))
    assert doc["sglang"] == "0.5.23"
    for model, fs in fields.items():
        names = [f["name"] for f in fs]
        assert len(names) == len(set(names)), model
        assert all(set(f) == {"name", "type", "default"} for f in fs), model
    # spot checks against the classes themselves
    chat = {f["name"]: f for f in fields["ChatCompletionRequest"]}
    assert chat["n"]["default"] == 1 and chat["messages"]["default"] == "<required>"
    assert chat["stream_options"]["type"] == "Optional[StreamOptions]"
    assert {f["name"]: f["default"] for f in fields["SamplingParams"]}["max_new_tokens"] == 128


def test_every_field_has_exactly_one_row() -> None:
    fields = request_fields()
    assert set(TABLE) == set(fields)
    for model, model_rows in TABLE.items():
        duplicated = [name for name, n in Counter(r.name for r in model_rows).items() if n > 1]
        assert not duplicated, f"{model}: more than one row for {duplicated}"
        names = {f["name"] for f in fields[model]}
        missing = sorted(names - {r.name for r in model_rows})
        extra = sorted({r.name for r in model_rows} - names)
        assert not missing, f"{model}: fields with no row in fidelity_cases.py: {missing}"
        assert not extra, f"{model}: rows for fields sglang does not have: {extra}"


def test_every_row_sends_its_field() -> None:
    for (model, name), row in rows().items():
        assert row.probes, (model, name)
        for probe in row.probes:
            body = request_body(model, probe, stream=False)
            target = body["sampling_params"] if model == "SamplingParams" else body
            sent = name in target or (name == "stream" and "stream" in body)
            removed = probe.get(name, "absent") is None  # a probe of the field's absence
            assert sent or removed, f"{model}.{name}: probe {probe} does not send the field"
    assert set(BASE) == set(TABLE)


def test_the_committed_result_has_a_verdict_for_every_field() -> None:
    results = json.loads(RESULTS_FILE.read_text(encoding="utf-8"))
    assert results["sglang"] == "0.5.23"
    table = rows()
    verdicts = results["fields"]
    assert set(verdicts) == {f"{m}.{n}" for m, n in table}
    for key, v in verdicts.items():
        model, name = key.split(".", 1)
        assert v["verdict"] in ("same", "known"), (key, v)
        assert v["requests"] >= 1 or not table[(model, name)].sent, key
        if v["verdict"] == "known":
            assert v["reason"] == table[(model, name)].known, f"{key}: the reason changed since the run"


def test_the_doc_is_rendered_from_the_committed_result() -> None:
    results = json.loads(RESULTS_FILE.read_text(encoding="utf-8"))
    fields = json.loads(FIELDS_FILE.read_text(encoding="utf-8"))
    assert DOC_FILE.read_text(encoding="utf-8") == render(results, fields), (
        "docs/SIM_FIDELITY.md is stale: run python tests/sim/fidelity_doc.py")
