"""A toy router, standing in for the code under test of a router/gateway e2e suite: it forwards
OpenAI-style and native requests to a list of sglang workers, round-robin."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import httpx


class RoundRobinRouter:
    def __init__(self, worker_urls: Sequence[str], timeout: float = 60.0) -> None:
        if not worker_urls:
            raise ValueError("the router needs at least one worker")
        self.worker_urls = list(worker_urls)
        self._next = itertools.cycle(self.worker_urls)
        self._http = httpx.Client(timeout=timeout)
        self.routed: list[str] = []

    def _pick(self) -> str:
        url = next(self._next)
        self.routed.append(url)
        return url

    def chat(self, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
        resp = self._http.post(f"{self._pick()}/v1/chat/completions", json={"messages": messages, **params})
        resp.raise_for_status()
        return resp.json()  # type: ignore[no-any-return]

    def chat_stream(self, messages: list[dict[str, str]], **params: Any) -> Iterator[str]:
        body = {"messages": messages, "stream": True, **params}
        with self._http.stream("POST", f"{self._pick()}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    yield line[len("data: "):]

    def generate(self, text: str, max_new_tokens: int = 8) -> dict[str, Any]:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        resp = self._http.post(f"{self._pick()}/generate", json=body)
        resp.raise_for_status()
        return resp.json()  # type: ignore[no-any-return]

    def close(self) -> None:
        self._http.close()
