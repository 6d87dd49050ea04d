"""Attached workers: a spec's tests run against an sglang worker that is already running
(``--sgl-worker-url NAME=URL``), instead of one the plugin launches.

Plain Python, no pytest. An attached worker is never leased, never stopped and never restarted by the
plugin. Before the first test uses it the plugin proves three things, each with a whole-request deadline:

- it answers ``/health_generate`` (a real generation; else a usage error naming the option and the URL);
- it serves the spec's model (``model_path`` or ``served_model_name`` of ``/server_info``, falling back to
  ``/get_server_info`` of older sglang releases);
- it keeps the mandatory budget: ``mem_fraction_static`` at most 0.6 and ``cuda_graph_backend_prefill``
  ``disabled``, read from the same ``/server_info``. A test may opt out with
  ``@pytest.mark.sgl_budget_opt_out(reason=...)``, exactly as for extra args.

This is the one place where a worker may live on another machine: the URL's host is used as given, and only
because the user named it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..engine.budget import MAX_FRACTION, BudgetProblem
from ..engine.sglang_facts import HEALTH_PATH, SERVER_INFO_PATHS
from ..errors import SglWorkerError
from .errors import WorkerError

if TYPE_CHECKING:
    import httpx

    from ..engine.specs import ModelSpec

__all__ = ["AttachedWorker", "AttachedWorkerError", "WorkerUrl", "attach", "parse_worker_urls"]

#: seconds for each of the checks made before the first test (health, server info)
PROBE_TIMEOUT = 10.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class AttachedWorkerError(SglWorkerError):
    """An attached worker cannot be used as given (down, another model, a malformed URL)."""


@dataclass(frozen=True)
class WorkerUrl:
    """One ``NAME=URL`` of ``--sgl-worker-url``."""

    name: str
    url: str
    host: str
    port: int
    tls: bool

    def __str__(self) -> str:
        return f"{self.name}={self.url}"


def parse_worker_url(value: str) -> WorkerUrl:
    """``qwen3-0.6b=http://10.0.0.5:30000`` -> WorkerUrl; a ValueError says what is wrong."""
    name, sep, url = value.strip().partition("=")
    name, url = name.strip(), url.strip().rstrip("/")
    if not sep or not name or not url:
        raise ValueError(f"{value!r} is not NAME=URL (a model spec name and the worker's URL, e.g. "
                         "qwen3-0.6b=http://127.0.0.1:30000)")
    if not _NAME.match(name):
        raise ValueError(f"{value!r}: {name!r} is not a model spec name")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{value!r}: the URL must start with http:// or https:// (an attached worker is reached "
                         "over HTTP)")
    if not parts.hostname:
        raise ValueError(f"{value!r}: the URL names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{value!r}: give the worker's base URL, without a path ({parts.path!r})")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{value!r}: the port is not a number in 1-65535") from None
    return WorkerUrl(name, url, parts.hostname, port, parts.scheme == "https")


def parse_worker_urls(values: Sequence[str]) -> dict[str, tuple[WorkerUrl, ...]]:
    """Every ``NAME=URL`` (comma- or newline-separated within a value), grouped by name in the order given;
    one URL given twice is an error (two members of a group would be one worker)."""
    found: dict[str, list[WorkerUrl]] = {}
    seen: set[str] = set()
    for chunk in values:
        for item in chunk.replace("\n", ",").split(","):
            if not item.strip():
                continue
            parsed = parse_worker_url(item)
            if parsed.url in seen:
                raise ValueError(f"{parsed.url} is given twice")
            seen.add(parsed.url)
            found.setdefault(parsed.name, []).append(parsed)
    return {name: tuple(urls) for name, urls in found.items()}


def _get(target: WorkerUrl, path: str, timeout: float) -> tuple[int, bytes]:
    from .health import http_request

    response = http_request(target.host, target.port, path, deadline=time.monotonic() + timeout, tls=target.tls)
    return response.status, response.body


def _model_matches(spec_model: str, info: Mapping[str, Any]) -> bool:
    """The worker serves the spec's model: the same id or path, or the same last path component (a hub id
    ``Qwen/Qwen3-0.6B`` served from ``/models/Qwen3-0.6B``), case-insensitive."""
    def last(value: str) -> str:
        return value.rstrip("/").rsplit("/", 1)[-1].lower()

    served = [str(info.get(k) or "") for k in ("model_path", "served_model_name", "tokenizer_path")]
    return any(s and (s == spec_model or last(s) == last(spec_model)) for s in served)


def budget_problems(info: Mapping[str, Any]) -> list[BudgetProblem]:
    """Problems with the budget a running worker reports in its server info."""
    problems: list[BudgetProblem] = []
    fraction = info.get("mem_fraction_static")
    if not isinstance(fraction, int | float):
        problems.append(BudgetProblem("--mem-fraction-static", f"the worker reports {fraction!r}, not a number"))
    elif fraction > MAX_FRACTION:
        problems.append(BudgetProblem("--mem-fraction-static", f"the worker runs with {fraction:g}, above the "
                                                               f"budget of {MAX_FRACTION}"))
    prefill = info.get("cuda_graph_backend_prefill", "<not reported>")
    if prefill != "disabled":
        problems.append(BudgetProblem("--cuda-graph-backend-prefill", f"the worker runs with {prefill!r} (must be "
                                                                      "'disabled')"))
    return problems


@dataclass
class AttachedWorker:
    """A running worker the plugin did not start. It offers what tests use of a launched worker (``url``,
    ``host``, ``port``, ``client``, ``responds()``, ``log_tail()``, ``server_info``), and refuses to be
    stopped: its life belongs to whoever started it."""

    target: WorkerUrl
    spec: ModelSpec
    server_info: dict[str, Any] = field(default_factory=dict, repr=False)
    problems: list[BudgetProblem] = field(default_factory=list, repr=False)
    index: int = 0
    tail_lines: int = 40
    _client: httpx.Client | None = field(default=None, repr=False)

    # what the fixtures, the router and the reports read of any worker
    role = "worker"
    bootstrap_port: int | None = None
    gpus: str | None = None
    pid: int | None = None
    returncode: int | None = None
    startup_seconds: float | None = None
    log_path: str | None = None
    stopped = False
    attached = True

    @property
    def url(self) -> str:
        return self.target.url

    @property
    def host(self) -> str:
        return self.target.host

    @property
    def port(self) -> int:
        return self.target.port

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def argv(self) -> list[str]:
        """The launch command the worker reports (empty when it does not)."""
        return str(self.server_info.get("launch_command") or "").split()

    @property
    def pids_seen(self) -> set[int]:
        return set()

    @property
    def warnings(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"attached worker {self.spec.name} at {self.url}"

    def __str__(self) -> str:
        return self.describe()

    def responds(self, timeout: float | None = None) -> bool:
        """Answers ``/health_generate`` with 200 within ``timeout`` seconds (the whole request; default 5)."""
        try:
            status, _ = _get(self.target, HEALTH_PATH, 5.0 if timeout is None else timeout)
        except OSError:
            return False
        return status == 200

    def is_alive(self) -> bool:
        """Whether it still answers: the plugin cannot watch a process it did not start."""
        return self.responds()

    def log_tail(self, lines: int = 40) -> str:
        return (f"(no log: {self.describe()} was started outside this test session; its log is wherever it "
                "runs)")

    def log_text(self, max_bytes: int = 0) -> str:
        return ""

    @property
    def client(self) -> httpx.Client:
        """An ``httpx.Client`` on the worker's URL (closed at the end of the session)."""
        import httpx

        if self._client is None:
            self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(60.0, connect=10.0))
        return self._client

    def failure(self, kind: type[WorkerError], event: str, **_: Any) -> WorkerError:
        return kind(worker=self.describe(), event=event, extra=self.log_tail())

    def failure_message(self, what: str, **_: Any) -> str:
        return f"{self.describe()} {what}"

    def stop(self, **_: Any) -> list[int]:
        raise AttachedWorkerError(f"{self.describe()} is attached: the plugin never stops a worker it did not "
                                  "start (stop it where it runs, or launch one: drop --sgl-worker-url)")

    def kill(self, sig: int = 9) -> None:
        self.stop()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def attach(target: WorkerUrl, spec: ModelSpec, *, source: str = "--sgl-worker-url", index: int = 0,
           timeout: float = PROBE_TIMEOUT, tail_lines: int = 40) -> AttachedWorker:
    """Prove ``target`` is up and serves ``spec``'s model; read its budget. Raises AttachedWorkerError with
    the option, the URL and the fix when it is down or serves another model; budget problems are returned on
    the worker (the session decides: a test may opt out)."""
    where = f"{source} {target}"
    try:
        status, body = _get(target, HEALTH_PATH, timeout)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise AttachedWorkerError(f"{where}: the worker does not answer {HEALTH_PATH} within {timeout:g} s "
                                  f"({reason}); start it, or drop the option to let the plugin launch one") from None
    if status != 200:
        raise AttachedWorkerError(f"{where}: {HEALTH_PATH} answers {status} ({body[:200].decode(errors='replace')!r}):"
                                  " the worker is not healthy")
    info: dict[str, Any] | None = None
    for path in SERVER_INFO_PATHS:
        try:
            status, body = _get(target, path, timeout)
        except OSError as exc:
            raise AttachedWorkerError(f"{where}: {path} did not answer within {timeout:g} s ({exc})") from None
        if status == 404:
            continue
        try:
            decoded = json.loads(body)
        except ValueError:
            decoded = None
        if status != 200 or not isinstance(decoded, dict):
            raise AttachedWorkerError(f"{where}: {path} answers {status} with no server info; is this an sglang "
                                      "worker?")
        info = decoded
        break
    if info is None:
        raise AttachedWorkerError(f"{where}: neither {' nor '.join(SERVER_INFO_PATHS)} exists; is this an sglang "
                                  "worker?")
    if not _model_matches(spec.model, info):
        served = info.get("served_model_name") or info.get("model_path")
        raise AttachedWorkerError(f"{where}: the worker serves {served!r}, but model spec {spec.name!r} is "
                                  f"{spec.model!r}; attach it under the spec of its model, or attach the right "
                                  "worker")
    return AttachedWorker(target, spec, info, budget_problems(info), index=index, tail_lines=tail_lines)
