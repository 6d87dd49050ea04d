"""Constrained decoding in the simulated engine: ``sampling_params.regex`` / ``json_schema`` on ``/generate``,
``response_format`` and the ``regex`` extra on the OpenAI endpoints. The output must be valid (a full match of
the regex, JSON valid against the schema) and deterministic; a grammar that does not compile gets sglang 0.5.23's
status and envelope. Real subprocesses, every wait bounded by a deadline, nothing left running."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sim_procs import CI_ARGS, Launcher, SimProc, sse, tiny_sim

from pytest_sglworker.sim.constrained import ConstraintError, json_text, regex_text

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 12},
        "age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 21},
        "score": {"type": "number", "minimum": 0.5, "maximum": 0.75},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
        "version": {"const": 3},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "when": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 4},
        "owner": {"$ref": "#/$defs/Owner"},
        "note": {"type": ["null", "string"]},
    },
    "required": ["name", "age"],
    "$defs": {"Owner": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
}


def check_schema_instance(value: Any) -> None:
    """``value`` is valid against :data:`SCHEMA` (checked by hand: no validator in the test dependencies)."""
    assert isinstance(value, dict) and {"name", "age"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) >= 12
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 18 <= value["age"] < 21
    assert isinstance(value["score"], (int, float)) and 0.5 <= value["score"] <= 0.75
    assert isinstance(value["ok"], bool) and value["kind"] in ("cat", "dog") and value["version"] == 3
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", value["code"]) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value["when"])
    assert 2 <= len(value["tags"]) <= 4 and all(isinstance(t, str) and len(t) <= 3 for t in value["tags"])
    assert isinstance(value["owner"], dict) and isinstance(value["owner"]["id"], int)
    assert value["note"] is None or isinstance(value["note"], str)


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    """A sim that counts with its fallback tokenizer (a hub id, no cache)."""
    launcher = Launcher(tmp_path_factory.mktemp("constrained-words"))
    try:
        sim = launcher(*CI_ARGS, "--skip-server-warmup")
        sim.wait_ready()
        yield sim
    finally:
        launcher.cleanup()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    """A sim over the tiny Llama (its own tokenizer when the tokenizers package is installed)."""
    yield from tiny_sim(tmp_path_factory, "constrained-tiny")


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 200, **extra}


# ------------------------------------------------------------------------------------------- in-process


PATTERNS = [r"(yes|no) [a-c]{2}\d", r"[0-9]{3}-[a-z]{2}", r"(\w+)@\1\.com", r"^\d{4}$", r"[^abc]+x?", r"a{3,}b*c+?",
            r"(?i)hello( world)?", r"\s?[A-F0-9]{8}"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_regex_output_fully_matches_it(pattern: str) -> None:
    outputs = {regex_text(pattern, seed) for seed in range(20)}
    assert all(re.fullmatch(pattern, out) for out in outputs)
    assert len(outputs) > 1, outputs  # the seed chooses: not one fixed string per pattern


def test_constrained_outputs_are_the_same_in_another_process() -> None:
    """Deterministic means the same text on every run of the engine, not only twice in one process: another
    interpreter, with another hash seed (which would change anything drawn from ``hash()`` or from a set's order),
    computes the same outputs."""
    import os
    import subprocess
    import sys

    def outputs() -> dict[str, list[str]]:
        return {"regex": [regex_text(p, seed) for p in PATTERNS for seed in range(5)],
                "json": [json_text(json.dumps(SCHEMA), seed) for seed in range(5)]}

    script = ("import json, sys\n"
              "from pytest_sglworker.sim.constrained import json_text, regex_text\n"
              "patterns, schema = json.loads(sys.argv[1]), sys.argv[2]\n"
              "print(json.dumps({'regex': [regex_text(p, s) for p in patterns for s in range(5)],\n"
              "                  'json': [json_text(schema, s) for s in range(5)]}))\n")
    hash_seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    done = subprocess.run([sys.executable, "-c", script, json.dumps(PATTERNS), json.dumps(SCHEMA)],
                          env={**os.environ, "PYTHONHASHSEED": hash_seed}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == outputs()


def test_a_json_output_is_valid_against_its_schema() -> None:
    for seed in range(20):
        check_schema_instance(json.loads(json_text(json.dumps(SCHEMA), seed)))
    assert json.loads(json_text('{"type": "object"}', 1)) == {}


@pytest.mark.parametrize(("schema", "message"), [
    ("{bad", "Failed to compile json grammar: Expecting property name enclosed in double quotes: line 1 column 2 "
             "(char 1)"),
    ('{"type": "integer", "multipleOf": 3}', "Failed to compile json grammar: JSON Schema at # is not supported by "
                                             "xgrammar: keyword(s) multipleOf would be ignored"),
    ('{"properties": {"a": {"type": "string", "format": "email", "pattern": "x"}}}',
     "Failed to compile json grammar: JSON Schema at #/properties/a is not supported by xgrammar: constraints "
     "format, pattern cannot be enforced together"),
])
def test_schemas_the_real_engine_refuses_are_refused_with_its_words(schema: str, message: str) -> None:
    with pytest.raises(ConstraintError) as info:
        json_text(schema, 1)
    assert str(info.value) == message


# ------------------------------------------------------------------------------------------- /generate


def test_generate_with_a_regex(words: SimProc) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 32, "regex": r"(yes|no) [a-c]{2}\d"}}
    out = words.client.post("/generate", json=body).json()
    assert re.fullmatch(r"(yes|no) [a-c]{2}\d", out["text"])
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] == len(out["output_ids"])
    assert words.client.post("/generate", json=body).json()["text"] == out["text"]  # deterministic
    cut = words.client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1,
                                                                           "regex": r"[a-z]{40}"}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 1}  # the grammar does not stretch it
    assert len(cut["text"]) < 40


def test_generate_with_a_json_schema_streamed_and_not(words: SimProc, tiny: SimProc) -> None:
    body = {"text": "a b", "sampling_params": {"max_new_tokens": 400, "json_schema": json.dumps(SCHEMA)}}
    for sim in (words, tiny):
        out = sim.client.post("/generate", json=body).json()
        check_schema_instance(json.loads(out["text"]))
        with sim.client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            events = sse(r)
        assert events[-1] == "[DONE]" and events[-2]["text"] == out["text"]


def test_generate_grammar_errors(words: SimProc) -> None:
    c = words.client
    r = c.post("/generate", json={"text": "hi", "sampling_params": {"regex": "(ab"}})
    assert r.status_code == 400
    assert re.fullmatch(r"Failed to compile regex grammar: \[\d\d:\d\d:\d\d\] /project/cpp/regex_converter\.cc:83: "
                        r"Regex parsing error at position \d+: .+\n", r.json()["error"]["message"])
    r = c.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": "{bad"}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Failed to compile json grammar: Expect")
    r = c.post("/generate", json={"text": "hi", "sampling_params": {"regex": "a", "json_schema": "{}"}})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "Only one of json_schema, regex, ebnf, or "
                                                                    "structural_tag can be set."}})
    # streamed: sglang's one chunk, finished with the abort (the request cut to one token), then [DONE]
    with c.stream("POST", "/generate", json={"text": "hi", "stream": True,
                                            "sampling_params": {"regex": "(ab"}}) as r:
        assert r.status_code == 200
        events = sse(r)
    assert len(events) == 2 and events[1] == "[DONE]"
    finish = events[0]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 400 and finish["err_type"] == "BadRequestError"
    assert finish["message"].startswith("Failed to compile regex grammar: ")
    assert (events[0]["meta_info"]["prompt_tokens"], events[0]["meta_info"]["completion_tokens"]) == (1, 1)


# ------------------------------------------------------------------------------------------- OpenAI


def test_chat_response_formats_and_the_regex_extra(words: SimProc, tiny: SimProc) -> None:
    for sim in (words, tiny):
        c = sim.client
        content = c.post("/v1/chat/completions", json=_chat(response_format={"type": "json_object"})).json()
        assert isinstance(json.loads(content["choices"][0]["message"]["content"]), dict)
        schema_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        content = c.post("/v1/chat/completions", json=_chat(response_format=schema_format)).json()
        check_schema_instance(json.loads(content["choices"][0]["message"]["content"]))
        assert content["choices"][0]["finish_reason"] == "stop"
        content = c.post("/v1/chat/completions", json=_chat(regex=r"[0-9]{3}-[a-z]{2}")).json()
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", content["choices"][0]["message"]["content"])
        with c.stream("POST", "/v1/chat/completions", json=_chat(regex=r"[0-9]{3}-[a-z]{2}", stream=True)) as r:
            deltas = [e["choices"][0]["delta"].get("content") or "" for e in sse(r)[:-1] if e["choices"]]
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", "".join(deltas))
        text = c.post("/v1/chat/completions", json=_chat(response_format={"type": "text"}, max_tokens=3)).json()
        assert text["choices"][0]["finish_reason"] == "length"  # text: no grammar


def test_completions_json_schema_and_response_format(words: SimProc) -> None:
    c = words.client
    body = {"model": "m", "prompt": "hi", "max_tokens": 400}
    out = c.post("/v1/completions", json={**body, "json_schema": json.dumps(SCHEMA)}).json()
    check_schema_instance(json.loads(out["choices"][0]["text"]))
    out = c.post("/v1/completions", json={**body, "response_format": {"type": "json_object"}}).json()
    assert json.loads(out["choices"][0]["text"]) == {}
    out = c.post("/v1/completions", json={**body, "regex": "[0-9]{3}"}).json()
    assert re.fullmatch("[0-9]{3}", out["choices"][0]["text"])


def test_openai_grammar_errors(words: SimProc) -> None:
    c = words.client

    def error(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        r = c.post(path, json=body)
        return r.status_code, r.json()

    status, body = error("/v1/chat/completions", _chat(regex="(ab"))
    assert (status, body["type"], body["code"]) == (400, "BadRequestError", 400)
    assert body["message"].startswith("Failed to compile regex grammar: ")
    status, body = error("/v1/chat/completions", _chat(regex="a", response_format={"type": "json_object"}))
    assert (status, body["type"], body["message"]) == (
        400, "BadRequestError", "Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    status, body = error("/v1/chat/completions", _chat(response_format={"type": "json_schema",
                                                                         "json_schema": {"name": "x"}}))
    assert (status, body["type"], body["message"]) == (
        400, "BadRequestError", "schema_ is required for json_schema response format request.")
    status, body = error("/v1/completions", {"model": "m", "prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}})
    assert (status, body["type"]) == (400, "BadRequest")  # raised while the request is converted
    status, body = error("/v1/chat/completions", _chat(response_format={"type": "xml"}))
    assert (status, body["type"]) == (400, "Bad Request") and "literal_error" in body["message"]
    status, body = error("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}))
    assert (status, body["type"]) == (400, "Bad Request") and "'name'" in body["message"]
    # streamed: the one error chunk of sglang's OpenAI adapters, then [DONE]
    with c.stream("POST", "/v1/chat/completions", json=_chat(regex="(ab", stream=True)) as r:
        assert r.status_code == 200
        events = sse(r)
    assert events[1:] == ["[DONE]"] and events[0]["error"]["type"] == "BAD_REQUEST"
    assert events[0]["error"]["code"] == 400 and events[0]["error"]["message"].startswith("Failed to compile")


def test_the_sim_keeps_serving_after_grammar_errors(words: SimProc) -> None:
    for _ in range(3):
        words.client.post("/generate", json={"text": "x", "sampling_params": {"regex": "("}})
    assert words.client.get("/health").status_code == 200
    assert httpx.get(words.url + "/v1/loads", trust_env=False).json()["loads"][0]["num_running_reqs"] == 0
