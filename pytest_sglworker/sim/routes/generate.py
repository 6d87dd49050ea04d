"""The simulated engine's native endpoints: ``/generate`` (batched, streamed, with logprobs, constrained by
``sampling_params.regex`` or ``json_schema``) and ``/encode``.

Part of :mod:`pytest_sglworker.sim`; stdlib only. Both take ``text`` or ``input_ids`` (one prompt or a batch),
check them as sglang does, and answer sglang's ``meta_info``; a PD server's ``/generate`` goes through the
handshake of :mod:`.pd` (the prefill side answers with its first token only). A grammar that does not compile
(:mod:`pytest_sglworker.sim.constrained`) is sglang's abort: 400, or one chunk finished with the abort when
streamed. A refusal after the body is read (a sampling param out of range, a LoRA adapter on a server without
LoRA, ...) is, streamed, sglang's one error event; an unknown ``sampling_params`` key is msgspec's 400 either way.
A batch may give each prompt its own ``sampling_params``.
"""

from __future__ import annotations

import base64
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..constrained import ConstraintError, constrained_text, grammar_of
from ..refusals import triton_driver_crash, triton_on_cpu
from ..state import Sim
from ..tokens import Generation, Sampling, embedding, logprobs, prompt_seed, token_ids_logprobs
from .checks import (
    DecodeRefusal,
    flat_logprobs,
    hidden_states_type,
    sampling_keys,
    server_features,
    token_ids_logprob,
)
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
    stop_options,
    verify_sampling,
)
from .pd import handshake
from .sessions import cut, in_flight, remember, session_prompt

#: the tokenizer manager's refusal of a text prompt on a server launched with ``--skip-tokenizer-init``
SKIP_TOKENIZER_TEXT = ("The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please "
                       "provide input_ids or re-initialize the engine with skip_tokenizer_init=False.")


def generate(ctx: Request) -> None:
    sim = ctx.sim
    if triton_on_cpu(sim.plan):  # the first forward pass after --skip-server-warmup: the scheduler dies
        triton_driver_crash(sim)
    rid = sim.new_id()
    rids: list[str] = []
    req: dict[str, Any] = {}
    try:
        req = ctx.parse_json(require_json_type=False, endpoint="/generate")
        raw = req.get("sampling_params") or {}
        per_prompt = raw if isinstance(raw, list) else [raw]  # a batch may give each prompt its own
        if not per_prompt or not all(isinstance(p, dict) for p in per_prompt):
            raise BadRequest("1 validation error:\n  sampling_params: Input should be a valid dictionary",
                             validation=True)
        for params in per_prompt:
            sampling_keys(params)
        hidden_states_type(req)
        not_generation(sim)
        server_features(sim, req, per_prompt[0])
        prompts, batch = _generate_prompts(sim, req)
        rids = _rids(sim, req, len(prompts), batch)
        rid = rids[0]
        flat_logprobs(req)
        token_ids_logprob(req, sim.vocab.vocab_size, batch=batch)
        session = req.get("session_params")
        if not batch:
            prompts = [session_prompt(sim, session, prompts[0])]
        settings = [per_prompt[k] if k < len(per_prompt) else per_prompt[0] for k in range(len(prompts))]
        for k, (ids, params) in enumerate(zip(prompts, settings, strict=True)):
            allowed = check_length(sim, ids, params.get("max_new_tokens"))
            if allowed != params.get("max_new_tokens"):  # --allow-auto-truncate
                settings[k] = params = {**params, "max_new_tokens": allowed}
            verify_sampling(params, sim.vocab.vocab_size, as_float=False)
        n = settings[0].get("n", 1) if num(settings[0].get("n", 1)) else 1
        if n > 1 and not batch:
            prompts, settings, batch = prompts * int(n), settings * int(n), True
            rids = [rid] + [sim.new_id() for _ in range(len(prompts) - 1)]
        return_logprob = bool(req.get("return_logprob", False))
        top_n = int(req.get("top_logprobs_num") or 0)
        start_len = req.get("logprob_start_len")
        start_len = -1 if start_len is None else int(start_len)
        with_text = bool(req.get("return_text_in_logprobs", False))
        asked = req.get("token_ids_logprob") or []
        asked = asked[0] if asked and isinstance(asked[0], list) else asked  # a batch's: the first request's
        lp = Asked(return_logprob, top_n, start_len, with_text, tuple(asked),
                   bool(req.get("return_sampling_mask")), _flat_asks(req), settings[0].get("beam_width"))
        gens = [_generation(sim, ids, params) for ids, params in zip(prompts, settings, strict=True)]
        handshake(sim, req, rid, gens[0])
    except DecodeRefusal as exc:  # the decoder's, before anything streams
        ctx.json(400, {"error": str(exc)})
        return
    except BadRequest as exc:
        if req.get("stream") is True and not exc.validation:  # the tokenizer manager's: an error event
            sim.log.error(f"[http_server] Error: {exc}")
            ctx.stream(iter([{"error": {"message": str(exc), "type": "invalid_request_error", "code": 400,
                                        "retryable": False}}]))
        else:
            ctx.bad(exc, openai=False)
        return
    except Abort as exc:
        ctx.abort(exc)
        return
    except ConstraintError as exc:  # the scheduler aborts the request with 400 (a grammar, a session)
        sim.log.error(f"{exc}, self.rid={rid!r}")
        if req.get("stream"):
            ctx.stream(iter([_grammar_abort(sim, rid, str(exc))]))
        else:
            ctx.bad(BadRequest(str(exc)), openai=False)
        return
    started = time.perf_counter()
    if sim.mode == "prefill":  # the prefill side stops after its first token (sglang: FINISH_LENGTH(0))
        for gen in gens:
            gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
            gen.finish = {"type": "length", "length": 0}
    hidden = [_hidden_states(sim, gen) if asked else None
              for gen, asked in zip(gens, _hidden_asks(req, len(gens)), strict=True)]
    with_prompt = bool(req.get("return_prompt_token_ids"))
    shown = _shown(sim)
    with in_flight(sim, rids) as flags:
        if req.get("stream"):
            events = _generate_events(sim, gens, batch, started, lp, rids, hidden, flags,
                                      incremental=bool(sim.plan.args.get("incremental_streaming_output")))
            ctx.stream(shown({**e, "prompt_token_ids": gens[e.get("index", 0)].prompt_ids} if with_prompt else e)
                       for e in events)
        else:
            outs = []
            for gen, hidden_rows, request_id, flag in zip(gens, hidden, rids, flags, strict=True):
                _run(sim, gen, flag)
                outs.append(shown(_generate_out(sim, gen, gen.completion_tokens, started, lp, request_id,
                                                final=True, hidden=hidden_rows)))
                if with_prompt:
                    outs[-1]["prompt_token_ids"] = gen.prompt_ids
            ctx.json(200, outs if batch else outs[0])
    if not batch:
        remember(sim, session, rids[0], gens[0])


def _run(sim: Sim, gen: Generation, flag: threading.Event) -> None:
    """The simulated time of ``gen``'s tokens, one at a time; an abort ends it at the token it arrives in."""
    if not sim.token_seconds:  # no simulated time: nothing to abort in between
        pace(sim, gen.completion_tokens)
        return
    for k in range(gen.completion_tokens):
        if flag.is_set():
            cut(gen, k)
            return
        pace(sim, 1)


def _shown(sim: Sim) -> Any:
    """What an answer shows of a generation: without its text on a server launched with ``--skip-tokenizer-init``
    (no detokenizer: the tokenizer manager gets token ids only)."""
    if not sim.plan.args.get("skip_tokenizer_init"):
        return lambda out: out
    return lambda out: {k: v for k, v in out.items() if k != "text"}


def _rids(sim: Sim, req: dict[str, Any], count: int, batch: bool) -> list[str]:
    """The request ids: the caller's ``rid`` (one, or one per prompt of a batch), else new ones; a batch that
    repeats an id is the tokenizer manager's 400."""
    given = req.get("rid")
    if batch and isinstance(given, list):
        seen: dict[str, int] = {}
        for value in given:
            seen[str(value)] = seen.get(str(value), 0) + 1
        duplicates = [value for value, times in seen.items() if times > 1]
        if duplicates:
            raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")
        return [str(given[i]) if i < len(given) else sim.new_id() for i in range(count)]
    if not batch and isinstance(given, str) and given:
        return [given]
    return [sim.new_id() for _ in range(count)]


def _generation(sim: Sim, ids: list[int], params: dict[str, Any]) -> Generation:
    """One prompt's generation under its sampling params (its grammar, max new tokens, stops)."""
    output = constrained_text(request_grammar(params), prompt_seed(ids))
    stop_ids, stop_regex = stop_options(params)
    return sim.generate(ids, None, int_field(params.get("max_new_tokens", 128), "max_new_tokens"),
                        as_stop_list(params.get("stop")), bool(params.get("ignore_eos", False)), stop_ids,
                        constraint=output, stop_regex=stop_regex, sampling=Sampling.of(params))


def _flat_asks(req: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(input side flat, output side flat, base64): the flat raw top-logprob format sglang offers trainers."""
    return (bool(req.get("return_flat_raw_top_logprobs")), bool(req.get("return_flat_raw_output_top_logprobs")),
            bool(req.get("return_flat_raw_top_logprobs_b64")))


def _flat(side: str, rows: list[Any], top_n: int, b64: bool) -> dict[str, Any]:
    """sglang's flat raw form of one side's top logprobs: the leading null rows counted, the rest as two flat
    arrays (values, token ids; little-endian float32 and int32 in base64 with ``b64``) and their shape."""
    prefix = 0
    while prefix < len(rows) and not rows[prefix]:
        prefix += 1
    values = [e[0] for row in rows[prefix:] for e in row]
    ids = [e[1] for row in rows[prefix:] for e in row]
    out: dict[str, Any] = {}
    if b64:
        out[f"{side}_top_logprobs_val_flat_b64"] = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
        out[f"{side}_top_logprobs_idx_flat_b64"] = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
        out[f"{side}_top_logprobs_val_flat_b64_dtype"] = "float32"
        out[f"{side}_top_logprobs_idx_flat_b64_dtype"] = "int32"
    else:
        out[f"{side}_top_logprobs_val_flat"] = values
        out[f"{side}_top_logprobs_idx_flat"] = ids
    out[f"{side}_top_logprobs_shape"] = [len(rows) - prefix, top_n]
    out[f"{side}_top_logprobs_null_prefix"] = prefix
    return out


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
    text, ids, embeds = req.get("text"), req.get("input_ids"), req.get("input_embeds")
    if text is not None and ids is None and embeds is None and sim.plan.args.get("skip_tokenizer_init"):
        raise BadRequest(SKIP_TOKENIZER_TEXT)
    if embeds is not None:  # a prompt given as its embeddings (the radix cache off, see checks): one id per row
        rows = embeds if embeds and isinstance(embeds[0], list) and embeds[0] and isinstance(embeds[0][0], list) \
            else [embeds]
        return [[_embed_id(sim, row) for row in prompt] for prompt in rows], rows is embeds
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


def _embed_id(sim: Sim, row: Any) -> int:
    """The simulated token of one embedding row: a stable id of its values, never a special one."""
    seed = prompt_seed([int(float(x) * 1e6) for x in row] if isinstance(row, list) else [0])
    specials = sim.vocab.special_ids
    return next(t % sim.vocab.vocab_size for t in range(seed, seed + len(specials) + 1)
                if t % sim.vocab.vocab_size not in specials)


@dataclass(frozen=True)
class Asked:
    """What a ``/generate`` request asks of its ``meta_info`` beyond the counts: logprobs (``return_logprob``,
    ``top_logprobs_num``, ``logprob_start_len``, ``return_text_in_logprobs``, ``token_ids_logprob``) and the
    sampling mask (``return_sampling_mask``: greedy, so each step's mask is its one token), the flat raw top
    logprobs (:func:`_flat`), a beam search (``beam_width``: its one beam is the generation)."""

    logprob: bool
    top_n: int
    start_len: int
    with_text: bool
    token_ids: tuple[int, ...]
    sampling_mask: bool
    flat: tuple[bool, bool, bool] = (False, False, False)
    beam_width: Any = None


def _hidden_asks(req: dict[str, Any], count: int) -> list[bool]:
    """Which of the ``count`` prompts asked for their hidden states: ``return_hidden_states`` a flag for all, or a
    list of one flag per prompt."""
    value = req.get("return_hidden_states")
    if isinstance(value, list):
        return [bool(value[i]) if i < len(value) else False for i in range(count)]
    return [bool(value)] * count


def _hidden_states(sim: Sim, gen: Generation) -> list[Any]:
    """``meta_info.hidden_states`` of the whole generation, shaped as sglang's scheduler collects them when it
    captures them all: the prefill's rows first, one per prompt token it computed (those after the cached prefix),
    then one row per later output token (the first one comes out of the prefill); after ``k`` output tokens, its
    first ``k`` items. Computed once: a stream sends the list so far in every chunk. The values are the sim's
    own."""
    ids, prompt, size = [*gen.prompt_ids, *gen.output_ids], len(gen.prompt_ids), sim.plan.hidden_size
    if not gen.output_ids:
        return []
    first = min(gen.cached_tokens, prompt - 1)
    prefill = [embedding(ids[:i + 1], size) for i in range(first, prompt)]
    return [prefill, *(embedding(ids[:prompt + j], size) for j in range(1, len(gen.output_ids)))]


def _generate_out(sim: Sim, gen: Generation, k: int, started: float, lp: Asked,
                  rid: str | None, *, final: bool, hidden: list[Any] | None = None) -> dict[str, Any]:
    return_logprob, top_n, start_len, with_text = lp.logprob, lp.top_n, lp.start_len, lp.with_text
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
            flat_in, flat_out, b64 = lp.flat
            meta.update(_flat("input", probs.input_top, top_n, b64) if flat_in
                        else {"input_top_logprobs": probs.input_top})
            meta.update(_flat("output", probs.output_top[:k], top_n, b64) if flat_out
                        else {"output_top_logprobs": probs.output_top[:k]})
        if lp.token_ids:
            inputs, outputs = token_ids_logprobs(gen, lp.token_ids, start_len if sim.mode != "decode" else -1)
            meta["input_token_ids_logprobs"] = inputs
            meta["output_token_ids_logprobs"] = outputs[:k]
    if lp.sampling_mask:
        meta["output_token_sampling_mask"] = [[t] for t in gen.output_ids[:k]]
        meta["output_token_sampling_logprobs"] = [0.0] * k
        meta["output_token_sampling_mask_length"] = k
    meta.update(reasoning_tokens=0, completion_tokens=k, cached_tokens=gen.cached_tokens)
    if final:
        meta["weight_versions"] = [{"version": "default", "start": 0, "end": k}]
    meta["cached_tokens_details"] = {"device": gen.cached_tokens, "host": 0} if gen.cached_tokens else None
    meta["dp_rank"] = None
    if hidden is not None:
        meta["hidden_states"] = hidden[:k]
    text = gen.texts[k - 1] if k else ""
    if final and num(lp.beam_width) and lp.beam_width > 1:  # the beam search's answer: its beams, no latency
        meta["sequence_score"] = sum(e[0] for e in logprobs(sim.vocab, gen, start_len=-1, top_n=0,
                                                             with_text=False).output_token)
        meta["beam_results"] = [{"output_ids": gen.output_ids[:k], "text": text, "meta_info": dict(meta)}]
    elif final:
        meta["e2e_latency"] = time.perf_counter() - started
    else:
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": text, "output_ids": gen.output_ids[:k], "meta_info": meta}


#: the meta_info lists an incremental stream sends only the new part of (sglang's tokenizer manager)
INCREMENTAL_META = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                    "output_token_sampling_mask", "output_token_sampling_logprobs")


def _generate_events(sim: Sim, gens: list[Generation], batch: bool, started: float, lp: Asked, rids: list[str],
                     hidden: list[list[Any] | None], flags: list[threading.Event], *,
                     incremental: bool = False) -> Iterator[dict[str, Any]]:
    """The chunks of a stream: cumulative text and ids, or with ``--incremental-streaming-output`` each chunk's
    own (its new text, its new ids, the output-side logprob lists from where the last chunk ended). An abort
    ends a generation with its next chunk."""
    for index, gen in enumerate(gens):
        n = gen.completion_tokens
        for k in range(1, max(n, 1) + 1):
            pace(sim, 1)
            if flags[index].is_set() and k < n:
                cut(gen, k)
                n = k
            out = _generate_out(sim, gen, min(k, n), started, lp, rids[index], final=k >= n, hidden=hidden[index])
            if incremental:
                before = min(k, n) - 1 if n else 0
                out["text"] = gen.deltas()[before] if n else ""
                out["output_ids"] = gen.output_ids[before:min(k, n)]
                meta = out["meta_info"]
                for key in INCREMENTAL_META:
                    if key in meta:
                        meta[key] = meta[key][before:]
            if batch:
                out["index"] = index
            yield out
            if k >= n:
                break


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
