"""A router e2e suite needs no glue of its own: the workers and the real sglang router come from
pytest-sglworker's fixtures (``sgl_workers``, ``sgl_router``). This conftest only adds two helpers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest


def served_by(workers: Any) -> list[int]:
    """How many /generate and chat requests each worker answered, read from its own log (the engine logs
    every request it serves), so that routing can be checked without trusting the router."""
    marks = ('"POST /generate HTTP/1.1" 200', '"POST /v1/chat/completions HTTP/1.1" 200')
    return [sum(w.log_text().count(m) for m in marks) for w in workers]


def stream_chunks(response: Any) -> Iterator[dict[str, Any]]:
    """The JSON objects of an SSE stream, up to ``data: [DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


@pytest.fixture
def chat(sgl_router: Any) -> Any:
    def send(content: str, **params: Any) -> dict[str, Any]:
        resp = sgl_router.client.post("/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": content}], **params})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())
    return send
