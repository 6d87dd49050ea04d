"""The simulated engine's Anthropic-compatible endpoints: ``/v1/messages`` (streamed or not) and
``/v1/messages/count_tokens``, as sglang 0.5.23 serves them (``sglang/srt/entrypoints/anthropic``).

Part of :mod:`pytest_sglworker.sim`; stdlib only. Like sglang, the Messages request is checked as its pydantic
model (a failure: 400 with Anthropic's envelope ``{"type": "error", "error": {"type": "invalid_request_error",
"message": "<loc>: <msg>; ..."}}``), converted to a chat completion request (the ``system`` text first, then the
messages: a list content's text blocks, a user's ``tool_result`` a ``tool`` message, ``stop_sequences`` the
``stop``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``) and generated as ``/v1/chat/completions``
generates it (:func:`.openai.chat_generations`), then answered as a message: one ``text`` block (``""`` when the
answer is empty), ``stop_reason`` ``end_turn``/``max_tokens`` (a stop sequence is an ``end_turn`` too, without
``stop_sequence``), ``usage`` ``input_tokens``/``output_tokens``. Streamed, the chat's own chunks (usage in every
one) are translated event by event as sglang translates them: ``message_start`` at the first chunk with content or
usage, one ``text`` block (``content_block_start``, a ``text_delta`` per non-empty delta, ``content_block_stop``),
``message_delta`` with the stop reason and the output tokens, ``message_stop``; ``event:`` and ``data:`` lines,
no ``[DONE]``. ``count_tokens`` counts the chat prompt of the same conversion.

A check of the chat request fails as sglang's adapters fail it: its own checks (``Messages cannot be empty.``) and
a ``ValueError`` of the conversion are 400 ``invalid_request_error``; an error of the engine is 400 with the OpenAI
envelope's type (``BadRequestError``) or, streamed, a 200 stream of ``message_start``, an ``error`` event and
``message_stop``. What the sim does not convert: images and search results (dropped), tool definitions,
``tool_choice``, ``thinking`` and ``output_config`` (accepted, not acted on).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .common import Abort, BadRequest, Request, Route, pace
from .openai import chat_events, chat_generations, chat_prompt

#: sglang's STOP_REASON_MAP (any other finish reason is an ``end_turn``).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
#: sglang's ERROR_TYPE_MAP (any other status is an ``api_error``).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "request_timeout_error", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "api_error"}
_BLOCKS = ("text", "image", "tool_use", "tool_result", "tool_reference", "search_result", "thinking",
           "redacted_thinking")
_ROLES = ("user", "assistant", "system")


class Invalid(Exception):
    """A request sglang's pydantic model refuses: the ``(location, message)`` of each error."""

    def __init__(self, *errors: tuple[str, str]) -> None:
        super().__init__("; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in errors))


def _error(ctx: Request, status: int, kind: str, message: str) -> None:
    ctx.json(status, {"type": "error", "error": {"type": kind, "message": message}})


def _body(ctx: Request) -> dict[str, Any]:
    """The body as FastAPI reads it for sglang's route: the JSON first (when the content type says JSON), then the
    route's ``validate_json_request`` (the content type: a body without one is refused whatever it holds), then the
    model's fields."""
    media = (ctx.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    obj: Any = ctx.body
    if media == "application/json" or media.endswith("+json"):
        try:
            obj = json.loads(ctx.body or b"null")
        except ValueError as exc:
            raise Invalid((str(getattr(exc, "pos", 0)), "JSON decode error")) from None
    if media != "application/json":
        raise Invalid(("header.content-type", "Unsupported Media Type: Only 'application/json' is allowed"))
    if not isinstance(obj, dict):
        raise Invalid(("", "Input should be a valid dictionary or object to extract fields from"))
    return obj


def _content(value: Any, loc: str) -> Any:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise Invalid((f"{loc}.str", "Input should be a valid string"),
                      (f"{loc}.list[tagged-union[{','.join(_BLOCKS)}]]", "Input should be a valid list"))
    for k, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCKS:
            raise Invalid((f"{loc}.list[tagged-union[{','.join(_BLOCKS)}]].{k}",
                           f"Input tag '{kind}' found using 'type' does not match any of the expected tags: "
                           + ", ".join(f"'{b}'" for b in _BLOCKS)))
        if kind == "text" and not isinstance(block.get("text"), str):
            raise Invalid((f"{loc}.list[tagged-union[{','.join(_BLOCKS)}]].{k}.text.text",
                           "Field required" if "text" not in block else "Input should be a valid string"))
    return value


def _checked(req: dict[str, Any], *, count: bool) -> None:
    """The fields sglang's ``AnthropicMessagesRequest`` (``count``: ``AnthropicCountTokensRequest``) checks."""
    errors: list[tuple[str, str]] = []
    fields = ("model", "messages") if count else ("model", "messages", "max_tokens")
    for name in fields:
        if name not in req:
            errors.append((name, "Field required"))
    if "model" in req and not isinstance(req["model"], str):
        errors.append(("model", "Input should be a valid string"))
    elif not count and req.get("model") == "":
        errors.append(("model", "Value error, Model is required"))
    messages = req.get("messages")
    if "messages" in req and not isinstance(messages, list):
        errors.append(("messages", "Input should be a valid list"))
    for k, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict):
            errors.append((f"messages.{k}", "Input should be a valid dictionary or instance of AnthropicMessage"))
            continue
        if message.get("role") not in _ROLES:
            errors.append((f"messages.{k}.role", "Input should be 'user', 'assistant' or 'system'"))
        if "content" not in message:
            errors.append((f"messages.{k}.content", "Field required"))
    if not count and "max_tokens" in req:
        value = req["max_tokens"]
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(("max_tokens", "Input should be a valid integer"))
        elif value <= 0:
            errors.append(("max_tokens", "Value error, max_tokens must be positive"))
    if errors:
        raise Invalid(*errors)
    for k, message in enumerate(req["messages"]):
        _content(message["content"], f"messages.{k}.content")
    if req.get("system") is not None:
        _content(req["system"], "system")


def _texts(blocks: list[dict[str, Any]]) -> str:
    return " ".join(b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str))


def chat_request(req: dict[str, Any]) -> dict[str, Any]:
    """sglang's ``_convert_to_chat_completion_request`` of a checked Messages request, as far as the sim
    generates from it."""
    messages: list[dict[str, Any]] = []
    system = req.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list):
        parts = [b["text"] for b in system if b.get("type") == "text" and b.get("text")]
        if parts:
            messages.append({"role": "system", "content": "\n".join(parts)})
    for message in req["messages"]:
        role, content = message["role"], message["content"]
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        parts, calls = [], []
        for block in content:
            kind = block["type"]
            if kind == "text":
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                result = block.get("content")
                text = result if isinstance(result, str) else _texts(result) if isinstance(result, list) else ""
                if role == "user":
                    if parts:
                        messages.append({"role": "user", "content": list(parts)})
                        parts.clear()
                    messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or block.get("id")
                                     or "", "content": text})
                else:
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
        out: dict[str, Any] = {"role": role}
        if calls:
            out["tool_calls"] = calls
        if parts:
            out["content"] = parts[0]["text"] if len(parts) == 1 else parts
        elif not calls and role == "user":
            continue
        elif not calls:
            out["content"] = ""
        messages.append(out)
    chat: dict[str, Any] = {"messages": messages, "model": req["model"], "max_tokens": req.get("max_tokens"),
                            "stream": bool(req.get("stream"))}
    for name, to in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                     ("stop_sequences", "stop")):
        if req.get(name) is not None:
            chat[to] = req[name]
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def _usage(usage: dict[str, Any] | None, *, input_tokens: bool, output: bool, zero_output: bool = False
           ) -> dict[str, int]:
    """sglang's ``_anthropic_usage_from_openai`` (the input tokens are the prompt's less its cached ones)."""
    if usage is None:
        return {**({"input_tokens": 0} if input_tokens else {}), **({"output_tokens": 0} if output else {})}
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    out: dict[str, int] = {}
    if input_tokens:
        out["input_tokens"] = max((usage.get("prompt_tokens") or 0) - cached, 0)
        if cached:
            out["cache_read_input_tokens"] = cached
    if output:
        out["output_tokens"] = 0 if zero_output else (usage.get("completion_tokens") or 0)
    return out


def _frame(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def _message(msg_id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None,
             usage: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": msg_id, "type": "message", "role": "assistant", "content": content,
                           "model": model}
    if stop_reason is not None:
        out["stop_reason"] = stop_reason
    out["usage"] = usage
    return out


def anthropic_events(chunks: Iterator[dict[str, Any]], model: str) -> Iterator[bytes]:
    """sglang's ``_generate_anthropic_stream`` over a chat stream's chunks (text only), then its ``[DONE]``."""
    msg_id = f"msg_{uuid.uuid4().hex}"
    started, block_open, had_content, index = False, False, False, 0
    finish: str | None = None
    final: dict[str, int] | None = None

    def start(usage: dict[str, Any] | None) -> bytes:
        nonlocal started
        started = True
        return _frame({"type": "message_start", "message": _message(
            msg_id, model, [], None, _usage(usage, input_tokens=True, output=True, zero_output=True))})

    for chunk in chunks:
        usage = chunk.get("usage")
        if usage is not None:
            final = _usage(usage, input_tokens=False, output=True)
        choices = chunk.get("choices") or []
        if not choices:
            continue
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            finish = choice["finish_reason"]
        text = choice["delta"].get("content")
        if (text or usage or choice.get("finish_reason") is not None) and not started:
            yield start(usage)
        if text:
            if not block_open:
                block_open = True
                yield _frame({"type": "content_block_start", "index": index,
                              "content_block": {"type": "text", "text": ""}})
            yield _frame({"type": "content_block_delta", "index": index,
                          "delta": {"type": "text_delta", "text": text}})
            had_content = True
    if not started:
        yield start(None)
    if not had_content and finish is None:  # never, as the sim streams: sglang's answer to a silent backend
        yield _frame({"type": "error", "error": {"type": "api_error", "message": "Backend produced no content"}})
        yield _frame({"type": "message_stop"})
        return
    if block_open:
        yield _frame({"type": "content_block_stop", "index": index})
    yield _frame({"type": "message_delta", "delta": {"stop_reason": STOP_REASONS.get(finish or "stop", "end_turn")},
                  "usage": final or {"output_tokens": 0}})
    yield _frame({"type": "message_stop"})


def _stream_error(kind: str, message: str, model: str) -> Iterator[bytes]:
    """sglang's stream after the chat stream's error chunk: ``message_start``, the error, ``message_stop``."""
    yield _frame({"type": "message_start", "message": _message(
        f"msg_{uuid.uuid4().hex}", model, [], None, {"input_tokens": 0, "output_tokens": 0})})
    yield _frame({"type": "error", "error": {"type": kind, "message": message}})
    yield _frame({"type": "message_stop"})


def _request(ctx: Request, *, count: bool) -> dict[str, Any] | None:
    """The checked request, or None once its 400 is answered."""
    try:
        req = _body(ctx)
        _checked(req, count=count)
    except Invalid as exc:
        _error(ctx, 400, "invalid_request_error", str(exc))
        return None
    return req


def messages(ctx: Request) -> None:
    sim = ctx.sim
    rid = sim.new_id()
    req = _request(ctx, count=False)
    if req is None:
        return
    chat = chat_request(req)
    stream, model = chat["stream"], req["model"]
    if not chat["messages"]:
        _error(ctx, 400, "invalid_request_error", "Messages cannot be empty.")
        return
    try:
        gens, _ = chat_generations(sim, chat, rid)
    except BadRequest as exc:
        if exc.validation or exc.kind == "BadRequest":  # the conversion's ValueError
            _error(ctx, 400, "invalid_request_error", str(exc))
        elif stream:
            ctx.sse(_stream_error("invalid_request_error", str(exc), model))
        else:
            _error(ctx, 400, exc.kind, str(exc))
        return
    except Abort as exc:
        _error(ctx, exc.status, ERROR_TYPES.get(exc.status, "api_error"),
               "Internal server error" if exc.status >= 500 else str(exc))
        return
    gen = gens[0]
    if sim.mode == "prefill":
        gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
    usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
             "prompt_tokens_details": None}
    if stream:
        ctx.sse(anthropic_events(chat_events(sim, [gen], rid, int(time.time()), model, usage, False, 0,
                                             continuous=True), model))
        return
    pace(sim, gen.completion_tokens)
    reason, _ = gen.openai_finish()
    ctx.json(200, _message(f"msg_{uuid.uuid4().hex}", model, [{"type": "text", "text": gen.text}],
                           STOP_REASONS.get(reason, "end_turn"),
                           _usage(usage, input_tokens=True, output=True)))


def count_tokens(ctx: Request) -> None:
    sim = ctx.sim
    req = _request(ctx, count=True)
    if req is None:
        return
    if req["model"] == "":
        _error(ctx, 400, "invalid_request_error", "1 validation error for AnthropicMessagesRequest\nmodel\n  "
               "Value error, Model is required")
        return
    try:
        prompt, _ = chat_prompt(sim, chat_request({**req, "max_tokens": 1}))
    except BadRequest as exc:
        _error(ctx, 400, "invalid_request_error", str(exc))
        return
    ctx.json(200, {"input_tokens": len(prompt)})


ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/v1/messages", messages, inference=True),
    Route(("POST",), "/v1/messages/count_tokens", count_tokens),
)
