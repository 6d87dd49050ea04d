"""The simulated engine's request control: ``/abort_request`` (one request by its id, or all) and the session
routes (``/open_session``, ``/close_session``, and ``/generate`` with ``session_params``), as sglang 0.5.23's
tokenizer manager and scheduler answer them.

Part of :mod:`pytest_sglworker.sim`; stdlib only. An abort sets the flag of every generation in flight whose id
starts with the given one (sglang's scheduler matches a prefix, after the tokenizer manager found the exact id);
the generation ends at its next token with ``finish_reason {"type": "abort", "message": "Aborted", ...}``, its
tokens so far kept. A session keeps each finished request of it by id; a later request that names one
(``session_params.rid``) is that request's prompt and output (``drop_previous_output``: its prompt only;
``offset``: cut there) followed by its own tokens (a leading BOS dropped), ``replace`` forgets the children of
the request it names (all of them without a rid); in a streaming session (``streaming: true``, with
``--enable-streaming-session``) each request continues the last one, and replace, offset and
``drop_previous_output`` are refused. What sglang refuses is its abort of the request
(:class:`~pytest_sglworker.sim.constrained.ConstraintError`: 400, or one abort chunk when streamed).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..constrained import ConstraintError
from ..state import Sim
from ..tokens import Generation
from .common import BadRequest, Request, Route

#: what a request ended by ``/abort_request`` finishes with (sglang's ``FINISH_ABORT()``)
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
OPEN_FAILED = "Failed to open the session. Check if a session with the same id is still open."
STREAMING_OFF = "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."


@dataclass
class _Node:
    prompt: list[int]
    output: list[int]
    parent: str | None


@dataclass
class Session:
    """One open session: its finished requests by id, and which request each continued."""

    capacity: int
    streaming: bool
    nodes: dict[str, _Node] = field(default_factory=dict)

    def forget_children(self, rid: str) -> None:
        for child in [k for k, node in self.nodes.items() if node.parent == rid]:
            self.forget_children(child)
            del self.nodes[child]


# ---------------------------------------------------------------------------------------------- abort


@contextmanager
def in_flight(sim: Sim, rids: list[str]) -> Iterator[list[threading.Event]]:
    """The abort flags of ``rids`` while their generations run."""
    flags = [threading.Event() for _ in rids]
    with sim.lock:
        sim.live.update(zip(rids, flags, strict=True))
    try:
        yield flags
    finally:
        with sim.lock:
            for rid, flag in zip(rids, flags, strict=True):
                if sim.live.get(rid) is flag:
                    del sim.live[rid]


def cut(gen: Generation, k: int) -> None:
    """End ``gen`` after its first ``k`` tokens, aborted."""
    gen.output_ids, gen.texts = gen.output_ids[:k], gen.texts[:k]
    gen.finish = dict(ABORTED)


def abort_request(ctx: Request) -> None:
    sim = ctx.sim
    try:
        req = ctx.parse_json(require_json_type=False, endpoint="/abort_request")
    except BadRequest as exc:
        ctx.bad(exc, openai=False)
        return
    rid, everything = str(req.get("rid") or ""), bool(req.get("abort_all"))
    with sim.lock:
        if everything or rid in sim.live:
            for live, flag in sim.live.items():
                if everything or live.startswith(rid):
                    flag.set()
    ctx.send(200, b"", None)


# ---------------------------------------------------------------------------------------------- sessions


def open_session(ctx: Request) -> None:
    sim = ctx.sim
    try:
        req = ctx.parse_json(require_json_type=False, endpoint="/open_session")
        capacity = req.get("capacity_of_str_len")
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            raise BadRequest("1 validation error:\n  capacity_of_str_len: Input should be a valid integer",
                             validation=True)
        if req.get("streaming") and not sim.plan.args.get("enable_streaming_session"):
            raise BadRequest(STREAMING_OFF)
    except BadRequest as exc:
        ctx.bad(exc, openai=False)
        return
    session_id = req.get("session_id")
    session_id = uuid.uuid4().hex if session_id is None else str(session_id)
    with sim.lock:
        if session_id in sim.sessions:
            sim.log.warning(f"session id {session_id} already exist, cannot open.")
            ctx.json(400, {"error": {"message": OPEN_FAILED}})
            return
        sim.sessions[session_id] = Session(capacity, bool(req.get("streaming")))
    sim.log.info(f"Session opened: {session_id} (active={len(sim.sessions)})")
    ctx.json(200, session_id)


def close_session(ctx: Request) -> None:
    sim = ctx.sim
    try:
        req = ctx.parse_json(require_json_type=False, endpoint="/close_session")
    except BadRequest as exc:
        ctx.bad(exc, openai=False)
        return
    session_id = str(req.get("session_id"))
    with sim.lock:
        found = sim.sessions.pop(session_id, None)
    if found is None:
        sim.log.warning(f"session id {session_id} does not exist, cannot delete.")
    ctx.send(200, b"", None)


def session_prompt(sim: Sim, params: Any, ids: list[int]) -> list[int]:
    """The prompt of a request in a session: the history it continues, then its own tokens."""
    if not isinstance(params, dict) or params.get("id") is None:
        return ids
    with sim.lock:
        session = sim.sessions.get(str(params["id"]))
        if session is None:
            raise ConstraintError(f"Invalid request: session id {params['id']} does not exist")
        rid, last = params.get("rid"), None
        if session.streaming:  # one request at a time, each continuing the last (sglang: only plain appends)
            for key, refusal in (("replace", "replace"), ("drop_previous_output", "drop_previous_output"),
                                 ("offset", "offset")):
                if params.get(key):
                    raise ConstraintError(f"Streaming sessions do not support {refusal}.")
            last = next(iter(session.nodes.values()), None)
        elif params.get("replace") and rid is None:
            session.nodes.clear()
        elif rid is not None:
            last = session.nodes.get(str(rid))
            if last is None:
                raise ConstraintError("Invalid request session id")
            if params.get("replace"):
                session.forget_children(str(rid))
    if last is None:
        prompt = list(ids)
    else:
        bos = getattr(sim.vocab, "bos_token_id", None)
        own = ids[1:] if ids and bos is not None and ids[0] == bos else list(ids)
        prompt = list(last.prompt) if params.get("drop_previous_output") else [*last.prompt, *last.output]
        offset = params.get("offset")
        prompt = prompt[:offset] + own if offset else prompt + own
    if not prompt:
        raise ConstraintError("A session request must contain input tokens after restoring history.")
    return prompt


def remember(sim: Sim, params: Any, rid: str, gen: Generation) -> None:
    """Keep a finished request of a session, as the one a later request may continue."""
    if not isinstance(params, dict) or params.get("id") is None:
        return
    with sim.lock:
        session = sim.sessions.get(str(params["id"]))
        if session is not None:
            if session.streaming:
                session.nodes.clear()  # the newest turn is the one the next continues
            parent = params.get("rid")
            session.nodes[rid] = _Node(list(gen.prompt_ids), list(gen.output_ids),
                                       None if parent is None else str(parent))


ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/abort_request", abort_request),
    Route(("GET", "POST"), "/open_session", open_session),
    Route(("GET", "POST"), "/close_session", close_session),
)
