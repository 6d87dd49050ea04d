"""``continue_final_message`` on the simulated engine's ``/v1/chat/completions``, as sglang 0.5.23's
``_handle_last_assistant_message`` does it: a last assistant message is continued (it leaves the conversation, the
prompt ends with the generation prompt and its tokens), or, without the flag, becomes a user message; nothing
happens (and no error) when the last message is not the assistant's; a conversation left empty is refused. The
prompt token counts are those the real engine answered for the tiny Llama (``tests/sim/test_sim_differential.py``
compares them live). Real subprocesses, every wait bounded by a deadline, nothing left running."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sim_procs import SimProc, sse, tiny_sim

from pytest_sglworker.sim.routes.openai import final_message

PREFIX = "The answer is"
USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": PREFIX}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProc]:
    pytest.importorskip("tokenizers", reason="the tiny Llama's chat template is tokenized with tokenizers")
    yield from tiny_sim(tmp_path_factory, "chat-tiny")


def _chat(sim: SimProc, messages: list[dict[str, Any]], **extra: Any) -> tuple[int, dict[str, Any]]:
    r = sim.client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 3,
                                                      "temperature": 0, **extra})
    return r.status_code, r.json()


def test_the_last_assistant_message_is_continued_or_becomes_the_users() -> None:
    assert final_message([USER, ASSISTANT], True) == ([USER], PREFIX)
    assert final_message([USER, ASSISTANT], False) == ([USER, {"role": "user", "content": PREFIX}], None)
    assert final_message([USER], True) == ([USER], None)
    listed = {"role": "assistant", "content": [{"type": "text", "text": PREFIX}]}
    assert final_message([USER, listed], True) == ([USER], PREFIX)


def test_prompt_tokens_are_the_real_engines(tiny: SimProc) -> None:
    # the real engine, tiny Llama, ChatML: 10 tokens for [user hi] with the generation prompt, +3 for the prefix
    # continued, 18 when the trailing assistant message is turned into a user turn
    assert _chat(tiny, [USER])[1]["usage"]["prompt_tokens"] == 10
    assert _chat(tiny, [USER], continue_final_message=True)[1]["usage"]["prompt_tokens"] == 10  # no error
    status, body = _chat(tiny, [USER, ASSISTANT], continue_final_message=True)
    assert status == 200 and body["usage"]["prompt_tokens"] == 13
    continued = body["choices"][0]["message"]["content"]
    assert not continued.startswith(PREFIX)  # only the continuation comes back
    assert _chat(tiny, [USER, ASSISTANT])[1]["usage"]["prompt_tokens"] == 18
    listed = {"role": "assistant", "content": [{"type": "text", "text": PREFIX}]}
    assert _chat(tiny, [USER, listed], continue_final_message=True)[1]["usage"]["prompt_tokens"] == 13
    # add_generation_prompt is not a chat field of 0.5.23: ignored
    status, again = _chat(tiny, [USER, ASSISTANT], continue_final_message=True, add_generation_prompt=False)
    assert again["usage"]["prompt_tokens"] == 13 and again["choices"][0]["message"]["content"] == continued
    with tiny.client.stream("POST", "/v1/chat/completions", json={
            "model": "m", "messages": [USER, ASSISTANT], "max_tokens": 3, "continue_final_message": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse(r)
    assert events[-2]["usage"]["prompt_tokens"] == 13
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == continued


def test_a_conversation_left_empty_is_refused(tiny: SimProc) -> None:
    status, body = _chat(tiny, [{"role": "assistant", "content": "Once upon"}], continue_final_message=True)
    assert (status, body) == (400, {"object": "error", "message": "Cannot apply chat template to an empty "
                                    "conversation. Provide at least one message.", "type": "BadRequest",
                                    "param": None, "code": 400})
