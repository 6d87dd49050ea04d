"""The simulated engine's OpenAI-compatible endpoints: ``/v1/chat/completions``, ``/v1/completions`` (both
streamed or not, with logprobs, constrained by ``response_format`` or sglang's ``regex`` extra), ``/v1/responses``,
``/v1/embeddings`` and ``/v1/models`` (with ``/v1/models/{name}``).

Part of :mod:`pytest_sglworker.sim`; stdlib only. Requests are checked as sglang's pydantic models and OpenAI
adapters do (the error envelopes of :mod:`.common`); a PD server's completions go through the handshake of
:mod:`.pd` (the prefill side answers with its first token only). A chat whose last message is the assistant's
is continued with ``continue_final_message`` (:func:`final_message`, as sglang 0.5.23's
``_handle_last_assistant_message``). sglang's extras are honoured as it honours them: ``input_ids`` (the chat's
prompt), ``stop_token_ids`` and ``stop_regex``, ``return_token_ids`` / ``return_prompt_token_ids`` /
``return_meta_info`` and the ``sglext`` ids, ``stream_options.continuous_usage_stats``; what the server was not
launched for is refused (:mod:`.checks`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from ..constrained import ConstraintError, constrained_text
from ..state import Sim
from ..tokens import (
    Generation,
    Sampling,
    embedding,
    embedding_base64,
    message_text,
    openai_chat_logprob,
    openai_completion_logprobs,
    prompt_seed,
    render_chat,
)
from .checks import chat_options, embedding_options, server_features
from .common import (
    NOT_EMBEDDING,
    Abort,
    BadRequest,
    Request,
    Route,
    as_stop_list,
    check_length,
    int_field,
    missing,
    not_generation,
    num,
    openai_usage,
    pace,
    stop_options,
    verify_sampling,
)
from .generate import request_grammar
from .pd import handshake


def models(ctx: Request) -> None:
    sim = ctx.sim
    ctx.json(200, {"object": "list", "data": [_card(sim)]})


def model_card(ctx: Request) -> None:
    sim = ctx.sim
    name = ctx.path.split("?", 1)[0][len("/v1/models/"):]
    if name != sim.plan.served_model_name:
        ctx.json(404, {"error": {"message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}})
        return
    ctx.json(200, _card(sim))


def _card(sim: Sim) -> dict[str, Any]:
    plan = sim.plan
    return {"id": plan.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": plan.served_model_name, "parent": None, "max_model_len": plan.context_len}


def _openai_params(req: dict[str, Any]) -> tuple[int | None, list[str], bool, int]:
    max_tokens = int_field(req.get("max_completion_tokens"), "max_completion_tokens")
    if max_tokens is None:
        max_tokens = int_field(req.get("max_tokens"), "max_tokens")
    n = req.get("n", 1)
    n = 1 if n is None else n
    if n == 0 and not isinstance(n, bool):  # sglang 0.5.23 lets it through: one choice streamed, a range() step
        if req.get("stream"):                # error otherwise
            return max_tokens, as_stop_list(req.get("stop")), bool(req.get("ignore_eos", False)), 1
        raise BadRequest("range() arg 3 must not be zero", kind="BadRequest")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"1 validation error:\n  n: Input should be greater than or equal to 1, got {n!r}",
                         validation=True)
    return max_tokens, as_stop_list(req.get("stop")), bool(req.get("ignore_eos", False)), n


def _openai_sampling(req: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    params = {k: req[k] for k in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                                  "presence_penalty", "repetition_penalty", "logit_bias") if req.get(k) is not None}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return params


def _stream_usage(sim: Sim, req: dict[str, Any]) -> tuple[bool, bool]:
    """sglang's ``should_include_usage``: (a usage chunk at the end, usage in every content chunk)."""
    options = req.get("stream_options")
    default = bool(sim.plan.args.get("stream_response_default_include_usage"))
    if isinstance(options, dict) and options:
        return bool(options.get("include_usage")) or default, bool(options.get("continuous_usage_stats"))
    return default, False


def _hidden_state(sim: Sim, gen: Generation) -> list[float]:
    """A choice's ``hidden_states`` (``return_hidden_states``, on a server started with
    ``--enable-return-hidden-states``): its last token's hidden state, ``hidden_size`` floats, or ``[]`` for a
    one-token answer (sglang's ``process_hidden_states_for_response``); the values are the sim's own."""
    return embedding([*gen.prompt_ids, *gen.output_ids], sim.plan.hidden_size) if gen.completion_tokens > 1 else []


_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def openai_grammar(req: dict[str, Any], *, chat: bool) -> tuple[str, str] | None:
    """The grammar of an OpenAI request: sglang's ``regex`` and ``ebnf`` extras (and ``json_schema`` on
    completions), or ``response_format`` (``json_object``: ``{"type": "object"}``; ``json_schema``: its schema,
    which it must have; ``text``: none); more than one is sglang's 400 ``Only one of ...``."""
    params: dict[str, Any] = {"regex": req.get("regex"), "ebnf": req.get("ebnf")}
    if not chat:
        params["json_schema"] = req.get("json_schema")
    fmt = req.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in _FORMATS:
            raise BadRequest("1 validation error:\n  {'type': 'literal_error', 'loc': ('body', 'response_format', "
                             "'ResponseFormat', 'type'), 'msg': \"Input should be 'text', 'json_object' or "
                             f"'json_schema'\", 'input': {kind!r}}}", validation=True)
        spec = fmt.get("json_schema")
        if kind == "json_schema" and spec is None and chat and isinstance(fmt.get("schema"), dict):
            spec = {"name": fmt["schema"].get("title", "Schema"), "schema": fmt["schema"]}  # sglang's set_json_schema
        if kind == "json_schema" and spec is not None and (not isinstance(spec, dict) or "name" not in spec):
            raise BadRequest("1 validation error:\n  {'type': 'missing', 'loc': ('body', 'response_format', "
                             f"'ResponseFormat', 'json_schema', 'name'), 'msg': 'Field required', 'input': {spec!r}}}",
                             validation=True)
        if kind == "json_schema":
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise BadRequest("schema_ is required for json_schema response format request.",
                                 kind="BadRequestError" if chat else "BadRequest")
            params["json_schema"] = json.dumps(schema)
        elif kind == "json_object":
            params["json_schema"] = '{"type": "object"}'
        elif kind == "structural_tag":
            params["structural_tag"] = json.dumps(fmt)
    return request_grammar(params)


def _grammar_error(ctx: Request, rid: str, exc: ConstraintError, stream: bool) -> None:
    """A grammar that does not compile: 400, or (streamed) sglang's one error chunk."""
    ctx.sim.log.error(f"{exc}, self.rid={rid!r}")
    if stream:
        ctx.stream(iter([{"error": {"object": "error", "message": str(exc), "type": "BAD_REQUEST", "param": None,
                                    "code": 400}}]))
    else:
        ctx.bad(BadRequest(str(exc)), openai=True)


def final_message(messages: list[dict[str, Any]], continue_final: bool) -> tuple[list[dict[str, Any]], str | None]:
    """sglang's ``_handle_last_assistant_message``: a last assistant message is the prefix the completion continues
    (``continue_final_message``: it leaves the conversation, whose prompt then ends with the generation prompt and
    the prefix's tokens) or, without the flag, becomes a user message. Nothing happens when the last message is not
    the assistant's (no error)."""
    if not messages or messages[-1].get("role") != "assistant":
        return messages, None
    text = message_text(messages[-1])
    if continue_final:
        return messages[:-1], text
    return [*messages[:-1], {"role": "user", "content": text}], None


def chat_prompt(sim: Sim, req: dict[str, Any]) -> tuple[list[int], list[int]]:
    """A chat request's prompt (its messages through the model's chat template, with the generation prompt, or
    sglang's ``input_ids`` extra) and the tokens its generation is seeded from: ``(prompt, source)``."""
    messages = req["messages"]
    texts = [message_text(m) for m in messages]
    messages, prefix = final_message(messages, bool(req.get("continue_final_message")))
    if not messages:
        raise BadRequest("Cannot apply chat template to an empty conversation. Provide at least one message.",
                         kind="BadRequest")
    ids = req.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return list(ids), list(ids)  # sglang's extra: the prompt's tokens, in place of the rendered template
    if sim.vocab.real:
        prompt = sim.vocab.encode(render_chat(messages, sim.plan.model.chat_template), add_special_tokens=False)
        if prefix:
            prompt += sim.vocab.encode(prefix, add_special_tokens=False)
        return prompt, sim.vocab.encode(" ".join(texts), add_special_tokens=False)
    prompt = sim.vocab.encode(" ".join(texts))
    return prompt, prompt


def chat_generations(sim: Sim, req: dict[str, Any], rid: str) -> tuple[list[Generation], list[int]]:
    """A chat request's ``n`` generations and its prompt, after sglang's checks in sglang's order (the request's
    messages are a non-empty list of messages): ``/v1/chat/completions``' and ``/v1/messages``'. Raises
    :class:`BadRequest`, :class:`Abort` (the PD handshake) and :class:`ConstraintError`."""
    not_generation(sim)
    max_tokens, stop, ignore_eos, n = _openai_params(req)
    chat_options(req)
    context = sim.plan.args.get("context_length")  # the flag's value: None without --context-length
    if max_tokens and context and max_tokens > context and not sim.plan.args.get("allow_auto_truncate"):
        # serving_chat's _validate_request, before the prompt is tokenized (its missing space included)
        raise BadRequest(f"max_completion_tokens is too large: {max_tokens}.This model supports at most "
                         f"{context} completion tokens.")
    grammar = openai_grammar(req, chat=True)
    prompt, source = chat_prompt(sim, req)
    max_tokens = check_length(sim, prompt, max_tokens)
    verify_sampling(_openai_sampling(req, max_tokens), sim.vocab.vocab_size, as_float=True)
    server_features(sim, req)
    output = constrained_text(grammar, prompt_seed(prompt))
    stop_ids, stop_regex = stop_options(req)
    gens = [sim.generate(prompt, source, max_tokens, stop, ignore_eos, stop_ids, constraint=output,
                         stop_regex=stop_regex, sampling=Sampling.of(req, seed_key="seed")) for _ in range(n)]
    handshake(sim, req, rid, gens[0])
    return gens, prompt


def chat(ctx: Request) -> None:
    sim = ctx.sim
    rid = sim.new_id()
    try:
        req = ctx.parse_json(require_json_type=True, endpoint="/v1/chat/completions")
        if "messages" not in req:
            raise missing("messages", "/v1/chat/completions", req)
        messages = req["messages"]
        if not isinstance(messages, list):
            raise BadRequest("1 validation error:\n  messages: Input should be a valid list", validation=True)
        if not messages:
            raise BadRequest("Messages cannot be empty.")
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            raise BadRequest("1 validation error:\n  messages: each message must be an object with a role",
                             validation=True)
        gens, prompt = chat_generations(sim, req, rid)
    except BadRequest as exc:
        ctx.bad(exc, openai=True)
        return
    except Abort as exc:
        ctx.abort(exc)
        return
    except ConstraintError as exc:
        _grammar_error(ctx, rid, exc, bool(req.get("stream")))
        return
    if sim.mode == "prefill":
        for gen in gens:
            gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
    model = req.get("model") or sim.plan.served_model_name
    created = int(time.time())
    usage = openai_usage(gens[0].prompt_tokens, sum(g.completion_tokens for g in gens))
    want_logprobs = bool(req.get("logprobs"))
    top_n = int(req.get("top_logprobs") or 0)
    sglext: dict[str, Any] = {}
    if req.get("return_input_ids_in_sglext"):
        sglext["input_ids"] = prompt
    if req.get("return_output_ids_in_sglext"):
        sglext["output_ids"] = [g.output_ids for g in gens]
    if req.get("stream"):
        include_usage, continuous = _stream_usage(sim, req)
        ctx.stream(chat_events(sim, gens, rid, created, model, usage if include_usage else None,
                               want_logprobs, top_n, continuous=continuous, sglext=sglext,
                               hidden=bool(req.get("return_hidden_states"))))
        return
    started = time.perf_counter()
    pace(sim, max(g.completion_tokens for g in gens))
    choices = []
    for index, gen in enumerate(gens):
        reason, matched = gen.openai_finish()
        probs = None
        if want_logprobs:
            probs = {"content": [openai_chat_logprob(sim.vocab, gen, k, top_n) for k in range(gen.completion_tokens)
                                 if gen.output_ids[k] != sim.vocab.eos_token_id or gen.finish["type"] != "stop"]}
        choices.append({"index": index, "message": {"role": "assistant", "content": gen.text,
                                                    "reasoning_content": None},
                        "logprobs": probs, "finish_reason": reason, "matched_stop": matched})
        if req.get("return_prompt_token_ids") or req.get("return_token_ids"):
            choices[-1]["prompt_token_ids"] = gen.prompt_ids
        if req.get("return_token_ids"):
            choices[-1]["response_token_ids"] = gen.output_ids
        if req.get("return_meta_info"):
            choices[-1]["meta_info"] = _meta_info(rid, gen, started)
        if req.get("return_hidden_states"):
            choices[-1]["hidden_states"] = _hidden_state(sim, gen)
    answer = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
              "usage": usage, "metadata": {"weight_version": "default", "weight_versions": [
                  {"version": "default", "start": 0, "end": gens[0].completion_tokens}]}}
    if sglext:
        answer["sglext"] = sglext
    ctx.json(200, answer)


def _meta_info(rid: str, gen: Generation, started: float) -> dict[str, Any]:
    """A choice's ``meta_info`` (``return_meta_info``): the engine's, as ``/generate`` answers it."""
    k = gen.completion_tokens
    return {"id": rid, "finish_reason": gen.finish, "prompt_tokens": gen.prompt_tokens, "weight_version": "default",
            "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": k, "cached_tokens": gen.cached_tokens,
            "weight_versions": [{"version": "default", "start": 0, "end": k}],
            "cached_tokens_details": {"device": gen.cached_tokens, "host": 0} if gen.cached_tokens else None,
            "dp_rank": None, "e2e_latency": time.perf_counter() - started, "response_sent_to_client_ts": time.time()}


def chat_events(sim: Sim, gens: list[Generation], rid: str, created: int, model: str, usage: dict[str, Any] | None,
                want_logprobs: bool, top_n: int, *, continuous: bool = False,
                sglext: dict[str, Any] | None = None, hidden: bool = False) -> Iterator[dict[str, Any]]:
    def chunk(index: int, delta: dict[str, Any], probs: Any = None, reason: str | None = None,
              matched: Any = None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": probs, "finish_reason": reason,
                             "matched_stop": matched}]}

    vocab = sim.vocab
    for index, gen in enumerate(gens):
        yield chunk(index, {"reasoning_content": None, "role": "assistant", "content": ""})
        for k, text in enumerate(gen.deltas()):
            if gen.finish["type"] == "stop" and k == gen.completion_tokens - 1 \
                    and gen.output_ids[k] == vocab.eos_token_id:
                continue
            pace(sim, 1)
            probs = {"content": [openai_chat_logprob(vocab, gen, k, top_n)]} if want_logprobs else None
            event = chunk(index, {"reasoning_content": None, "content": text}, probs)
            if continuous:
                event["usage"] = openai_usage(gen.prompt_tokens, k + 1)
            yield event
        reason, matched = gen.openai_finish()
        yield chunk(index, {"reasoning_content": None}, None, reason, matched)
    for index, gen in enumerate(gens if hidden else []):  # after every choice's end, one chunk each
        yield chunk(index, {"role": None, "content": None, "reasoning_content": None,
                            "hidden_states": _hidden_state(sim, gen)})
    if sglext:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": None, "sglext": sglext}
    if usage is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": usage}


def _completion_prompts(sim: Sim, raw: Any, req: dict[str, Any]) -> list[tuple[str, list[int]]]:
    vocab = sim.vocab
    if isinstance(raw, str):
        return [(raw, vocab.encode(raw))]
    if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        return [(p, vocab.encode(p)) for p in raw]
    if isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        return [(vocab.decode(raw, skip_special_tokens=False), list(raw))]
    if isinstance(raw, list) and raw and all(isinstance(r, list) and all(isinstance(i, int) for i in r)
                                             for r in raw):
        return [(vocab.decode(r, skip_special_tokens=False), list(r)) for r in raw]
    raise BadRequest("1 validation error:\n  prompt: Input should be a string, a list of strings, or token ids",
                     validation=True)


def completions(ctx: Request) -> None:
    sim = ctx.sim
    rid = sim.new_id()
    try:
        req = ctx.parse_json(require_json_type=True, endpoint="/v1/completions")
        if "prompt" not in req:
            raise missing("prompt", "/v1/completions", req)
        not_generation(sim)
        prompts = _completion_prompts(sim, req["prompt"], req)
        max_tokens, stop, ignore_eos, n = _openai_params(req)
        if max_tokens is None:
            max_tokens = 16  # the OpenAI completions default
        if max_tokens <= 0:
            raise BadRequest("1 validation error:\n  {'type': 'value_error', 'loc': ('body', 'max_tokens'), 'msg': "
                             "'Value error, max_tokens must be positive', 'input': " f"{max_tokens}, 'ctx': "
                             "{'error': ValueError('max_tokens must be positive')}}\n\n    POST /v1/completions",
                             validation=True)
        max_tokens = min(check_length(sim, ids, max_tokens) for _, ids in prompts)
        verify_sampling(_openai_sampling(req, max_tokens), sim.vocab.vocab_size, as_float=True)
        server_features(sim, req)
        grammar = openai_grammar(req, chat=False)
        echo = bool(req.get("echo", False))
        top = req.get("logprobs")
        want_logprobs = top is not None and top is not False
        top_n = int(top) if num(top) else 0
        gens: list[tuple[str, Generation]] = []
        stop_ids, stop_regex = stop_options(req)
        for text, ids in prompts:
            output = constrained_text(grammar, prompt_seed(ids))
            for _ in range(n):
                gens.append((text, sim.generate(ids, None, max_tokens, stop, ignore_eos, stop_ids, constraint=output,
                                                stop_regex=stop_regex, sampling=Sampling.of(req, seed_key="seed"))))
        handshake(sim, req, rid, gens[0][1])
    except BadRequest as exc:
        ctx.bad(exc, openai=True)
        return
    except Abort as exc:
        ctx.abort(exc)
        return
    except ConstraintError as exc:
        _grammar_error(ctx, rid, exc, bool(req.get("stream")))
        return
    if sim.mode == "prefill":
        for _, gen in gens:
            gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
    model = req.get("model") or sim.plan.served_model_name
    created = int(time.time())
    usage = openai_usage(sum(g.prompt_tokens for _, g in gens[::n]), sum(g.completion_tokens for _, g in gens))
    token_ids = bool(req.get("return_token_ids"))
    if req.get("stream"):
        include_usage, continuous = _stream_usage(sim, req)
        stream_usage = openai_usage(usage["prompt_tokens"], usage["completion_tokens"], details=False)
        ctx.stream(_completion_events(sim, gens, echo, rid, created, model,
                                      stream_usage if include_usage else None, want_logprobs, top_n,
                                      continuous=continuous, token_ids=token_ids,
                                      hidden=bool(req.get("return_hidden_states"))))
        return
    pace(sim, max(g.completion_tokens for _, g in gens))
    choices = []
    for index, (text, gen) in enumerate(gens):
        reason, matched = gen.openai_finish()
        out = text + gen.text if echo else gen.text
        probs = openai_completion_logprobs(sim.vocab, gen, top_n, echo=echo) if want_logprobs else None
        choices.append({"index": index, "text": out, "logprobs": probs, "finish_reason": reason,
                        "matched_stop": matched})
        if token_ids:
            choices[-1].update(token_ids=gen.output_ids, prompt_token_ids=gen.prompt_ids)
        if req.get("return_hidden_states"):
            choices[-1]["hidden_states"] = _hidden_state(sim, gen)
    ctx.json(200, {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": choices, "usage": usage,
                   "metadata": {"weight_version": "default", "weight_versions": [
                       {"version": "default", "start": 0, "end": gens[0][1].completion_tokens}]}})


def _completion_events(sim: Sim, gens: list[tuple[str, Generation]], echo: bool, rid: str, created: int, model: str,
                       usage: dict[str, Any] | None, want_logprobs: bool, top_n: int, *,
                       continuous: bool = False, token_ids: bool = False,
                       hidden: bool = False) -> Iterator[dict[str, Any]]:
    def chunk(index: int, text: str, probs: Any, reason: str | None = None, matched: Any = None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": index, "text": text, "logprobs": probs, "finish_reason": reason,
                             "matched_stop": matched}], "usage": None}

    vocab = sim.vocab
    for index, (text, gen) in enumerate(gens):
        deltas = gen.deltas() or [""]
        reason, matched = gen.openai_finish()
        for k, delta in enumerate(deltas):
            pace(sim, 1)
            last = k == len(deltas) - 1
            if echo and k == 0:
                delta = text + delta
            probs = (openai_completion_logprobs(vocab, gen, top_n, echo=echo and k == 0, indices=[k])
                     if want_logprobs and gen.output_ids else None)
            event = chunk(index, delta, probs, reason if last else None, matched if last else None)
            if token_ids:
                event["choices"][0]["token_ids"] = gen.output_ids[k:k + 1]
                if k == 0:
                    event["choices"][0]["prompt_token_ids"] = gen.prompt_ids
            if continuous:
                event["usage"] = openai_usage(gen.prompt_tokens, min(k + 1, gen.completion_tokens))
            yield event
    for index, (_, gen) in enumerate(gens if hidden else []):  # after every choice's end, one chunk each
        event = chunk(index, "", None)
        event["choices"][0]["hidden_states"] = _hidden_state(sim, gen)
        yield event
    if usage is not None:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": usage}


def responses(ctx: Request) -> None:
    sim = ctx.sim
    try:
        req = ctx.parse_json(require_json_type=True, endpoint="/v1/responses")
        if "input" not in req:
            raise missing("input", "/v1/responses", req)
        not_generation(sim)
        raw = req["input"]
        if isinstance(raw, str):
            messages = [{"role": "user", "content": raw}]
        elif isinstance(raw, list):
            messages = [m for m in raw if isinstance(m, dict)]
        else:
            raise BadRequest("1 validation error:\n  input: Input should be a string or a list", validation=True)
        if req.get("instructions"):
            messages = [{"role": "system", "content": str(req["instructions"])}, *messages]
        max_tokens = int_field(req.get("max_output_tokens"), "max_output_tokens")
        if sim.vocab.real:
            prompt = sim.vocab.encode(render_chat(messages, sim.plan.model.chat_template), add_special_tokens=False)
            source = sim.vocab.encode(" ".join(message_text(m) for m in messages), add_special_tokens=False)
        else:
            prompt = source = sim.vocab.encode(" ".join(message_text(m) for m in messages))
        max_tokens = check_length(sim, prompt, max_tokens)
        verify_sampling(_openai_sampling(req, max_tokens), sim.vocab.vocab_size, as_float=True)
        gen = sim.generate(prompt, source, max_tokens, [], False)
    except BadRequest as exc:
        if exc.validation:
            ctx.json(400, {"error": {"message": str(exc), "type": "Bad Request", "param": None, "code": 400}})
        else:
            ctx.openai_error(400, str(exc))
        return
    pace(sim, gen.completion_tokens)
    status = "completed" if gen.finish["type"] == "stop" else "incomplete"
    ctx.json(200, {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "model": req.get("model") or sim.plan.served_model_name,
        "output": [{"id": f"msg_{uuid.uuid4().hex}", "content": [
            {"annotations": [], "text": gen.text, "type": "output_text", "logprobs": None}],
            "role": "assistant", "status": "completed", "type": "message"}],
        "status": status,
        "usage": {"input_tokens": gen.prompt_tokens,
                  "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
                  "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": gen.prompt_tokens + gen.completion_tokens},
        "parallel_tool_calls": True, "tool_choice": req.get("tool_choice", "auto"), "tools": [],
        "error": None, "incomplete_details": None, "instructions": req.get("instructions"),
        "max_output_tokens": max_tokens, "previous_response_id": req.get("previous_response_id"),
        "reasoning": None, "store": req.get("store", True), "temperature": req.get("temperature"),
        "text": {"format": {"type": "text"}}, "top_p": req.get("top_p"), "truncation": req.get("truncation"),
        "user": req.get("user"), "metadata": req.get("metadata"),
    })


def _embed_inputs(sim: Sim, raw: Any) -> list[list[int]]:
    vocab = sim.vocab
    if isinstance(raw, str):
        if not raw:
            raise BadRequest("Input cannot be empty")
        return [vocab.encode(raw)]
    if isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
        if not all(raw):
            raise BadRequest("Input cannot be empty")
        return [vocab.encode(t) for t in raw]
    if isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        return [list(raw)]
    if isinstance(raw, list) and raw and all(isinstance(r, list) for r in raw):
        return [list(r) for r in raw]
    raise BadRequest("Input cannot be empty")


def embeddings(ctx: Request) -> None:
    sim = ctx.sim
    plan = sim.plan
    try:
        req = ctx.parse_json(require_json_type=True, endpoint="/v1/embeddings")
        if "input" not in req:
            raise missing("input", "/v1/embeddings", req)
        if not plan.is_embedding:
            raise BadRequest(NOT_EMBEDDING)
        embedding_options(req)
        server_features(sim, req)
        if req.get("dimensions") is not None:
            raise BadRequest(f"Model '{plan.served_model_name}' does not support matryoshka representation, "
                             "changing output dimensions will lead to poor results.")
        inputs = _embed_inputs(sim, req["input"])
        for ids in inputs:
            check_length(sim, ids, None)
    except BadRequest as exc:
        ctx.bad(exc, openai=True)
        return
    b64 = req.get("encoding_format") == "base64"
    data = []
    for index, ids in enumerate(inputs):
        vector = embedding(ids, plan.hidden_size)
        data.append({"embedding": embedding_base64(vector) if b64 else vector, "index": index,
                     "object": "embedding"})
    prompt = sum(len(ids) for ids in inputs)
    ctx.json(200, {"data": data, "model": plan.served_model_name, "object": "list",
                   "usage": openai_usage(prompt, 0)})


ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/v1/chat/completions", chat, inference=True),
    Route(("POST",), "/v1/completions", completions, inference=True),
    Route(("POST",), "/v1/responses", responses, inference=True),
    Route(("POST",), "/v1/embeddings", embeddings, inference=True),
    Route(("GET",), "/v1/models", models),
    Route(("GET",), "/v1/models/", model_card, prefix=True),
)
