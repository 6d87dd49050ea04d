"""The simulated engine's Anthropic-compatible ``/v1/messages`` and ``/v1/messages/count_tokens``, as sglang 0.5.23
serves them (upstream's ``test_anthropic_server.py`` runs against both engines in
``tests/acceptance/test_compat_openai_families.py``; ``tests/sim/test_sim_differential.py`` compares the shapes,
statuses, messages and token counts with the real engine's live): a message with one text block, its stop reason
and usage; streamed, ``event:``/``data:`` frames from ``message_start`` to ``message_stop`` without ``[DONE]``;
Anthropic's error envelope for what sglang's pydantic model, its FastAPI route and its chat checks refuse; the chat
prompt's token count. The token counts are those the real engine answered for the tiny Llama (ChatML). Real
subprocesses, every wait bounded by a deadline, nothing left running."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sim_procs import SimProc, tiny_sim

USER = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    pytest.importorskip("tokenizers", reason="the tiny Llama's chat template is tokenized with tokenizers")
    yield from tiny_sim(tmp_path_factory, "anthropic-tiny")


def _message(**extra: Any) -> dict[str, Any]:
    return {"model": "claude-ish", "max_tokens": 4, "messages": [USER], **extra}


def _frames(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The ``(event, data)`` of each server-sent event, checking that each names its data's type."""
    frames = []
    for block in text.split("\n\n"):
        if not block:
            continue
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == event[len("event: "):], block
        frames.append((event[len("event: "):], payload))
    return frames


def test_a_message_is_one_text_block_with_its_stop_reason_and_usage(tiny: SimProc) -> None:
    r = tiny.client.post("/v1/messages", json=_message())
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    body = r.json()
    assert list(body) == ["id", "type", "role", "content", "model", "stop_reason", "usage"], body
    assert body["id"].startswith("msg_") and (body["type"], body["role"], body["model"]) == (
        "message", "assistant", "claude-ish")
    assert [block["type"] for block in body["content"]] == ["text"] and body["content"][0]["text"]
    assert body["stop_reason"] == "max_tokens" and body["usage"] == {"input_tokens": 16, "output_tokens": 4}
    # a system prompt (a string, or text blocks joined by a newline) is the chat's system message
    blocks = tiny.client.post("/v1/messages", json=_message(system=[{"type": "text", "text": "Be brief."},
                                                                    {"type": "text", "text": "Be kind."}])).json()
    assert blocks["usage"]["input_tokens"] == tiny.client.post("/v1/messages", json=_message(
        system="Be brief.\nBe kind.")).json()["usage"]["input_tokens"] > 16
    # the chat's stop: a stop sequence ends the turn (end_turn, no stop_sequence)
    stopped = tiny.client.post("/v1/messages", json=_message(max_tokens=64, stop_sequences=[" "],
                                                             temperature=0)).json()
    assert stopped["stop_reason"] == "end_turn" and "stop_sequence" not in stopped, stopped


def test_a_streamed_message_is_sglangs_event_sequence(tiny: SimProc) -> None:
    with tiny.client.stream("POST", "/v1/messages", json=_message(stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert "[DONE]" not in text
    frames = _frames(text)
    kinds = [kind for kind, _ in frames]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * (len(kinds) - 5),
                     "content_block_stop", "message_delta", "message_stop"], kinds
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["usage"] == {"input_tokens": 16, "output_tokens": 0}
    assert "stop_reason" not in start and start["model"] == "claude-ish"
    assert frames[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for kind, data in frames if kind == "content_block_delta"]
    assert deltas and all(d["type"] == "text_delta" and d["text"] for d in deltas)
    assert frames[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                             "usage": {"output_tokens": 4}}


@pytest.mark.parametrize(("body", "headers", "message"), [
    (json.dumps(_message(max_tokens=-1)), {"content-type": "application/json"},
     "max_tokens: Value error, max_tokens must be positive"),
    (json.dumps({"messages": [USER]}), {"content-type": "application/json"},
     "model: Field required; max_tokens: Field required"),
    (json.dumps(_message(messages=[])), {"content-type": "application/json"}, "Messages cannot be empty."),
    ("{not json", {"content-type": "application/json"}, "1: JSON decode error"),
    ("not json", {}, "header.content-type: Unsupported Media Type: Only 'application/json' is allowed"),
    (json.dumps(_message()), {"content-type": "text/plain"},
     "header.content-type: Unsupported Media Type: Only 'application/json' is allowed"),
], ids=["max-tokens", "missing", "empty", "bad-json", "no-content-type", "content-type"])
def test_what_sglang_refuses_has_anthropics_error_envelope(tiny: SimProc, body: str, headers: dict[str, str],
                                                          message: str) -> None:
    r = tiny.client.post("/v1/messages", content=body.encode(), headers=headers)
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def test_count_tokens_counts_the_chat_prompt(tiny: SimProc) -> None:
    def count(**extra: Any) -> Any:
        r = tiny.client.post("/v1/messages/count_tokens", json={"model": "m", "messages": [USER], **extra})
        assert r.status_code == 200, r.text
        return r.json()

    assert count() == {"input_tokens": 16}
    assert count(system="You are a helpful assistant.")["input_tokens"] > 16
