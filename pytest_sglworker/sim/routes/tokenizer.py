"""The simulated engine's tokenizer and scoring endpoints: ``/tokenize``, ``/detokenize`` and ``/v1/score``.

Part of :mod:`pytest_sglworker.sim`; stdlib only. They use the model's tokenizer
(:mod:`pytest_sglworker.sim.tokens`: the real one for a model directory with a ``tokenizer.json`` when
``tokenizers`` is importable, else words); the scores are deterministic, seeded by the query and item tokens.
"""

from __future__ import annotations

from typing import Any

from ..tokens import label_scores, prompt_seed
from .common import BadRequest, Request, Route, missing, not_generation, openai_usage


def tokenize(ctx: Request) -> None:
    sim = ctx.sim
    try:
        req = ctx.parse_json(require_json_type=True, endpoint="/tokenize")
        if "prompt" not in req:
            raise missing("prompt", "/tokenize", req)
        prompt = req["prompt"]
        add = bool(req.get("add_special_tokens", True))
        if isinstance(prompt, str):
            tokens: Any = sim.vocab.encode(prompt, add_special_tokens=add)
            count: Any = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [sim.vocab.encode(p, add_special_tokens=add) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise BadRequest("1 validation error:\n  prompt: Input should be a valid string", validation=True)
    except BadRequest as exc:
        ctx.bad(exc, openai=True)
        return
    ctx.json(200, {"tokens": tokens, "count": count, "max_model_len": sim.plan.context_len})


def detokenize(ctx: Request) -> None:
    sim = ctx.sim
    try:
        req = ctx.parse_json(require_json_type=True, endpoint="/detokenize")
        if "tokens" not in req:
            raise missing("tokens", "/detokenize", req)
        tokens = req["tokens"]

        def ints(row: Any) -> bool:
            return isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)

        if not ints(tokens) and not (isinstance(tokens, list) and all(ints(row) for row in tokens)):
            raise BadRequest("1 validation error:\n  tokens: Input should be a valid list of integers",
                             validation=True)
    except BadRequest as exc:
        ctx.bad(exc, openai=True)
        return
    skip = bool(req.get("skip_special_tokens", True))
    try:
        if tokens and isinstance(tokens[0], list):  # a batch: one text per list
            text: Any = [sim.vocab.decode(row, skip_special_tokens=skip) for row in tokens]
        else:
            text = sim.vocab.decode(tokens, skip_special_tokens=skip) if tokens else ""
    except (OverflowError, ValueError, TypeError, IndexError, KeyError) as exc:  # e.g. a negative id: sglang's 500
        ctx.openai_error(500, f"Internal server error during detokenization: {exc}", "InternalServerError")
        return
    ctx.json(200, {"text": text})


def score(ctx: Request) -> None:
    sim = ctx.sim
    try:
        req = ctx.parse_json(require_json_type=True, endpoint="/v1/score")
        not_generation(sim)
        query, items = req.get("query"), req.get("items")
        labels = req.get("label_token_ids") or []
        if query is None or items is None:
            raise BadRequest("query and items are required")
        if isinstance(items, str):
            items = [items]
        if not isinstance(labels, list) or not all(isinstance(t, int) for t in labels):
            raise BadRequest("label_token_ids must be a list of token ids")
        for t in labels:
            if not 0 <= t < sim.vocab.vocab_size:
                raise BadRequest(f"Token ID {t} is out of vocabulary (vocab size: {sim.vocab.vocab_size})")
        item_first = bool(req.get("item_first", False))
        pairs = []
        for item in items:
            q = query if isinstance(query, list) else sim.vocab.encode(str(query))
            it = item if isinstance(item, list) else sim.vocab.encode(str(item))
            pairs.append(list(it) + list(q) if item_first else list(q) + list(it))
    except BadRequest as exc:
        ctx.bad(exc, openai=True)
        return
    softmax = bool(req.get("apply_softmax", False))
    scores = [label_scores(prompt_seed(ids), labels, softmax) for ids in pairs]
    prompt = sum(len(ids) for ids in pairs)
    ctx.json(200, {"scores": scores, "pooled_hidden_states": None, "token_logprobs": None,
                   "model": req.get("model") or "default", "usage": openai_usage(prompt, 0), "object": "scoring"})


ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/tokenize", tokenize),
    Route(("POST",), "/detokenize", detokenize),
    Route(("POST",), "/v1/score", score, inference=True),
)
