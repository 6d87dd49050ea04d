"""The simulated engine's gRPC servicer (``--grpc-mode``) as a client of its own stubs meets it: ``Generate`` under
the request's constraint (the proto's ``regex`` / ``json_schema`` / ``ebnf_grammar`` oneof, the output
:mod:`pytest_sglworker.sim.constrained` allows, as over HTTP), a grammar that does not compile (``INVALID_ARGUMENT``
with sglang's message, as the real servicer maps the scheduler's 400 abort), and ``Embed``'s answer on the wire
(smg-grpc-proto's flat ``EmbedResponse``, fields 4-6, which the real servicer 0.14.1 sends too).

What the real router makes of these is tested through it in ``tests/workers/test_grpc_worker.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sim_procs import TINY, Launcher, SimProc

from pytest_sglworker.engine.grpc_facts import INSTALL_HINT, missing_grpc_packages

pytestmark = [pytest.mark.grpc, pytest.mark.skipif(bool(missing_grpc_packages()),
                                                   reason=f"the gRPC packages are missing: {INSTALL_HINT}")]

REGEX = r'\{"name": "[a-z]{3,8}", "count": [0-9]{2}\}'


@pytest.fixture(scope="module")
def grpc_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimProc, Any, Any]]:
    """One gRPC sim on the tiny Llama (its vocab of 512 is below the servicer's warmup ids: no warmup), its stub
    and the proto module."""
    import grpc
    from smg_grpc_proto import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

    launcher = Launcher(tmp_path_factory.mktemp("grpc-sim"))
    try:
        sim = launcher("--grpc-mode", "--skip-server-warmup", "--host", "127.0.0.1", model=TINY)
        sim.wait_log("Health service status set to SERVING", timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{sim.port}") as channel:
            yield sim, sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel), sglang_scheduler_pb2
    finally:
        launcher.cleanup()


def _decode(ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return str(Tokenizer.from_file(str(Path(TINY) / "tokenizer.json")).decode(ids, skip_special_tokens=True))


def _request(pb: Any, stream: bool = False, max_new_tokens: int = 64, **constraint: str) -> Any:
    return pb.GenerateRequest(request_id="sim-grpc-1", stream=stream,
                              tokenized=pb.TokenizedInput(original_text="hello", input_ids=[1, 22, 33, 44]),
                              sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, **constraint))


def test_generate_follows_the_requests_regex_streamed_or_not(grpc_sim: tuple[SimProc, Any, Any]) -> None:
    _, stub, pb = grpc_sim
    (complete,) = [r.complete for r in stub.Generate(_request(pb, regex=REGEX), timeout=30)]
    assert re.fullmatch(REGEX, _decode(list(complete.output_ids))), _decode(list(complete.output_ids))
    assert complete.finish_reason == "stop"  # EOS once the grammar is done, before max_new_tokens
    answers = list(stub.Generate(_request(pb, stream=True, regex=REGEX), timeout=30))
    streamed = [t for r in answers if r.HasField("chunk") for t in r.chunk.token_ids]
    assert answers[-1].HasField("complete") and streamed == list(complete.output_ids)
    # without a constraint the same prompt is the sim's usual echo, not the regex's text
    (plain,) = [r.complete for r in stub.Generate(_request(pb, max_new_tokens=8), timeout=30)]
    assert not re.fullmatch(REGEX, _decode(list(plain.output_ids)))


def test_generate_follows_a_json_schema_and_cuts_at_max_new_tokens(grpc_sim: tuple[SimProc, Any, Any]) -> None:
    _, stub, pb = grpc_sim
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["city", "n"]}
    (complete,) = [r.complete for r in stub.Generate(_request(pb, json_schema=json.dumps(schema)), timeout=30)]
    value = json.loads(_decode(list(complete.output_ids)))
    assert isinstance(value["city"], str) and isinstance(value["n"], int)
    (cut,) = [r.complete for r in stub.Generate(_request(pb, max_new_tokens=3, regex=REGEX), timeout=30)]
    assert cut.finish_reason == "length" and len(cut.output_ids) == 3  # the grammar does not stretch the budget


def test_max_new_tokens_beyond_the_context_is_capped_as_the_scheduler_does(grpc_sim: tuple[SimProc, Any, Any]) -> None:
    """The gRPC path has no tokenizer manager to refuse a ``max_new_tokens`` the context cannot hold: sglang's
    scheduler caps it (``init_req_max_new_tokens``: at most the longest request less the prompt, less one). The sim
    refused it with 400 (upstream's gateway ``test_function_calling.py`` asks for 2048 on a 512-token model), and
    the router's circuit breaker then answered 503 for the rest of the class."""
    _, stub, pb = grpc_sim
    context = json.loads((Path(TINY) / "config.json").read_text())["max_position_embeddings"]
    max_total = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_context_length  # the pool, as real
    request = _request(pb, max_new_tokens=4 * context)
    request.sampling_params.ignore_eos = True
    (complete,) = [r.complete for r in stub.Generate(request, timeout=60)]
    assert complete.finish_reason == "length"
    assert complete.completion_tokens == min(context - 1, max_total - 1) - 4 - 1  # 4 prompt tokens


def test_penalties_widen_the_vocabulary_as_over_http(grpc_sim: tuple[SimProc, Any, Any]) -> None:
    """A frequency, presence or repetition penalty replaces a repeated token (the vocabulary widens); the proto's
    unset repetition_penalty (0) is no penalty, as the servicer reads it."""
    _, stub, pb = grpc_sim

    def ids(**params: float) -> list[int]:
        request = pb.GenerateRequest(request_id="pen", tokenized=pb.TokenizedInput(
            original_text="ab", input_ids=[40, 41, 40, 41]), sampling_params=pb.SamplingParams(
            max_new_tokens=12, ignore_eos=True, **params))
        (complete,) = [r.complete for r in stub.Generate(request, timeout=30)]
        return list(complete.output_ids)

    plain = ids()
    assert len(set(plain)) == 2  # the echo of the prompt's two tokens
    assert ids(repetition_penalty=0.0) == plain == ids(temperature=0.7)  # no seed on the wire: no sampling
    for knob in ({"frequency_penalty": 1.0}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.3}):
        assert len(set(ids(**knob))) > 2, knob


def test_a_grammar_that_does_not_compile_ends_the_stream_with_invalid_argument(
        grpc_sim: tuple[SimProc, Any, Any]) -> None:
    import grpc

    sim, stub, pb = grpc_sim
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(_request(pb, regex="(unclosed"), timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("Failed to compile regex grammar: ")
    assert "Failed to compile regex grammar" in sim.log()


def test_embed_answers_the_flat_response_the_real_servicer_sends(tmp_path: Path) -> None:
    """smg-grpc-proto's ``EmbedResponse`` is flat (``embedding_dim`` 4, ``embedding`` 5, ``prompt_tokens`` 6; 1-3
    reserved: the old ``request_id`` and ``oneof {complete, error}``); the real servicer 0.14.1 fills it so, and so
    does the sim (sglang-router 0.3.2 still reads the old oneof: tests/workers/test_grpc_worker.py)."""
    import grpc
    from smg_grpc_proto import sglang_scheduler_pb2 as pb
    from smg_grpc_proto import sglang_scheduler_pb2_grpc

    fields = {f.name: f.number for f in pb.EmbedResponse.DESCRIPTOR.fields}
    assert fields == {"embedding_dim": 4, "embedding": 5, "prompt_tokens": 6}
    launcher = Launcher(tmp_path)
    try:
        sim = launcher("--grpc-mode", "--skip-server-warmup", "--is-embedding", "--host", "127.0.0.1", model=TINY)
        sim.wait_log("Health service status set to SERVING", timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{sim.port}") as channel:
            stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
            answer = stub.Embed(pb.EmbedRequest(request_id="e1", tokenized=pb.TokenizedInput(
                original_text="hi", input_ids=[1, 5, 9])), timeout=30)
            with pytest.raises(grpc.RpcError) as raised:  # an embedding model does not generate
                list(stub.Generate(_request(pb), timeout=30))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        launcher.cleanup()
    assert answer.prompt_tokens == 3 and answer.embedding_dim == len(answer.embedding) > 0
    wire = answer.SerializeToString()
    assert wire[0] == (4 << 3)  # field 4, varint: the flat layout's first field, no oneof
    assert "Receive embedding request: e1" in sim.log()
