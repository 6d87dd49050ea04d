"""The simulated engine's native endpoints: ``/generate`` (batched, streamed, with logprobs, constrained by
``sampling_params.regex`` or ``json_schema``) and ``/encode``.

Part of :mod:`pytest_sglworker.sim`; stdlib only. Both take ``text`` or ``input_ids`` (one prompt or a batch),
check them as sglang does, and answer sglang's ``meta_info``; a PD server's ``/generate`` goes through the
handshake of :mod:`.pd` (the prefill side answers with its first token only). A grammar that does not compile
(:mod:`pytest_sglworker.sim.constrained`) is sglang's abort: 400, or one chunk finished with the abort when
streamed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from ..constrained import ConstraintError, constrained_text, grammar_of
from ..state import Sim
from ..tokens import Generation, embedding, logprobs, prompt_seed
from .common import (
    NOT_EMBEDDING,
    Abort,
    BadRequest,
    Request,
    Route,
    as_stop_list,
    check_length,
    int_field,
    not_generation,
    num,
    pace,
    verify_sampling,
)
from .pd import handshake


def generate(ctx: Request) -> None:
    sim = ctx.sim
    rid = sim.new_id()
    try:
        req = ctx.parse_json(require_json_type=False, endpoint="/generate")
        not_generation(sim)
        prompts, batch = _generate_prompts(sim, req)
        params = req.get("sampling_params") or {}
        if isinstance(params, list):
            params = params[0] if params and isinstance(params[0], dict) else {}
        if not isinstance(params, dict):
            raise BadRequest("1 validation error:\n  sampling_params: Input should be a valid dictionary",
                             validation=True)
        for ids in prompts:
            check_length(sim, ids, params.get("max_new_tokens"))
        verify_sampling(params, sim.vocab.vocab_size, as_float=False)
        grammar = request_grammar(params)
        max_new = int_field(params.get("max_new_tokens", 128), "max_new_tokens")
        stop = as_stop_list(params.get("stop"))
        ignore_eos = bool(params.get("ignore_eos", False))
        stop_ids = params.get("stop_token_ids") if isinstance(params.get("stop_token_ids"), list) else None
        n = params.get("n", 1) if num(params.get("n", 1)) else 1
        if n > 1 and not batch:
            prompts, batch = prompts * int(n), True
        return_logprob = bool(req.get("return_logprob", False))
        top_n = int(req.get("top_logprobs_num") or 0)
        start_len = req.get("logprob_start_len")
        start_len = -1 if start_len is None else int(start_len)
        with_text = bool(req.get("return_text_in_logprobs", False))
        outputs = [constrained_text(grammar, prompt_seed(ids)) for ids in prompts]
        gens = [sim.generate(ids, None, max_new, stop, ignore_eos, stop_ids, constraint=out)
                for ids, out in zip(prompts, outputs, strict=True)]
        handshake(sim, req, rid, gens[0])
    except BadRequest as exc:
        ctx.bad(exc, openai=False)
        return
    except Abort as exc:
        ctx.abort(exc)
        return
    except ConstraintError as exc:  # the grammar does not compile: the scheduler aborts the request with 400
        sim.log.error(f"{exc}, self.rid={rid!r}")
        if req.get("stream"):
            ctx.stream(iter([_grammar_abort(sim, rid, str(exc))]))
        else:
            ctx.bad(BadRequest(str(exc)), openai=False)
        return
    started = time.perf_counter()
    lp = (return_logprob, top_n, start_len, with_text)
    if sim.mode == "prefill":  # the prefill side stops after its first token (sglang: FINISH_LENGTH(0))
        for gen in gens:
            gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
            gen.finish = {"type": "length", "length": 0}
    if req.get("stream"):
        ctx.stream(_generate_events(sim, gens, batch, started, lp, rid))
        return
    outs = []
    for gen in gens:
        pace(sim, gen.completion_tokens)
        outs.append(_generate_out(sim, gen, gen.completion_tokens, started, lp, rid if len(gens) == 1 else None,
                                  final=True))
    ctx.json(200, outs if batch else outs[0])


def request_grammar(params: dict[str, Any]) -> tuple[str, str] | None:
    """The request's one grammar (``regex``, ``json_schema``, ...); more than one is sglang's 400."""
    try:
        return grammar_of(params)
    except ConstraintError as exc:
        raise BadRequest(str(exc)) from None


def _grammar_abort(sim: Sim, rid: str, message: str) -> dict[str, Any]:
    """The one chunk a stream gets when its grammar does not compile: the request was cut to one token (sglang's
    ``set_finish_with_abort``) and finished with the abort."""
    return {"text": "", "output_ids": [sim.vocab.eos_token_id], "meta_info": {
        "id": rid, "finish_reason": {"type": "abort", "message": message, "status_code": 400,
                                     "err_type": "BadRequestError"},
        "prompt_tokens": 1, "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
        "completion_tokens": 1, "cached_tokens": 0, "weight_versions": [{"version": "default", "start": 0, "end": 1}],
        "cached_tokens_details": None, "dp_rank": None, "e2e_latency": 0.0, "response_sent_to_client_ts": time.time()}}


def _generate_prompts(sim: Sim, req: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the request is a batch."""
    vocab = sim.vocab
    text, ids = req.get("text"), req.get("input_ids")
    if text is not None:
        if isinstance(text, str):
            return [vocab.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [vocab.encode(t) for t in text], True
        raise BadRequest("1 validation error:\n  text: Input should be a valid string or a list of strings",
                         validation=True)
    if ids is not None:
        if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return [list(ids)], False
        if (isinstance(ids, list) and ids
                and all(isinstance(row, list) and all(isinstance(i, int) for i in row) for row in ids)):
            return [list(row) for row in ids], True
        raise BadRequest("1 validation error:\n  input_ids: Input should be a list of token ids or a list of such "
                         "lists", validation=True)
    raise BadRequest("Either text, input_ids or input_embeds should be provided.")


def _generate_out(sim: Sim, gen: Generation, k: int, started: float, lp: tuple[bool, int, int, bool],
                  rid: str | None, *, final: bool) -> dict[str, Any]:
    return_logprob, top_n, start_len, with_text = lp
    meta: dict[str, Any] = {
        "id": rid or sim.new_id(),
        "finish_reason": gen.finish if final else None,
        "prompt_tokens": gen.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
    }
    if return_logprob:
        probs = logprobs(sim.vocab, gen, start_len=start_len, top_n=top_n, with_text=with_text,
                         input_side=sim.mode != "decode")
        meta["input_token_logprobs"] = probs.input_token
        meta["output_token_logprobs"] = probs.output_token[:k]
        meta["output_token_logprobs_length"] = k
        if top_n > 0:
            meta["input_top_logprobs"] = probs.input_top
            meta["output_top_logprobs"] = probs.output_top[:k]
    meta.update(reasoning_tokens=0, completion_tokens=k, cached_tokens=gen.cached_tokens)
    if final:
        meta["weight_versions"] = [{"version": "default", "start": 0, "end": k}]
    meta["cached_tokens_details"] = {"device": gen.cached_tokens, "host": 0} if gen.cached_tokens else None
    meta["dp_rank"] = None
    if final:
        meta["e2e_latency"] = time.perf_counter() - started
    else:
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": gen.texts[k - 1] if k else "", "output_ids": gen.output_ids[:k], "meta_info": meta}


def _generate_events(sim: Sim, gens: list[Generation], batch: bool, started: float,
                     lp: tuple[bool, int, int, bool], rid: str) -> Iterator[dict[str, Any]]:
    for index, gen in enumerate(gens):
        request_id = rid if len(gens) == 1 else sim.new_id()
        n = gen.completion_tokens
        for k in range(1, max(n, 1) + 1):
            pace(sim, 1)
            out = _generate_out(sim, gen, min(k, n), started, lp, request_id, final=k >= n)
            if batch:
                out["index"] = index
            yield out


def encode(ctx: Request) -> None:
    sim = ctx.sim
    plan = sim.plan
    started = time.perf_counter()
    try:
        req = ctx.parse_json(require_json_type=False, endpoint="/encode")
        prompts, batch = _generate_prompts(sim, req)
        if not plan.is_embedding:
            raise BadRequest(NOT_EMBEDDING)
        for ids in prompts:
            check_length(sim, ids, None)
    except BadRequest as exc:
        ctx.bad(exc, openai=False)
        return
    outs = []
    for ids in prompts:
        outs.append({"embedding": embedding(ids, plan.hidden_size), "meta_info": {
            "id": sim.new_id(), "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
            "weight_version": "default", "num_retractions": 0,
            "e2e_latency": time.perf_counter() - started, "response_sent_to_client_ts": time.time()}})
    ctx.json(200, outs if batch else outs[0])


ROUTES: tuple[Route, ...] = (
    Route(("POST", "PUT"), "/generate", generate, inference=True),
    Route(("POST", "PUT"), "/encode", encode, inference=True),
)
