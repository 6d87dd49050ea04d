"""What sglang's own OpenAI-server unittest files (``tests/acceptance/test_compat_openai_families.py``) showed the
simulated engine did differently from the real sglang 0.5.23, pinned here against the real engine's answers as
they were recorded on the CPU with the tiny model (``--enable-return-hidden-states --grammar-backend xgrammar``):

- ``return_hidden_states`` on ``/v1/chat/completions`` and ``/v1/completions``: a ``hidden_states`` list of
  ``hidden_size`` floats per choice (``[]`` for a one-token answer); streamed, one chunk per choice after every
  choice's end (chat: a delta of ``role``/``content``/``reasoning_content`` null and ``hidden_states``;
  completions: ``text`` "" and ``hidden_states``), before the usage chunk; on ``/generate``, ``meta_info``'s
  ``hidden_states``: the prefill's rows (the prompt tokens after the cached prefix), then a row per later output
  token, so far in every streamed chunk; ``"last"`` (a server mode, not a request value) the decoder's 400;
- ``ebnf``: a reference to a rule the grammar does not define is xgrammar's ``Failed to compile ebnf grammar``
  (400); else the output is a string the grammar allows (real: ``Hi`` for ``root ::= "Hello" | "Hi" | "Hey"``, then
  EOS: finish ``stop``, ``matched_stop`` 2; with ``ignore_eos``, finish ``length`` at ``max_tokens``);
- chat ``max_tokens`` over ``--context-length``: ``max_completion_tokens is too large: N.This model supports at
  most C completion tokens.`` (sglang's ``_validate_request``, only when the flag is given; without it the length
  check's ``Requested token count exceeds ...``);
- ``--context-length`` above the model's own (512): refused at startup (exit 1) unless
  ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is true.

Real subprocesses, every wait bounded by a deadline, nothing left running.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sim_procs import CI_ARGS, TINY, Launcher, SimProc, sse

from pytest_sglworker.sim.constrained import ebnf_text

HIDDEN_SIZE = 64  # the tiny Llama's
GREETING = '\n        root ::= "Hello" | "Hi" | "Hey"\n        '
STRICT_JSON = r'''
        root    ::= "{" pair "}"
        pair    ::= "\"name\"" ":" string
        string  ::= "\"" [A-Za-z]+ "\""
        '''


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path_factory.mktemp("openai-families"))
    try:
        yield launcher
    finally:
        launcher.cleanup()


@pytest.fixture(scope="module")
def hidden(launcher: Launcher) -> SimProc:
    """A tiny-Llama sim started as upstream's hidden-states test starts its server, with --context-length."""
    sim = launcher(*CI_ARGS, "--skip-server-warmup", "--enable-return-hidden-states", "--context-length", "100",
                   model=TINY)
    sim.wait_ready()
    return sim


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}], **extra}


def _is_hidden_state(value: Any) -> bool:
    return isinstance(value, list) and len(value) == HIDDEN_SIZE and all(isinstance(x, float) for x in value)


def test_hidden_states_in_answers(hidden: SimProc) -> None:
    c = hidden.client
    answer = c.post("/v1/chat/completions", json=_chat(max_tokens=3, n=2, return_hidden_states=True)).json()
    assert [_is_hidden_state(choice.get("hidden_states")) for choice in answer["choices"]] == [True, True], answer
    one = c.post("/v1/chat/completions", json=_chat(max_tokens=1, return_hidden_states=True)).json()
    assert one["choices"][0]["hidden_states"] == []
    plain = c.post("/v1/chat/completions", json=_chat(max_tokens=3)).json()
    assert "hidden_states" not in plain["choices"][0]
    completion = c.post("/v1/completions", json={"model": "m", "prompt": ["hi there", "hello"], "max_tokens": 3,
                                                 "return_hidden_states": True}).json()
    assert [_is_hidden_state(choice.get("hidden_states")) for choice in completion["choices"]] == [True, True]


def test_hidden_states_streamed_after_every_choice_ends(hidden: SimProc) -> None:
    body = _chat(max_tokens=3, n=2, return_hidden_states=True, stream=True, stream_options={"include_usage": True})
    with hidden.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    tail = [event["choices"][0] for event in events[-4:-2]]
    assert [(c["index"], c["finish_reason"], sorted(c["delta"])) for c in tail] == [
        (i, None, ["content", "hidden_states", "reasoning_content", "role"]) for i in (0, 1)], tail
    assert all(_is_hidden_state(c["delta"]["hidden_states"]) and c["delta"]["role"] is None for c in tail)
    ends = [event["choices"][0]["index"] for event in events[:-4] if event["choices"][0]["finish_reason"]]
    assert ends == [0, 1]  # both choices ended before the first hidden-states chunk
    assert not any("hidden_states" in event["choices"][0]["delta"] for event in events[:-4])

    body = {"model": "m", "prompt": ["hi there", "hello"], "max_tokens": 3, "return_hidden_states": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with hidden.client.stream("POST", "/v1/completions", json=body) as r:
        events = sse(r)
    tail = [event["choices"][0] for event in events[-4:-2]]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in tail] == [(0, "", None), (1, "", None)]
    assert all(_is_hidden_state(c["hidden_states"]) for c in tail)
    assert not any("hidden_states" in event["choices"][0] for event in events[:-4])


def test_chat_max_tokens_over_the_context_length_flag(hidden: SimProc, tiny: SimProc) -> None:
    refused = hidden.client.post("/v1/chat/completions", json=_chat(max_tokens=200))
    assert refused.status_code == 400
    assert refused.json()["message"] == ("max_completion_tokens is too large: 200.This model supports at most 100 "
                                         "completion tokens.")
    # without --context-length, sglang skips that check: the length check answers (as recorded from the real one)
    refused = tiny.client.post("/v1/chat/completions", json=_chat(max_tokens=600))
    assert refused.status_code == 400
    assert refused.json()["message"].startswith("Requested token count exceeds the model's maximum context length "
                                                "of 512 tokens. You requested a total of 616 tokens")


@pytest.fixture(scope="module")
def tiny(launcher: Launcher) -> SimProc:
    sim = launcher(*CI_ARGS, "--skip-server-warmup", model=TINY)
    sim.wait_ready()
    return sim


def test_ebnf_output_is_a_string_the_grammar_allows(tiny: SimProc) -> None:
    for seed in range(20):
        assert ebnf_text(GREETING, seed) in ("Hello", "Hi", "Hey")
        assert re.fullmatch(r'\{"name":"[A-Za-z]+"\}', ebnf_text(STRICT_JSON, seed) or "")
    assert re.fullmatch(r"x|[0-9]{2,3}y?", ebnf_text('root ::= "x" # a comment\n  | [0-9]{2,3} "y"?', 1) or "")
    # not simulated (the usual echo): a recursive grammar
    assert ebnf_text('root ::= item+\nitem ::= "a" | "b" root', 1) is None
    # a rule it does not define: xgrammar's compile error, a 400 (as recorded from the real engine)
    refused = tiny.client.post("/v1/chat/completions", json=_chat(max_tokens=32, ebnf="root ::= undefined_rule"))
    assert refused.status_code == 400 and refused.json()["type"] == "BadRequestError"
    assert re.fullmatch(r'Failed to compile ebnf grammar: \[\d\d:\d\d:\d\d\] /project/cpp/grammar_parser\.cc:820: EBNF '
                        r'parser error at line 1, column 10: Rule "undefined_rule" is not defined\n',
                        refused.json()["message"]), refused.json()
    answer = tiny.client.post("/v1/chat/completions", json=_chat(max_tokens=32, ebnf=GREETING)).json()
    choice = answer["choices"][0]
    assert (choice["message"]["content"] in ("Hello", "Hi", "Hey"), choice["finish_reason"],
            choice["matched_stop"]) == (True, "stop", 2), choice
    # ignore_eos: the EOS the finished grammar allows does not end it (the real engine's: finish length, as the
    # fidelity table's ebnf probe shows)
    answer = tiny.client.post("/v1/chat/completions", json=_chat(max_tokens=8, ebnf=GREETING, ignore_eos=True)).json()
    choice = answer["choices"][0]
    assert (choice["message"]["content"] in ("Hello", "Hi", "Hey"), choice["finish_reason"], choice["matched_stop"],
            answer["usage"]["completion_tokens"]) == (True, "length", None, 8), answer


def test_a_longer_context_length_than_the_models_is_refused_at_startup(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    try:
        refused = launcher(*CI_ARGS, "--skip-server-warmup", "--context-length", "1000", model=TINY)
        assert refused.wait_exit() == 1
        assert ("ValueError: Warning: User-specified context_length (1000) is greater than the derived "
                "context_length (512).") in refused.stderr()
        assert "set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in refused.stderr()
        allowed = launcher(*CI_ARGS, "--skip-server-warmup", "--context-length", "1000", model=TINY,
                           env={"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"})
        allowed.wait_ready()
        assert allowed.client.get("/v1/models").json()["data"][0]["max_model_len"] == 1000
    finally:
        launcher.cleanup()


def _rows(value: Any) -> list[int]:
    """``/generate``'s ``hidden_states``: the prefill's row count, then 1 for each single row after it."""
    assert isinstance(value, list) and value, value
    prefill, *decode = value
    assert all(_is_hidden_state(r) for r in prefill) and all(_is_hidden_state(r) for r in decode), value
    return [len(prefill), *(1 for _ in decode)]


def test_hidden_states_of_generate(hidden: SimProc) -> None:
    """As the real engine answered (``--enable-return-hidden-states``, the tiny model, recorded on the CPU): the
    prefill's rows (the prompt tokens after the cached prefix), then a row per output token after the first;
    streamed, every chunk carries the list so far; a batch, each prompt its own; a mode's name is the decoder's
    400."""
    c = hidden.client

    def generate(**extra: Any) -> Any:
        body = {"text": "zebra crossing ahead", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}
        return c.post("/generate", json=body)

    first = generate(return_hidden_states=True).json()["meta_info"]
    prompt = first["prompt_tokens"]
    assert first["cached_tokens"] == 0 and _rows(first["hidden_states"]) == [prompt, 1, 1, 1], first
    again = generate(return_hidden_states=True).json()["meta_info"]  # the prompt's prefix is cached now
    assert _rows(again["hidden_states"]) == [prompt - again["cached_tokens"], 1, 1, 1] and again["cached_tokens"] > 0
    assert "hidden_states" not in generate().json()["meta_info"]
    with c.stream("POST", "/generate", json={"text": "hello there", "stream": True, "return_hidden_states": True,
                                             "sampling_params": {"max_new_tokens": 3, "temperature": 0}}) as r:
        chunks = [e["meta_info"] for e in sse(r) if isinstance(e, dict)]
    assert [len(m["hidden_states"]) for m in chunks] == [m["completion_tokens"] for m in chunks] == [1, 2, 3]
    batch = c.post("/generate", json={"text": ["hi", "hello there"], "return_hidden_states": [True, False],
                                      "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert len(batch[0]["meta_info"]["hidden_states"]) == 2 and "hidden_states" not in batch[1]["meta_info"]
    refused = generate(return_hidden_states="last")
    assert (refused.status_code, refused.json()) == (400, {
        "error": 'invalid type: string "last", expected a value or an array of values for BoolOrList'})
