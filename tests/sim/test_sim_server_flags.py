"""Server flags and routes of sglang 0.5.23 that a client observes, on the simulated engine as the real engine
answered them (the real answers, recorded on the CPU engine with the tiny Llama by
``tests/engine_scripts/record_server_flags.py``, are ``tests/data/sim/server_flags_real.json``; the messages, the
abort's finish reason and the session prompts pinned below are theirs): ``--incremental-streaming-output``
streams each chunk's own text and ids; ``--skip-tokenizer-init`` answers no text and refuses a text prompt with
the tokenizer manager's 400; ``--disable-radix-cache`` reports no cached tokens (and takes ``input_embeds``); a
caller's ``rid`` is the answer's id, a batch that repeats one is refused; ``/abort_request`` (by rid,
``abort_all``) ends a running request with ``finish_reason {"type": "abort"}``; the session routes keep a
conversation's tokens; ``--attention-backend triton --device cpu`` dies at the first forward pass; sampling knobs
act on the output in the real engine's direction. Real subprocesses over the tiny Llama's config and tokenizer;
nothing left running."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sim_procs import CI_ARGS, TINY, Launcher, SimProc, sse, wait_for


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    pytest.importorskip("tokenizers", reason="the tiny Llama's prompts are tokenized with tokenizers")
    launcher = Launcher(tmp_path_factory.mktemp("server-flags"))
    try:
        yield launcher
    finally:
        launcher.cleanup()


def _sim(launcher: Launcher, *flags: str, env: dict[str, str] | None = None) -> SimProc:
    sim = launcher(*CI_ARGS, "--skip-server-warmup", "--max-total-tokens", "1024", *flags, model=TINY, env=env)
    sim.wait_ready()
    return sim


@pytest.fixture(scope="module")
def plain(launcher: Launcher) -> SimProc:
    return _sim(launcher)


@pytest.fixture(scope="module")
def incremental(launcher: Launcher) -> SimProc:
    return _sim(launcher, "--incremental-streaming-output", "--disable-radix-cache")


@pytest.fixture(scope="module")
def no_tokenizer(launcher: Launcher) -> SimProc:
    return _sim(launcher, "--skip-tokenizer-init")


def _generate(sim: SimProc, **body: Any) -> tuple[int, Any]:
    body.setdefault("sampling_params", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    r = sim.client.post("/generate", json=body)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.status_code, [e for e in sse(r) if e != "[DONE]"]
    return r.status_code, r.json()


def test_incremental_streaming_sends_each_chunks_own_text_and_ids(plain: SimProc, incremental: SimProc) -> None:
    _, cumulative = _generate(plain, text="hello world", stream=True, return_logprob=True)
    _, chunks = _generate(incremental, text="hello world", stream=True, return_logprob=True)
    assert len(chunks) == len(cumulative) == 4
    assert [len(c["output_ids"]) for c in cumulative] == [1, 2, 3, 4]  # without the flag: all so far
    assert [len(c["output_ids"]) for c in chunks] == [1, 1, 1, 1]
    assert [i for c in chunks for i in c["output_ids"]] == cumulative[-1]["output_ids"]
    assert "".join(c["text"] for c in chunks) == cumulative[-1]["text"]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [1, 1, 1, 1]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 4  # the counts stay cumulative
    _, whole = _generate(incremental, text="hello world")  # not streamed: the whole answer
    assert whole["output_ids"] == cumulative[-1]["output_ids"]


def test_without_the_radix_cache_nothing_is_cached(plain: SimProc, incremental: SimProc) -> None:
    prompt = "the same prompt for the cache test"
    on = [_generate(plain, text=prompt)[1]["meta_info"]["cached_tokens"] for _ in range(2)]
    off = [_generate(incremental, text=prompt)[1]["meta_info"]["cached_tokens"] for _ in range(2)]
    assert on[0] == 0 and on[1] > 0
    assert off == [0, 0]  # real engine, --disable-radix-cache: [0, 0]


def test_input_embeds_are_a_prompt_without_the_radix_cache(plain: SimProc, incremental: SimProc) -> None:
    embeds = [[0.01 * (i + j) for j in range(64)] for i in range(3)]
    status, body = _generate(plain, input_embeds=embeds)
    assert status == 400 and "disable_radix_cache is False" in body["error"]["message"]
    status, body = _generate(incremental, input_embeds=embeds)
    assert status == 200, body
    assert body["meta_info"]["prompt_tokens"] == 3 and len(body["output_ids"]) == 4
    assert _generate(incremental, input_embeds=embeds)[1]["output_ids"] == body["output_ids"]


def test_skip_tokenizer_init_answers_ids_only_and_refuses_text(no_tokenizer: SimProc) -> None:
    status, body = _generate(no_tokenizer, input_ids=[1, 2, 3])
    assert status == 200 and "text" not in body and len(body["output_ids"]) == 4, body
    status, chunks = _generate(no_tokenizer, input_ids=[1, 2, 3], stream=True)
    assert status == 200 and chunks and all("text" not in c for c in chunks)
    status, body = _generate(no_tokenizer, text="hello")
    assert (status, body) == (400, {"error": {"message": (
        "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide input_ids "
        "or re-initialize the engine with skip_tokenizer_init=False.")}})


def test_a_callers_rid_is_the_answers_id(plain: SimProc) -> None:
    assert _generate(plain, text="hi", rid="my-rid-1")[1]["meta_info"]["id"] == "my-rid-1"
    status, outs = _generate(plain, text=["a", "b"], rid=["x1", "x2"])
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["x1", "x2"]
    _, chunks = _generate(plain, text="hi", rid="streamed-rid", stream=True)
    assert {c["meta_info"]["id"] for c in chunks} == {"streamed-rid"}
    status, body = _generate(plain, text=["a", "b"], rid=["dup", "dup"])
    assert (status, body) == (400, {"error": {"message": "Duplicate request IDs detected within the request: ['dup']"}})


@pytest.fixture(scope="module")
def slow(launcher: Launcher) -> SimProc:
    """Tokens that take time (20 ms each), so that a request is still running when the abort comes."""
    return _sim(launcher, env={"SGLSIM_TOKEN_SECONDS": "0.02"})


def _running(sim: SimProc, rid: str, stream: bool = False) -> tuple[threading.Thread, dict[str, Any]]:
    done: dict[str, Any] = {}

    def run() -> None:
        done["answer"] = _generate(sim, text="abort me", rid=rid, stream=stream,
                                   sampling_params={"max_new_tokens": 400, "ignore_eos": True})

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done


def _wait_running(sim: SimProc, batches: int, done: dict[str, Any]) -> None:
    """Until the server has logged one more prefill batch than ``batches``: the request is running (or, a bug,
    already answered)."""
    wait_for(lambda: sim.log().count("Prefill batch") > batches or done, 30, "the request to run")
    assert not done, done


@pytest.mark.parametrize("how", ["rid", "abort_all", "rid_streamed"])
def test_abort_request_ends_the_running_request_with_an_abort(slow: SimProc, how: str) -> None:
    rid = f"abort-me-{how}"
    batches = slow.log().count("Prefill batch")
    thread, done = _running(slow, rid, stream=how == "rid_streamed")
    _wait_running(slow, batches, done)
    r = slow.client.post("/abort_request", json={"abort_all": True} if how == "abort_all" else {"rid": rid})
    assert (r.status_code, r.content) == (200, b"")
    thread.join(60)
    assert not thread.is_alive()
    status, body = done["answer"]
    final = body[-1] if isinstance(body, list) else body
    assert status == 200
    assert final["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                   "err_type": None}
    assert 0 < final["meta_info"]["completion_tokens"] < 400 and final["meta_info"]["id"] == rid
    # an id nobody runs: 200, nothing happens
    assert slow.client.post("/abort_request", json={"rid": "nobody"}).status_code == 200


def test_sessions_keep_a_conversations_tokens(plain: SimProc) -> None:
    r = plain.client.post("/open_session", json={"capacity_of_str_len": 1000})
    assert r.status_code == 200 and isinstance(r.json(), str)
    sid = r.json()
    status, first = _generate(plain, input_ids=[11, 12, 13], session_params={"id": sid, "rid": None})
    assert status == 200 and first["meta_info"]["prompt_tokens"] == 3
    rid1 = first["meta_info"]["id"]
    status, second = _generate(plain, input_ids=[14, 15], session_params={"id": sid, "rid": rid1},
                               return_prompt_token_ids=True)
    assert status == 200
    assert second["prompt_token_ids"] == [11, 12, 13, *first["output_ids"], 14, 15]
    status, dropped = _generate(plain, input_ids=[14, 15], return_prompt_token_ids=True,
                                session_params={"id": sid, "rid": rid1, "drop_previous_output": True})
    assert dropped["prompt_token_ids"] == [11, 12, 13, 14, 15]
    status, body = _generate(plain, input_ids=[14], session_params={"id": sid, "rid": "not-in-it"})
    assert (status, body) == (400, {"error": {"message": "Invalid request session id"}})
    assert plain.client.post("/open_session", json={"capacity_of_str_len": 10, "session_id": sid}).json() == {
        "error": {"message": "Failed to open the session. Check if a session with the same id is still open."}}
    r = plain.client.post("/close_session", json={"session_id": sid})
    assert (r.status_code, r.content) == (200, b"")
    status, body = _generate(plain, input_ids=[14], session_params={"id": sid, "rid": rid1})
    assert (status, body) == (400, {"error": {"message": f"Invalid request: session id {sid} does not exist"}})
    assert plain.client.post("/close_session", json={"session_id": "nope"}).status_code == 200
    r = plain.client.post("/open_session", json={"capacity_of_str_len": 10, "streaming": True})
    assert r.json() == {"error": {"message": "Streaming sessions are disabled. Please relaunch with "
                                             "--enable-streaming-session."}}


def test_triton_attention_on_the_cpu_dies_at_the_first_forward_pass(launcher: Launcher) -> None:
    """The real CPU engine accepts --attention-backend triton --device cpu, binds, and its scheduler dies of
    Triton's 'RuntimeError: 0 active drivers ([]). There should only be one.' at the warmup request (exit -9: its
    own kill_process_tree); with --skip-server-warmup, at the first request."""
    flags = ("--device", "cpu", "--attention-backend", "triton")
    warm = launcher(*CI_ARGS, "--max-total-tokens", "1024", *flags, model=TINY)
    assert warm.wait_exit(60) == -9
    assert "RuntimeError: 0 active drivers ([]). There should only be one." in warm.log()
    cold = _sim(launcher, *flags)
    with pytest.raises(Exception):  # noqa: B017 - the connection dies with the server, whatever httpx calls it
        cold.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert cold.wait_exit(60) == -9
    assert "0 active drivers" in cold.log()


def _ids(sim: SimProc, prompt: str = "The quick brown fox", **params: Any) -> list[int]:
    status, body = _generate(sim, text=prompt, sampling_params={"max_new_tokens": 24, "ignore_eos": True, **params})
    assert status == 200, body
    return list(body["output_ids"])


def test_sampling_knobs_act_in_the_real_engines_direction(plain: SimProc) -> None:
    """Recorded on the real engine (server_flags_real.json): temperature 0 repeats itself; a frequency, presence or
    repetition penalty keeps the greedy tokens up to the first one the generation already holds, then uses others
    (more distinct tokens). A seeded sample repeats under the same seed and differs under another (the real CPU
    engine honours the seed only with --enable-deterministic-inference; the sim always, to stay reproducible)."""
    greedy = _ids(plain, temperature=0)
    assert _ids(plain, temperature=0) == greedy == _ids(plain)  # no knob: the same deterministic answer
    first_repeat = next(i for i, t in enumerate(greedy) if t in greedy[:i])
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        penalized = _ids(plain, temperature=0, **penalty)
        assert penalized[:first_repeat] == greedy[:first_repeat], penalty
        assert len(set(penalized)) > len(set(greedy)), penalty
    seeded = _ids(plain, temperature=1.0, sampling_seed=42)
    assert _ids(plain, temperature=1.0, sampling_seed=42) == seeded
    assert _ids(plain, temperature=1.0, sampling_seed=7) != seeded
    assert len(set(_ids(plain, temperature=1.0, sampling_seed=42, frequency_penalty=1.5))) > len(set(seeded))
    long_prompt = " ".join(f"word{i}" for i in range(40))
    assert len(set(_ids(plain, long_prompt, presence_penalty=-1.0))) < len(set(_ids(plain, long_prompt)))


def test_openai_seed_and_penalties(plain: SimProc) -> None:
    def content(**extra: Any) -> str:
        r = plain.client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "say data data data again and again"}],
            "max_tokens": 40, "temperature": 0.8, **extra})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    assert content(seed=42) == content(seed=42) != content(seed=43)
    baseline = [content(seed=s) for s in range(42, 47)]
    penalized = [content(seed=s, frequency_penalty=1.99) for s in range(42, 47)]
    assert sum(_diversity(t) for t in penalized) > sum(_diversity(t) for t in baseline)


#: upstream sampling/test_penalty.py's four effect tests: (prompt, baseline knobs, penalized knobs)
UPSTREAM_PENALTY_CASES = [
    ("Write exactly 10 very small sentences, each containing the word 'data'. Use the word 'data' as much as "
     "possible.", {"frequency_penalty": 0.0}, {"frequency_penalty": 1.99}),
    ("Write the word 'machine learning' exactly 20 times in a row, separated by spaces.",
     {"presence_penalty": 0.0}, {"presence_penalty": 1.99}),
    ("Write exactly 10 short sentences, each containing the word 'data'. Use the word 'data' as much as possible.",
     {}, {"frequency_penalty": 1.99, "presence_penalty": 1.99, "repetition_penalty": 1.99}),
    ("Write the word 'extreme' exactly 20 times in a row, separated by spaces.",
     {}, {"frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 2.0}),
]


@pytest.mark.parametrize(("prompt", "baseline", "penalized"), UPSTREAM_PENALTY_CASES)
def test_a_penalty_widens_the_words_of_a_seeded_sample_as_upstream_measures_it(
        plain: SimProc, prompt: str, baseline: dict[str, float], penalized: dict[str, float]) -> None:
    """Upstream's measure (unique words over words, averaged over seeds 42-46 at temperature 0.8), its prompts: a
    seeded sample repeats words (half its draws are words already said), a penalty replaces a repeat with a word not
    said yet. The real engine passes these upstream tests with the tiny model; the sim once gave 1.000 -> 1.000."""
    def average(knobs: dict[str, float]) -> float:
        texts = []
        for seed in range(42, 47):
            r = plain.client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 150,
                "temperature": 0.8, "top_p": 1.0, "seed": seed, "repetition_penalty": 1.0, **knobs})
            assert r.status_code == 200, r.text
            texts.append(str(r.json()["choices"][0]["message"]["content"]))
        return sum(_diversity(t) for t in texts) / len(texts)

    assert average(penalized) > average(baseline)


def _diversity(text: str) -> float:
    """Upstream test_penalty.py's measure: unique words over words."""
    import re

    words = re.findall(r"\b\w+\b", text.lower())
    return len(set(words)) / len(words) if words else 1.0


def test_a_streaming_session_continues_its_last_turn(launcher: Launcher) -> None:
    """As upstream's test_session_control.py::test_streaming_session asks of the real engine: each turn's prompt is
    the last turn's prompt and output and its own tokens, whose cached tokens are that history; replace is
    refused."""
    sim = _sim(launcher, "--enable-streaming-session")
    try:
        sid = sim.client.post("/open_session", json={"capacity_of_str_len": 1000, "streaming": True}).json()
        previous = 0
        for turn, ids in enumerate(([11, 12, 13], [14, 15], [16])):
            status, body = _generate(sim, input_ids=ids, session_params={"id": sid, "rid": None})
            assert status == 200, body
            meta = body["meta_info"]
            assert meta["cached_tokens"] == (previous if turn else 0)
            previous = meta["prompt_tokens"] + meta["completion_tokens"]
        status, body = _generate(sim, input_ids=[17], session_params={"id": sid, "replace": True})
        assert (status, body) == (400, {"error": {"message": "Streaming sessions do not support replace."}})
    finally:  # a server of its own: ended with the test (the module's are ended with the module)
        sim.proc.kill()
        sim.proc.wait(30)


def _recorded() -> dict[str, Any]:
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "sim" / "server_flags_real.json"
    return dict(json.loads(path.read_text(encoding="utf-8"))["answers"])


def test_the_sim_answers_as_the_real_engine_recorded(plain: SimProc, incremental: SimProc,
                                                     no_tokenizer: SimProc) -> None:
    """The same requests as tests/engine_scripts/record_server_flags.py, held to the real engine's recorded answers
    where they do not depend on the model's numbers (statuses, messages, ids, counts, keys)."""
    import json

    real = _recorded()
    assert _generate(plain, text="hi", rid="my-rid-1")[1]["meta_info"]["id"] == real["rid_single"]
    assert [o["meta_info"]["id"] for o in _generate(plain, text=["a", "b"], rid=["x1", "x2"])[1]] == real["rid_batch"]
    status, body = _generate(plain, text=["a", "b"], rid=["dup", "dup"])
    assert [status, body] == [real["rid_dup"][0], json.loads(real["rid_dup"][1])]
    cached = [_generate(incremental, text="the same prompt for the cache test")[1]["meta_info"]["cached_tokens"]
              for _ in range(2)]
    assert cached == real["noradix_cached"]
    status, body = _generate(no_tokenizer, text="hello")
    assert [status, body] == [real["skip_text"][0], json.loads(real["skip_text"][1])]
    status, body = _generate(no_tokenizer, input_ids=[1, 2, 3])
    assert status == real["skip_ids"][0] and set(body) == set(json.loads(real["skip_ids"][1])) == {"output_ids",
                                                                                                  "meta_info"}
    assert {k for c in _generate(no_tokenizer, input_ids=[1, 2, 3], stream=True)[1] for k in c} == {
        k for c in real["skip_stream"] for k in c}
    _, chunks = _generate(incremental, text="hello world", stream=True)
    recorded = real["incr_stream"]
    for side in (chunks, recorded):  # each chunk only its new ids, the counts cumulative
        counts = [c["completion_tokens"] if "completion_tokens" in c else c["meta_info"]["completion_tokens"]
                  for c in side]
        assert sum(len(c["output_ids"]) for c in side) == counts[-1] == 4
    sid = plain.client.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": "mine"})
    assert [sid.status_code, sid.text.replace(" ", "")] == [real["open_named"][0], real["open_named"][1]]
    again = plain.client.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": "mine"})
    assert [again.status_code, again.json()] == [real["open_named_again"][0], json.loads(real["open_named_again"][1])]
    closed = plain.client.post("/close_session", json={"session_id": "nope"})
    assert [closed.status_code, closed.text] == real["close_unknown"]
