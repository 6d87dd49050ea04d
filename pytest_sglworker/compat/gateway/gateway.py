"""Upstream's ``Gateway``: the real sglang router (``sglang-router``), started by the plugin through
:func:`pytest_sglworker.workers.router.start_router` (loopback only, ports from the plugin's port blocks, its own log
file, its readiness, its figures in the run report), with upstream's methods over its HTTP API."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..models import CompatError
from .constants import DEFAULT_ROUTER_TIMEOUT, THIRD_PARTY_MODELS
from .runtime import ModelInstance, runtime_or_error

if TYPE_CHECKING:
    from ...workers.launcher import ModelInstance as Member
    from ...workers.router import Router

__all__ = ["Gateway", "WorkerInfo", "wait_for_health", "wait_for_workers_ready"]


@dataclass
class WorkerInfo:
    """A worker as the router lists it (``GET /workers``)."""

    id: str
    url: str
    model: str | None = None
    status: str = "unknown"
    pending_requests: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)


class Gateway:
    """Upstream's ``Gateway``: the real sglang router, started by the plugin. ``start(worker_urls=..., model_path=...
    | prefill_workers=..., decode_workers=... | igw_mode=True | cloud_backend=..., policy=, timeout=,
    extra_args=)``, ``shutdown()``, ``health()``, ``get_metrics()``, ``list_workers()``, ``get_worker()``,
    ``add_worker()``, ``remove_worker()``, ``list_models()``; ``base_url``, ``metrics_url``, ``port`` and ``process``
    once started (the plugin reserves its ports, so they are not known before). ``router`` is the plugin's
    :class:`~pytest_sglworker.workers.router.Router` (its log, its worker API)."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, prometheus_port: int | None = None) -> None:
        if host not in ("127.0.0.1", "localhost"):
            raise CompatError(f"Gateway(host={host!r}): the plugin's routers listen on 127.0.0.1 only")
        if port is not None or prometheus_port is not None:
            raise CompatError("Gateway(port=..., prometheus_port=...): the plugin reserves the router's ports from "
                              "its port blocks (shared across xdist workers); read gateway.port after start()")
        self._rt = runtime_or_error("infra.Gateway")
        self.host = "127.0.0.1"
        self.router: Router | None = None
        self.owner = self._rt.current_owner()
        self.model_path: str | None = None
        self.policy = "round_robin"
        self.pd_mode = self.igw_mode = self.cloud_mode = False
        self.cloud_backend: str | None = None

    # -- where it listens ---------------------------------------------------------------------------------
    def _started(self) -> Router:
        if self.router is None:
            raise CompatError("this Gateway is not started: call gateway.start(...) first (the plugin reserves its "
                              "ports when it starts)")
        return self.router

    @property
    def port(self) -> int:
        return self._started().port

    @property
    def prometheus_port(self) -> int:
        return int(self._started().ports["prometheus"])

    @property
    def base_url(self) -> str:
        return self._started().url

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.prometheus_port}"

    @property
    def process(self) -> Any:
        return self.router.process if self.router is not None else None

    @property
    def is_running(self) -> bool:
        return self.router is not None and self.router.is_alive()

    # -- life -----------------------------------------------------------------------------------------------
    def start(self, *, worker_urls: Sequence[str] | None = None, model_path: str | None = None,
              prefill_workers: Sequence[ModelInstance] | None = None,
              decode_workers: Sequence[ModelInstance] | None = None, igw_mode: bool = False,
              cloud_backend: str | None = None, history_backend: str = "memory", policy: str = "round_robin",
              timeout: float = DEFAULT_ROUTER_TIMEOUT, show_output: bool | None = None,
              extra_args: Sequence[str] | None = None) -> None:
        """Start the router in one of upstream's four modes (regular, PD, IGW, cloud); ready when it returns."""
        del show_output  # the router always logs to its own file (sglang-router-<port>.log), shown on failure
        if self.router is not None:
            raise RuntimeError("Gateway already started")
        pd = prefill_workers is not None or decode_workers is not None
        modes = sum([pd, worker_urls is not None, bool(igw_mode), cloud_backend is not None])
        if modes != 1:
            raise ValueError("Must specify one mode: worker_urls (regular), prefill/decode_workers (PD), "
                             "igw_mode=True, or cloud_backend" if modes == 0 else
                             "Cannot specify multiple modes. Choose one of: worker_urls (regular), "
                             "prefill/decode_workers (PD), igw_mode, or cloud_backend")
        if isinstance(extra_args, str):
            raise CompatError(f"Gateway.start(extra_args=...) is a list of arguments, not the string {extra_args!r}")
        args = [str(a) for a in extra_args or ()]
        self.policy = policy
        members: list[Member] = []
        if pd:
            self.pd_mode = True
            members = [self._rt.member_of(inst) for inst in (*(prefill_workers or ()), *(decode_workers or ()))]
        elif igw_mode:
            self.igw_mode = True
            args = ["--enable-igw", *args]
        elif cloud_backend is not None:
            if cloud_backend not in THIRD_PARTY_MODELS:
                raise ValueError(f"Unsupported cloud backend: {cloud_backend}")
            key_env = THIRD_PARTY_MODELS[cloud_backend]["api_key_env"]
            if not os.environ.get(key_env):
                raise ValueError(f"{key_env} environment variable required")
            self.cloud_mode, self.cloud_backend = True, cloud_backend
            args = ["--backend", "openai", "--worker-urls", THIRD_PARTY_MODELS[cloud_backend]["worker_url"],
                    "--history-backend", history_backend, *args]
        else:
            if model_path is None:
                raise ValueError("model_path is required for regular mode")
            self.model_path = model_path
            members = [self._rt.member_by_url(str(url)) for url in worker_urls or ()]
        self.router = self._rt.start_router(self, members, policy=policy, args=args, timeout=timeout)

    def shutdown(self) -> None:
        if self.router is not None:
            self._rt.close_router(self)

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- its APIs -------------------------------------------------------------------------------------------
    def _get(self, path: str, timeout: float) -> Any:
        import httpx

        try:
            resp = httpx.get(f"{self.base_url}{path}", timeout=timeout)
        except httpx.HTTPError:
            return None
        return resp if resp.status_code == 200 else None

    def health(self, timeout: float = 5.0) -> bool:
        return self._get("/health", timeout) is not None

    def get_metrics(self, timeout: float = 5.0) -> str | None:
        import httpx

        try:
            resp = httpx.get(f"{self.metrics_url}/metrics", timeout=timeout)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    @staticmethod
    def _info(w: dict[str, Any]) -> WorkerInfo:
        return WorkerInfo(id=w.get("id", ""), url=w.get("url", ""), model=w.get("model_id"),
                          status="healthy" if w.get("is_healthy", False) else "unhealthy",
                          pending_requests=w.get("load", 0),
                          metadata={k: w.get(k) for k in ("worker_type", "connection_mode", "priority", "cost",
                                                          "disable_health_check")})

    def list_workers(self, timeout: float = 5.0) -> list[WorkerInfo]:
        resp = self._get("/workers", timeout)
        return [self._info(w) for w in resp.json().get("workers", [])] if resp is not None else []

    def get_worker(self, worker_id: str, timeout: float = 5.0) -> WorkerInfo | None:
        resp = self._get(f"/workers/{worker_id}", timeout)
        return self._info(resp.json()) if resp is not None else None

    def add_worker(self, worker_url: str, timeout: float = 10.0, wait_ready: bool = True,
                   ready_timeout: float = 60.0) -> tuple[bool, str | None]:
        """``POST /workers``; with ``wait_ready``, wait (bounded) until the router lists it."""
        import httpx

        try:
            resp = httpx.post(f"{self.base_url}/workers", json={"url": worker_url}, timeout=timeout)
        except httpx.HTTPError as exc:
            return False, str(exc)
        if resp.status_code not in (200, 202):
            return False, resp.text
        worker_id = resp.json().get("worker_id")
        if not (wait_ready and worker_id):
            return True, worker_id
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if any(w.id == worker_id for w in self.list_workers()):
                return True, worker_id
            time.sleep(0.2)
        return False, f"Worker {worker_id} not ready within {ready_timeout}s"

    def remove_worker(self, worker_url: str, timeout: float = 10.0) -> tuple[bool, str]:
        import httpx

        found = next((w.id for w in self.list_workers(timeout=timeout) if w.url == worker_url), None)
        if not found:
            return False, f"Worker with URL {worker_url} not found"
        try:
            resp = httpx.delete(f"{self.base_url}/workers/{found}", timeout=timeout)
        except httpx.HTTPError as exc:
            return False, str(exc)
        if resp.status_code not in (200, 202):
            return False, resp.text
        # sglang-router 0.3.2 queues the removal (202): done once the router no longer lists the worker
        deadline = time.monotonic() + timeout
        while any(w.id == found for w in self.list_workers()):
            if time.monotonic() >= deadline:
                return False, f"Worker {found} still listed {timeout}s after its removal was accepted"
            time.sleep(0.1)
        return True, "Worker removed"

    def list_models(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        resp = self._get("/v1/models", timeout)
        return list(resp.json().get("data", [])) if resp is not None else []

    def __repr__(self) -> str:
        return f"<infra.Gateway {self.router.describe() if self.router is not None else '(not started)'}>"


def wait_for_health(base_url: str, timeout: float = 60.0) -> None:
    """Wait (bounded by ``timeout`` for the whole wait) until ``GET base_url/health`` answers 200."""
    _wait(base_url, timeout, lambda resp: True, "healthy")


def wait_for_workers_ready(base_url: str, num_workers: int, timeout: float = 60.0) -> None:
    """Wait (bounded) until the router at ``base_url`` lists ``num_workers`` healthy workers."""
    def enough(_: Any) -> bool:
        import httpx

        resp = httpx.get(f"{base_url}/workers", timeout=5.0)
        workers = resp.json().get("workers", []) if resp.status_code == 200 else []
        return sum(1 for w in workers if w.get("is_healthy")) >= num_workers

    _wait(base_url, timeout, enough, f"{num_workers} healthy workers")


def _wait(base_url: str, timeout: float, done: Any, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            resp = httpx.get(f"{base_url}/health", timeout=max(0.1, min(5.0, left)))
            if resp.status_code == 200 and done(resp):
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{base_url} not {what} within {timeout}s")
        time.sleep(0.2)


