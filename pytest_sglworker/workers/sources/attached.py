"""Attached workers: a spec's tests run against an sglang worker that is already running
(``--sgl-worker-url NAME=URL``), instead of one the plugin launches. :class:`AttachedSource` is the worker source
of this mode: the attached specs' tests get their workers; every other spec goes to the source it wraps.

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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from ...engine.budget import BudgetProblem, describe_violation, fraction_problem, show_number
from ...engine.sglang_facts import HEALTH_PATH, SERVER_INFO_PATHS
from ...errors import SglWorkerError
from ..errors import WorkerError
from ..group import WorkerGroup
from ..process import http_client
from .base import GroupRequest, GroupUse, Refusal, SourceRefusal, WorkerSource

if TYPE_CHECKING:
    import httpx

    from ...engine.specs import ModelSpec
    from ..config import WorkerConfig
    from ..launcher import ModelInstance
    from ..records import RunRecords

__all__ = ["AttachedSource", "AttachedWorker", "AttachedWorkerError", "WorkerUrl", "attach", "parse_worker_urls"]

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
    from ..health import http_request

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
    why = fraction_problem(fraction)  # NaN, infinity and non-numbers too
    if why:
        problems.append(BudgetProblem("--mem-fraction-static", f"the worker reports {show_number(fraction)}, {why}"
                                      if isinstance(fraction, bool) or not isinstance(fraction, int | float)
                                      else f"the worker runs with {show_number(fraction)}, {why}"))
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
    #: why its last health check failed (a refused connection, a malformed answer), for the failure that names it
    last_problem: str = field(default="", repr=False)

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
        except OSError as exc:  # a malformed answer too (health.ProtocolError): the worker's failure
            self.last_problem = str(exc) or type(exc).__name__
            return False
        self.last_problem = "" if status == 200 else f"it answers {status}"
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
        if self._client is None:
            self._client = http_client(self.url, connect=10.0)
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
    from ..health import ProtocolError

    where = f"{source} {target}"
    try:
        status, body = _get(target, HEALTH_PATH, timeout)
    except ProtocolError as exc:
        raise AttachedWorkerError(f"{where}: {HEALTH_PATH} answers with malformed HTTP ({exc}); is this an sglang "
                                  "worker?") from None
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
        except ProtocolError as exc:
            raise AttachedWorkerError(f"{where}: {path} answers with malformed HTTP ({exc}); is this an sglang "
                                      "worker?") from None
        except OSError as exc:
            raise AttachedWorkerError(f"{where}: {path} did not answer within {timeout:g} s ({exc})") from None
        if status == 404:
            continue
        try:
            decoded = json.loads(body)
        except ValueError:
            decoded = None
        except RecursionError:  # brackets nested deeper than the parser's stack: no server info either
            raise AttachedWorkerError(f"{where}: {path} answers with JSON nested too deeply to read, not server "
                                      "info; is this an sglang worker?") from None
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


#: the budget check's fix for an attached worker that breaks it
_RESTART_FIX = ("restart it with CI_WORKER_ARGS (--mem-fraction-static 0.6 --cuda-graph-backend-prefill disabled), "
                "or mark the test @pytest.mark.sgl_budget_opt_out(reason='why')")


class AttachedSource:
    """The attached workers of ``--sgl-worker-url`` for the specs they serve (probed once, on first use); every
    other spec, and every launch a test asks for itself (``sgl_spawn_worker``), goes to ``launching``."""

    name = "attached"

    def __init__(self, targets: Mapping[str, Sequence[WorkerUrl]], launching: WorkerSource, records: RunRecords, *,
                 option: str = "--sgl-worker-url", tail_lines: int = 40) -> None:
        self.targets = {name: tuple(urls) for name, urls in targets.items()}
        self.launching = launching
        self.records = records
        self.option = option
        self.tail_lines = tail_lines
        #: spec name -> its attached workers, or the error that makes them unusable (said once)
        self._attached: dict[str, list[AttachedWorker] | AttachedWorkerError] = {}

    def describe(self) -> str:
        attached = ", ".join(str(url) for urls in self.targets.values() for url in urls)
        return f"attached workers (never launched, leased or stopped): {attached}; others: {self.launching.describe()}"

    def serves(self, spec: ModelSpec) -> bool:
        return spec.name in self.targets

    def workers(self, spec: ModelSpec) -> list[AttachedWorker]:
        """The attached workers of ``spec``, proven up and serving its model on first use; the
        :class:`AttachedWorkerError` when they are not (remembered: the next test does not wait for it again)."""
        if spec.name not in self._attached:
            try:
                self._attached[spec.name] = [attach(t, spec, source=self.option, index=i, tail_lines=self.tail_lines)
                                             for i, t in enumerate(self.targets[spec.name])]
            except AttachedWorkerError as exc:
                self._attached[spec.name] = exc
        found = self._attached[spec.name]
        if isinstance(found, AttachedWorkerError):
            raise found
        return list(found)

    def refusal(self, config: WorkerConfig, *, opt_out: bool) -> Refusal | None:
        """Why a test cannot run on its spec's attached workers: a skip for a shape they cannot take (extra args
        or env, a prefill/decode group, more workers than attached), an error for a budget they break without
        an opt-out. Raises :class:`AttachedWorkerError` when they are down or serve another model."""
        if not self.serves(config.spec):
            return self.launching.refusal(config, opt_out=opt_out)
        workers = self.workers(config.spec)
        where = ", ".join(w.url for w in workers)
        name = config.spec.name
        if config.extra_args or config.env or (config.group is not None and (
                any(a for _, a in config.group.role_args) or config.group.per_member)):
            return Refusal("skip", f"{name} is attached ({where}): it runs as it was started, and this test's extra "
                                   f"args or env need a launched worker (drop --sgl-worker-url {name}=... to run it)")
        if config.group is not None and config.group.is_pd:
            return Refusal("skip", f"{name} is attached ({where}): this test needs a prefill/decode group")
        wanted = config.group.count if config.group is not None else 1
        if wanted > len(workers):
            return Refusal("skip", f"{name} is attached ({where}): this test needs {wanted} workers, {len(workers)} "
                                   f"attached (give --sgl-worker-url {name}=URL once per worker)")
        problems = [p for w in workers[:wanted] for p in w.problems]
        if problems and not opt_out:
            subject = "; ".join(f"attached worker {w.url}" for w in workers[:wanted] if w.problems)
            return Refusal("error", describe_violation(f"{subject} ({name}, {self.option})", problems,
                                                       fix=_RESTART_FIX))
        return None

    def acquire(self, request: GroupRequest) -> WorkerGroup:
        config = request.config
        if request.launch or not self.serves(config.spec):
            return self.launching.acquire(request)
        refusal = self.refusal(config, opt_out=request.budget_opt_out)
        if refusal is not None:
            raise SourceRefusal(refusal)
        wanted = config.group.count if config.group is not None else 1
        # An attached worker offers the surface of a launched one (url, client, responds, log_tail, ...).
        members = cast("list[ModelInstance]", self.workers(config.spec)[:wanted])
        group = WorkerGroup(config, members, f"attached-{config.key}")
        stats = self.records.stats_for(config.key, config.label, config.spec.model)
        if "(attached" not in stats.label:
            stats.label += f" (attached: {', '.join(w.url for w in group)})"
        stats.reuses += 1
        return group

    def give_back(self, group: WorkerGroup, use: GroupUse) -> SglWorkerError | None:
        """An attached worker that stops answering during a passing test fails it: the next tests would fail on
        it too, with less to go on."""
        if not group.id.startswith("attached-"):
            return self.launching.give_back(group, use)
        if use.failed or use.outcome == "skipped":
            return None
        silent = [m for m in group if not m.responds()]
        if silent:
            problem = getattr(silent[0], "last_problem", "")  # an AttachedWorker's (the group's members are)
            why = f" ({problem})" if problem else ""
            return SglWorkerError(f"{silent[0].describe()} stopped answering its health check during the test{why}")
        return None

    def launch_ahead(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str],
                     wait_retiring: bool = True) -> bool:
        if self.serves(config.spec):
            return False
        return self.launching.launch_ahead(config, holder=holder, environ=environ, wait_retiring=wait_retiring)

    def ahead_kit(self, config: WorkerConfig, *, holder: str, environ: Mapping[str, str]) -> Any:
        if self.serves(config.spec):
            return None
        return self.launching.ahead_kit(config, holder=holder, environ=environ)

    def launch_kit(self, kit: Any) -> bool:
        return self.launching.launch_kit(kit)

    def retire_idle(self, keys: Collection[str]) -> None:
        self.launching.retire_idle(keys)

    def hand_over_ahead(self) -> None:
        self.launching.hand_over_ahead()

    def hand_over_ready(self, keys: Collection[str]) -> None:
        self.launching.hand_over_ready(keys)

    def gpu_count(self) -> int | None:
        return self.launching.gpu_count()

    def close(self) -> None:
        try:
            for found in self._attached.values():
                if isinstance(found, list):
                    for worker in found:
                        worker.close()
        finally:
            self.launching.close()

