"""What every route of the simulated engine's HTTP server shares: the route record, the request context with its
replies (JSON, plain bodies, server-sent events, the error envelopes), sglang's request checks, and the
request-fault hook.

Part of :mod:`pytest_sglworker.sim`; stdlib only. Shapes and error envelopes follow the real server (checked by
``tests/sim/test_sim_differential.py`` against the real engine on the CPU): ``/generate`` errors are ``{"error":
{"message": ...}}``, the OpenAI endpoints' are ``{"object": "error", "message", "type": "BadRequestError",
"param": null, "code": 400}``, a body that fails FastAPI's validation (bad JSON, a missing field, a wrong content
type) is the same envelope with ``"type": "Bad Request"`` and a pydantic-like message, and an abort with another
status (a PD handshake timeout) has ``"type": "<status>"``.
"""

from __future__ import annotations

import itertools
import json
import re
import socketserver
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler
from typing import Any, TypeGuard

from ..core import ENV_FAULT
from ..faults import RequestFaults
from ..state import Sim

#: sglang's answer to an embedding request on a generation model.
NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. Please add `--is-embedding` "
                 "when launching the server or try another model.")


class BadRequest(Exception):
    """A request the real server refuses with 400; ``validation``: FastAPI's validation (type "Bad Request");
    ``kind``: the OpenAI envelope's type otherwise (``BadRequest`` for a ``ValueError`` the OpenAI adapters raise
    while they convert the request, ``BadRequestError`` for one the engine raises)."""

    def __init__(self, message: str, *, validation: bool = False, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.validation = validation
        self.kind = kind


class Abort(Exception):
    """A request aborted with another status (sglang's HTTPException shape)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Route:
    """One endpoint: the methods and the path it answers (``prefix``: every path under ``path``, for these methods
    only), the function that answers it, whether it is an inference request (the request faults apply, and
    ``die_after`` counts it), and when it exists (``when``: e.g. ``/metrics`` only with ``--enable-metrics``)."""

    methods: tuple[str, ...]
    path: str
    answer: Callable[[Request], None]
    inference: bool = False
    prefix: bool = False
    when: Callable[[Sim], bool] | None = None


class RouteTable:
    """The routes one server serves, looked up by path."""

    def __init__(self, routes: Iterable[Route], sim: Sim) -> None:
        self.exact: dict[str, Route] = {}
        self.prefixed: list[Route] = []
        for route in routes:
            if route.when is not None and not route.when(sim):
                continue
            if route.prefix:
                self.prefixed.append(route)
            elif route.path in self.exact:
                raise ValueError(f"two routes for {route.path}")
            else:
                self.exact[route.path] = route

    def __contains__(self, path: object) -> bool:
        return path in self.exact

    def find(self, path: str, method: str) -> Route | None:
        """The route of ``path`` (whatever the method: the caller answers 405), else a prefix route that takes
        this method, else None (404)."""
        route = self.exact.get(path)
        if route is None:
            for candidate in self.prefixed:
                if path.startswith(candidate.path) and method in candidate.methods:
                    return candidate
        return route


# ---------------------------------------------------------------------------------------------- request


class Request:
    """One HTTP request as a route sees it: the sim's state, the method, path, headers and body, and the replies.
    The replies go out through the handler (its status line, its ``X-SGLSim-Worker`` header, its trickle)."""

    def __init__(self, handler: BaseHTTPRequestHandler, sim: Sim, body: bytes = b"") -> None:
        self.handler = handler
        self.sim = sim
        self.body = body

    @property
    def command(self) -> str:
        return self.handler.command

    @property
    def path(self) -> str:
        """The request target as sent (query string included)."""
        return self.handler.path

    @property
    def headers(self) -> Message:
        return self.handler.headers

    @property
    def server(self) -> socketserver.BaseServer:
        return self.handler.server

    def close(self) -> None:
        """Close the connection after this response."""
        self.handler.close_connection = True

    # ------------------------------------------------------------------ replies

    def send(self, status: int, body: bytes, content_type: str | None = "application/json") -> None:
        h = self.handler
        h.send_response(status)
        if content_type:
            h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
        h.wfile.flush()

    def json(self, status: int, obj: Any) -> None:
        self.send(status, json.dumps(obj).encode())

    def openai_error(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        self.json(status, {"object": "error", "message": message, "type": kind, "param": None, "code": status})

    def bad(self, exc: BadRequest, *, openai: bool) -> None:
        if exc.validation:
            self.openai_error(400, str(exc), "Bad Request")
        elif openai:
            self.openai_error(400, str(exc), exc.kind)
        else:
            self.json(400, {"error": {"message": str(exc)}})
        self.sim.log.error(f"[http_server] Error: {exc}")

    def abort(self, exc: Abort) -> None:
        self.openai_error(exc.status, str(exc), str(exc.status))

    def stream(self, events: Iterator[Any]) -> None:
        """Server-sent events, chunked: ``data: {json}\\n\\n`` per event, then ``data: [DONE]\\n\\n``."""
        frames = (b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)
        self.sse(itertools.chain(frames, [b"data: [DONE]\n\n"]))

    def sse(self, frames: Iterable[bytes]) -> None:
        """A ``text/event-stream`` answer, chunked, one chunk per frame as given (each frame its own lines, ending
        with a blank line)."""
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream; charset=utf-8")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for data in frames:
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()

    # ------------------------------------------------------------------ request parsing

    def parse_json(self, *, require_json_type: bool, endpoint: str) -> dict[str, Any]:
        """The body as a JSON object, checked as FastAPI does; raises :class:`BadRequest`."""
        if require_json_type:
            media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                detail = "Unsupported Media Type: Only 'application/json' is allowed"
                raise BadRequest(f"1 validation error:\n  {{'loc': ['header', 'content-type'], 'msg': \"{detail}\", "
                                 f"'type': 'value_error'}} [{{'loc': ['header', 'content-type'], 'msg': \"{detail}\", "
                                 "'type': 'value_error'}]", validation=True)
        try:
            obj = json.loads(self.body or b"null")
        except ValueError as exc:
            pos, msg = getattr(exc, "pos", 0), getattr(exc, "msg", str(exc))
            raise BadRequest(f"1 validation error:\n  {{'type': 'json_invalid', 'loc': ('body', {pos}), 'msg': "
                             f"'JSON decode error', 'input': {{}}, 'ctx': {{'error': {msg!r}}}}}\n\n"
                             f"    POST {endpoint}", validation=True) from None
        if not isinstance(obj, dict) and not (endpoint == "/generate" and obj is None):
            raise BadRequest(f"1 validation error:\n  {{'type': 'model_attributes_type', 'loc': ('body',), 'msg': "
                             f"'Input should be a valid dictionary or object to extract fields from'}}\n\n"
                             f"    POST {endpoint}", validation=True)
        return obj if isinstance(obj, dict) else {}


# ---------------------------------------------------------------------------------------------- checks


def num(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_stop_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise BadRequest("1 validation error:\n  stop: Input should be a valid string or a list of strings",
                     validation=True)


def stop_options(params: dict[str, Any]) -> tuple[list[int] | None, list[str]]:
    """A request's ``stop_token_ids`` and ``stop_regex`` (one pattern or a list; the sim leaves out a pattern
    Python's ``re`` cannot compile)."""
    ids = params.get("stop_token_ids")
    raw = params.get("stop_regex")
    patterns = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    usable = []
    for pattern in patterns:
        try:
            if isinstance(pattern, str) and pattern and re.compile(pattern):
                usable.append(pattern)
        except re.error:
            continue
    tokens = [i for i in ids if isinstance(i, int)] if isinstance(ids, list) else None
    return tokens, usable


def int_field(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"1 validation error:\n  {name}: Input should be a valid integer, got {value!r}",
                         validation=True)
    return value


def missing(field: str, endpoint: str, req: dict[str, Any]) -> BadRequest:
    return BadRequest(f"1 validation error:\n  {{'type': 'missing', 'loc': ('body', {field!r}), 'msg': "
                      f"'Field required', 'input': {req!r}}}\n\n    POST {endpoint}", validation=True)


def verify_sampling(params: dict[str, Any], vocab_size: int, *, as_float: bool) -> None:
    """sglang's ``SamplingParams.verify`` (same order, same messages); ``as_float``: the OpenAI endpoints,
    whose pydantic models hold floats (``got -1.0.``), where ``/generate`` keeps the JSON value (``got -1.``)."""

    def shown(value: Any) -> Any:
        return float(value) if as_float and num(value) else value

    temperature = params.get("temperature", 1.0)
    if temperature is not None and (not num(temperature) or temperature != temperature
                                    or abs(temperature) == float("inf") or temperature < 0):
        raise BadRequest(f"temperature must be a non-negative finite number, got {shown(temperature)}.")
    top_p = params.get("top_p", 1.0)
    if top_p is not None and num(top_p) and not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {shown(top_p)}.")
    min_p = params.get("min_p", 0.0)
    if min_p is not None and num(min_p) and not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {shown(min_p)}.")
    top_k = params.get("top_k", -1)
    if num(temperature) and 0 <= temperature < 1e-6:
        top_k = 1  # sglang's normalization: a greedy request samples the top token, whatever its top_k
    if top_k is not None and num(top_k) and top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = params.get(name, 0.0)
        if value is not None and num(value) and not -2.0 <= value <= 2.0:
            raise BadRequest(f"{name} must be in [-2, 2], got {shown(value)}.")
    repetition = params.get("repetition_penalty", 1.0)
    if repetition is not None and num(repetition) and not 0.0 < repetition <= 2.0:
        raise BadRequest(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {shown(repetition)}.")
    min_new = params.get("min_new_tokens", 0) or 0
    if num(min_new) and min_new < 0:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    max_new = params.get("max_new_tokens")
    if num(max_new):
        if max_new < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
        if num(min_new) and min_new > max_new:
            raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for token_id in bias:
            try:
                token = int(token_id)
            except (TypeError, ValueError):
                raise BadRequest(f"invalid literal for int() with base 10: {token_id!r}") from None
            if not 0 <= token < vocab_size:
                raise BadRequest(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")


def check_length(sim: Sim, ids: list[int], max_new_tokens: Any) -> Any:
    """sglang's input-length checks: the tokenizer manager's (context length, then input + max new tokens),
    then the scheduler's (``max_req_input_len``). Returns the max new tokens to generate: under
    ``--allow-auto-truncate`` each check truncates instead of refusing, as sglang's do (``ids`` in place, to the
    context length and then to ``max_req_input_len``; max new tokens to what the context leaves, at least 0)."""
    plan = sim.plan
    n, context = len(ids), plan.context_len
    truncate = bool(plan.args.get("allow_auto_truncate"))
    if n >= context and truncate:
        del ids[context:]
        n = len(ids)
    elif n >= context:
        raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({context} tokens).")
    if num(max_new_tokens) and max_new_tokens + n > context and truncate:
        max_new_tokens = max(0, context - n)
    elif num(max_new_tokens) and max_new_tokens + n > context:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
            f"requested a total of {max_new_tokens + n} tokens: {n} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.")
    if n >= plan.max_req_input_len and truncate:
        del ids[plan.max_req_input_len:]
    elif n >= plan.max_req_input_len:
        raise BadRequest(f"Input length ({n} tokens) exceeds the maximum allowed length ({plan.max_req_input_len} "
                         "tokens). Use a shorter input or enable --allow-auto-truncate.")
    return max_new_tokens


def not_generation(sim: Sim) -> None:
    if sim.plan.is_embedding:
        raise BadRequest("This model is served with --is-embedding and does not generate; use /encode or "
                         "/v1/embeddings (sglang 0.5.23 itself crashes its scheduler on this request)")


def pace(sim: Sim, tokens: int) -> None:
    """The simulated time to generate ``tokens`` tokens (``SGLSIM_TOKEN_SECONDS``), one at a time: the request's
    sequences grow in ``/v1/loads`` as they go."""
    if not tokens:
        return
    step_us = int(sim.token_seconds * 1e6)
    if not sim.token_seconds:
        sim.loads.advance(tokens, step_us)
        return
    start = time.monotonic()
    for k in range(1, tokens + 1):
        delay = start + sim.token_seconds * k - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sim.loads.advance(1, step_us)


def openai_usage(prompt: int, completion: int, *, details: bool = True) -> dict[str, Any]:
    """The OpenAI ``usage`` object."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                           "completion_tokens": completion}
    if details:
        out["prompt_tokens_details"] = None
    out["reasoning_tokens"] = 0
    if details:
        out["completion_tokens_details"] = None
    return out


# ---------------------------------------------------------------------------------------------- request faults


def request_faults(ctx: Request, faults: RequestFaults) -> bool:
    """Death on arrival, latency, hangs and failures of an inference request; False when it was answered (or
    never is)."""
    sim = ctx.sim
    k, verdict, status = sim.state.next_request()
    if verdict == "die":
        sim.die(arrived=k)
    if faults.latency:
        with sim.loads.queued(len(ctx.body) // 4):  # about a token per 4 bytes of the body: it is not parsed yet
            time.sleep(faults.latency)
    if verdict == "hang":
        sim.log.info(f"(sim) request {k} hangs ({ENV_FAULT})")
        while not sim.shutting_down:
            time.sleep(0.05)
        ctx.close()
        return False
    if verdict == "fail":
        ctx.openai_error(status, f"simulated failure of request {k} ({ENV_FAULT}: {fault_text(faults)})", str(status))
        return False
    return True


def fault_text(faults: RequestFaults) -> str:
    """The failure faults in force, as in ``SGLSIM_FAULT``."""
    parts = []
    if faults.fail_first:
        parts.append(f"fail_first={faults.fail_first}")
    if faults.fail_rate:
        parts.append(f"fail_rate={faults.fail_rate}")
    if faults.status is not None:
        parts.append(f"status={faults.status}")
    return ",".join(parts)
