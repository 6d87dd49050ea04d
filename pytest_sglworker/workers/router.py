"""The real sglang router (``sglang-router`` on PyPI, a Rust binary that runs on a CPU) in front of a worker
group: launched, proven ready, reported and torn down like a worker.

Plain Python, no pytest (the ``sgl_router`` fixture calls :func:`start_router` with the session's
:class:`RouterOptions` and run records). The router:

- binds 127.0.0.1 on a port reserved across processes, and its Prometheus endpoint on 127.0.0.1 on the
  next port of the same block (the router's own defaults are 0.0.0.0:29000);
- logs to ``sglang-router-<port>.log`` beside the workers' logs, and is tagged and torn down by
  :mod:`pytest_sglworker.resources.processes` like every process the plugin starts;
- is in regular mode over the group's workers, PD mode (``--pd-disaggregation --prefill URL BOOTSTRAP_PORT
  --decode URL``) over a prefill/decode group, and ``--dp-aware`` when a worker has ``--dp-size`` > 1;
- is ready when ``GET /health`` answers 200 and ``GET /workers`` lists every worker healthy
  (:class:`RouterReadiness`); a router that exits or never gets ready fails at once with its log tail;
- in front of gRPC workers (``grpc://`` URLs) gets ``TIKTOKEN_ENCODINGS_BASE`` (:func:`router_env`): the
  router needs OpenAI's ``o200k_base.tiktoken`` to start its gRPC router, and finds the worker's tokenizer
  through the worker's ``GetModelInfo``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.diagnosis import Diagnosis, Kind
from ..engine.grpc_facts import ROUTER_VOCAB_ENV, ROUTER_VOCAB_HINT, router_vocab_dir
from ..engine.redaction import mask_argv
from ..engine.sglang_facts import LOOPBACK_HOST
from ..errors import SglWorkerError
from ..resources.processes import hostname, signal_name
from .errors import LaunchError, WorkerError, WorkerStartupError
from .health import Probe, ProbeTimeout, Readiness, Watched, http_request, wait_until_ready
from .kinds import data_parallel_size
from .launcher import check_launcher
from .process import ManagedProcess, inherited_environ, log_name, start_process
from .records import ConfigStats, LaunchRecord, RunRecords

if TYPE_CHECKING:
    from .group import WorkerGroup
    from .launcher import ModelInstance

__all__ = ["ROUTER_MODULE", "Router", "RouterOptions", "RouterReadiness", "RouterUnavailable", "igw_mode",
           "router_argv", "start_router"]

ROUTER_MODULE = "sglang_router.launch_router"
#: a line of the router's log that says why it stopped: its parser's error, a Rust panic, an error it logged
_ROUTER_ERROR = re.compile(r"(?:^|\s)(?:\S+: )?(?:error: |ERROR |panicked at )(?P<what>.+)$")
#: a line the router logs below the error level (``2026-12-04 23:42:36  WARN smg::...: error sending request ...``:
#: its tokenizer download, offline), which may quote an error it recovered from
_ROUTER_QUIET = re.compile(r"^\S+[ T]\S+\s+(?:TRACE|DEBUG|INFO|WARN)\b")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
INSTALL_HINT = "pip install 'pytest-sglworker[router]' (or: pip install sglang-router)"
#: How long a router may take to report every worker healthy (it starts in about half a second).
DEFAULT_ROUTER_TIMEOUT = 120.0
#: Ports of a router's block: its HTTP port and its Prometheus port.
ROUTER_PORTS = ("http", "prometheus")


class RouterUnavailable(SglWorkerError):
    """The router package is not installed (router tests are skipped with the install command)."""


@dataclass(frozen=True)
class RouterOptions:
    """How the session launches routers: everything that is not the group or the test's router marker."""

    log_dir: Path
    #: ``--sgl-router-launcher``; None: ``<python> -m sglang_router.launch_router`` when it is installed
    launcher: tuple[str, ...] | None = None
    lock_dir: Path | None = None
    port_range: tuple[int, int] | None = None
    #: how long to wait for a free port block when every block is held
    port_wait_timeout: float = 0.0
    #: check the ports as the router binds them (``SO_REUSEADDR``): a port pinned by a test's URL that the previous
    #: router on it left in ``TIME_WAIT`` is free to it
    reuse_addr: bool = False
    #: the workers' startup timeout; a router gets at most :data:`DEFAULT_ROUTER_TIMEOUT` of it
    startup_timeout: float = DEFAULT_ROUTER_TIMEOUT
    tail_lines: int = 40
    #: which router logs to keep (:func:`pytest_sglworker.resources.retention.keeps`)
    log_policy: str = "failed"
    on_message: Callable[[str], None] | None = field(default=None, compare=False)


def default_router_launcher() -> list[str]:
    return [sys.executable, "-m", ROUTER_MODULE]


IGW_FLAG = "--enable-igw"
HEALTH_CHECK_OFF_FLAG = "--disable-health-check"


def igw_mode(args: Sequence[str]) -> bool:
    """The inference-gateway mode: the router ignores ``--worker-urls`` and waits for workers added through its
    worker API."""
    return IGW_FLAG in args


def dp_aware_for(members: Sequence[ModelInstance], args: Sequence[str], dp_aware: bool | None) -> bool:
    """Whether the router addresses each dp rank (``--dp-aware``): as asked, else when a member runs ``--dp-size``
    > 1 (or when the router's args already say so)."""
    if "--dp-aware" in args:
        return True
    if dp_aware is not None:
        return dp_aware
    return any(data_parallel_size(m.spec, m.argv) > 1 for m in members)


def router_argv(launcher: Sequence[str], *, port: int, prometheus_port: int, group: WorkerGroup,
                policy: str | None, args: Sequence[str], members: Sequence[ModelInstance] | None = None,
                dp_aware: bool | None = None) -> list[str]:
    """The router's argv in front of ``members`` of ``group`` (default: all of them): regular, PD or dp-aware
    mode, loopback only. In the gateway mode (``--enable-igw``) it is given no worker: they are added through its
    worker API."""
    members = list(group) if members is None else list(members)
    argv = [*launcher, "--host", LOOPBACK_HOST, "--port", str(port),
            "--prometheus-host", LOOPBACK_HOST, "--prometheus-port", str(prometheus_port)]
    given = [] if igw_mode(args) else members
    if group.is_pd:
        argv.append("--pd-disaggregation")
        for member in (m for m in given if m.role == "prefill"):
            argv += ["--prefill", member.url, str(member.bootstrap_port) if member.bootstrap_port else "none"]
        for member in (m for m in given if m.role == "decode"):
            argv += ["--decode", member.url]
    elif given:
        argv += ["--worker-urls", *(m.url for m in given)]
    if dp_aware_for(members, args, dp_aware) and "--dp-aware" not in args:
        argv.append("--dp-aware")
    if policy:
        argv += ["--policy", policy]
    return [*argv, *args]


def _expected(members: Sequence[ModelInstance], dp_aware: bool) -> int:
    """Workers the router lists when it has them all (a dp-aware router lists one per dp rank)."""
    return sum(data_parallel_size(m.spec, m.argv) if dp_aware else 1 for m in members)


def api_key_of(args: Sequence[str]) -> str | None:
    """The ``--api-key`` given to the router (its worker API then needs it too), or None."""
    key = None
    for i, arg in enumerate(args):
        if arg == "--api-key" and i + 1 < len(args):
            key = args[i + 1]
        elif arg.startswith("--api-key="):
            key = arg.split("=", 1)[1]
    return key


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class RouterReadiness(Readiness):
    """``GET /health`` 200, then ``GET /workers`` listing every worker it was started with healthy (listed, when
    its health checks are off). A router started with no worker (none asked for, or the gateway mode) is ready
    when its ``/health`` answers."""

    what = "router"
    ready_word = "ready"

    def __init__(self, group: WorkerGroup, api_key: str | None = None, *,
                 members: Sequence[ModelInstance] | None = None, dp_aware: bool = False,
                 health_checks: bool = True) -> None:
        members = list(group) if members is None else list(members)
        self.urls = [m.url for m in members]
        self.expected = _expected(members, dp_aware)
        self.headers = _auth(api_key)
        self.health_checks = health_checks

    def probe(self, target: Watched, deadline: float, abort: Callable[[], bool]) -> Probe:
        try:
            health = http_request(target.host, target.port, "/health", deadline=deadline, abort=abort)
            if health.status != 200:
                return Probe(False, f"/health HTTP {health.status}")
            if not self.expected:
                if not target.owns_port():
                    return Probe(False, "answered by a process that is not this router (stale router on the port?)",
                                 stale=True)
                return Probe(True, "/health HTTP 200 (no worker to wait for)")
            listed = http_request(target.host, target.port, "/workers", deadline=deadline, abort=abort,
                                  headers=self.headers)
        except ConnectionRefusedError:
            return Probe(False, "not listening yet", listening=False)
        except ProbeTimeout:
            return Probe(False, "no complete answer in time", complete=False)
        except OSError as exc:
            return Probe(False, type(exc).__name__)
        try:
            workers = json.loads(listed.body)["workers"]
        except (ValueError, KeyError, TypeError):
            return Probe(False, f"/workers HTTP {listed.status}: not the router's worker list")
        ours = [w for w in workers if isinstance(w, dict) and any(str(w.get("url", "")).startswith(u)
                                                                    for u in self.urls)]
        healthy = [w for w in ours if w.get("is_healthy") or not self.health_checks]
        if len(healthy) < self.expected:
            word = "healthy" if self.health_checks else "listed"
            return Probe(False, f"{len(healthy)} of {self.expected} workers {word}")
        if not target.owns_port():
            return Probe(False, "answered by a process that is not this router (stale router on the port?)",
                         stale=True)
        return Probe(True, f"{len(healthy)} workers healthy")


@dataclass(kw_only=True)
class Router(ManagedProcess):
    """A running router in front of a worker group. ``url``, ``client`` (an ``httpx.Client``), ``workers()``,
    ``add_worker(url)``, ``remove_worker(url)``, ``log_tail()``."""

    group: WorkerGroup
    policy: str | None = None
    record: LaunchRecord | None = field(default=None, repr=False)
    removed: list[str] = field(default_factory=list)
    #: the router's own figures, and the log policy its teardown follows
    stats: ConfigStats | None = field(default=None, repr=False)
    log_policy: str = field(default="failed", repr=False)
    #: the router's ``--api-key``: its worker API methods send it; ``client`` does not (a test of the key
    #: sends it itself, or ``headers=router.auth_headers``)
    api_key: str | None = field(default=None, repr=False)

    @property
    def auth_headers(self) -> dict[str, str]:
        return _auth(self.api_key)

    @property
    def role(self) -> str:
        return "router"

    @property
    def spec(self) -> Any:
        return self.group.config.spec

    @property
    def mode(self) -> str:
        return "pd" if self.group.is_pd else "regular"

    def describe(self) -> str:
        policy = f" {self.policy}" if self.policy else ""
        return (f"router ({self.mode}{policy}) over {self.group.config.label} on {self.host}:{self.port} "
                f"(pid {self.pid})")

    def fatal_in_log(self) -> bool:
        text = self.log_tail(20)
        return "Address already in use" in text or ("error: " in text.lower() and "usage:" in text.lower())

    def diagnosis(self, *, alive: bool = False) -> Diagnosis | None:
        """The router's first error line (its parser's ``error: ...``, a panic, a failed bind), for the headline of
        its failure; else, for a router a signal killed, that signal; None when there is nothing to say."""
        for number, line in enumerate(self.log_text().split("\n"), 1):
            line = _ANSI.sub("", line)
            found = _ROUTER_ERROR.search(line)
            if found is None or _ROUTER_QUIET.match(line):
                continue
            text = line.strip()
            advice = ("check @pytest.mark.sgl_router(args=...) against the router's own "
                      "'python -m sglang_router.launch_router --help'" if "arguments" in text or "invalid" in text
                      else "read the router's log at that line")
            return Diagnosis(Kind.UNKNOWN, f"the router says: {found.group('what').strip()}", advice, text, number,
                             returncode=None if alive else self.returncode)
        code = None if alive else self.returncode
        if code is not None and code < 0:  # killed, and nothing in its log says why: the signal is the news
            from ..engine.diagnosis_rules import signal_advice
            from ..engine.diagnosis_rules import signal_name as signal_named

            name = signal_named(-code)
            return Diagnosis(Kind.KILLED_BY_SIGNAL, f"the router was killed by {name} and its log shows no error",
                             signal_advice(-code), returncode=code)
        return None

    # -- the router's worker API --------------------------------------------------------------------------
    def workers(self) -> list[dict[str, Any]]:
        """The router's worker list (``GET /workers``)."""
        resp = self.client.get("/workers", timeout=10.0, headers=self.auth_headers)
        resp.raise_for_status()
        return list(resp.json()["workers"])

    def add_worker(self, worker: ModelInstance | str, **fields: Any) -> dict[str, Any]:
        """``POST /workers``: add a worker (a member of a group, or a URL); returns the router's answer. A prefill
        or decode member is added as that type (a prefill member with its bootstrap port); ``fields`` go into the
        request as they are (``api_key``, ``priority``, ...)."""
        if isinstance(worker, str):
            url = worker
        else:
            url = worker.url
            if worker.role in ("prefill", "decode"):
                fields.setdefault("worker_type", worker.role)
            if worker.role == "prefill" and worker.bootstrap_port is not None:
                fields.setdefault("bootstrap_port", worker.bootstrap_port)
        resp = self.client.post("/workers", json={"url": url, **fields}, timeout=30.0, headers=self.auth_headers)
        resp.raise_for_status()
        return dict(resp.json()) if resp.content else {}

    def remove_worker(self, worker: ModelInstance | str, *, timeout: float = 30.0) -> list[str]:
        """``DELETE /workers/{id}`` of every entry of the worker (a member, or its URL): its one entry, or one per dp
        rank (``url@0``, ``url@1``, ... of a dp-aware router), and wait (bounded by ``timeout``) until the router
        no longer lists them: it removes in the background. The worker keeps running: the router only stops
        sending it requests. Returns the entries removed; LookupError when the router lists none, RuntimeError
        with the router's own words when its removal fails."""
        url = (worker if isinstance(worker, str) else worker.url).rstrip("/")
        listed = self.workers()
        matches = [w for w in listed if _same_worker(str(w.get("url", "")), url)]
        if not matches:
            raise LookupError(f"the router lists no worker at {url}: {[w.get('url') for w in listed]}")
        for entry in matches:
            resp = self.client.delete(f"/workers/{entry['id']}", timeout=30.0, headers=self.auth_headers)
            resp.raise_for_status()
        entries = [str(entry.get("url")) for entry in matches]
        deadline = time.monotonic() + timeout
        while True:
            left = [u for u in (str(w.get("url", "")) for w in self.workers()) if u in entries]
            if not left:
                break
            failed = self._removal_failure(left)
            if failed is not None or time.monotonic() >= deadline:
                why = failed or f"still listed after {timeout:g} s"
                hint = (" (sglang-router 0.3.2 cannot remove a dp-aware worker's rank by its id: it looks for "
                        "'<url>@<rank>@...'; give the router dp_aware=False to list the worker once)"
                        if any("@" in u.rsplit(":", 1)[-1] for u in left) else "")
                raise RuntimeError(f"the router did not remove {', '.join(left)}: {why}{hint}")
            time.sleep(0.05)
        self.removed.append(url)
        return entries

    def _removal_failure(self, entries: Sequence[str]) -> str | None:
        """The router's log line saying that the removal of one of ``entries`` failed, if it wrote one."""
        for line in reversed(self.log_end()[0][-400:]):
            line = _ANSI.sub("", line)
            if "Failed job: type=RemoveWorker" in line and any(f"worker={e}," in line for e in entries):
                return line.split("Failed job: ", 1)[1].strip()
        return None

    def wait_for_workers(self, count: int, *, timeout: float = 30.0, healthy: bool = True) -> list[dict[str, Any]]:
        """Wait (bounded) until the router lists ``count`` workers, healthy ones unless ``healthy=False`` (a router
        whose health checks are off); returns them."""
        deadline = time.monotonic() + timeout
        while True:
            found = [w for w in self.workers() if w.get("is_healthy") or not healthy]
            if len(found) == count:
                return found
            if time.monotonic() >= deadline:
                word = "healthy " if healthy else ""
                raise TimeoutError(f"the router lists {len(found)} {word}workers, not {count}, after {timeout:g} s")
            time.sleep(0.1)

    # -- teardown -----------------------------------------------------------------------------------------
    def served(self, nodeid: str, t_start: float | None, t_end: float | None) -> None:
        """Record that a test used this router (its launch record's tests)."""
        if self.record is not None:
            self.record.served(nodeid, t_start, t_end, "done")

    def close(self) -> None:
        """Stop the router, give its ports back and finish its launch record."""
        died = not self.is_alive() and not self.stopped
        self.stop()
        stats = self.stats or ConfigStats(self.describe(), "sglang-router")
        if died:
            stats.deaths += 1
        if self.record is not None:
            record = self.record
            record.take_times(self)
            record.t_released = time.time()
            if died:
                record.failed("died", failure=f"exited with {signal_name(self.returncode)}", replace=True)
                record.exit_code = self.returncode
        from ..resources.retention import keeps

        if not keeps(self.log_policy, failed=died):
            self.remove_log()
        else:
            (stats.failed_logs if died else stats.kept_logs).append(str(self.log_path))


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _same_worker(listed: str, url: str) -> bool:
    """Whether a router's entry (``url``, or ``url@rank`` of a dp-aware router) is the worker at ``url``."""
    listed = listed.rstrip("/")
    return listed == url or (listed.startswith(url + "@") and listed[len(url) + 1:].isdigit())


def _router_stats(records: RunRecords, group: WorkerGroup, policy: str | None) -> ConfigStats:
    return records.stats_for(f"router-{policy or 'default'}-{group.config.key}",
                             f"router ({policy or 'default policy'}) over {group.config.label}", "sglang-router")


def router_env(group: WorkerGroup, environ: Mapping[str, str] | None = None, *, igw: bool = False) -> dict[str, str]:
    """What the router's environment adds: in front of gRPC workers, or in the gateway mode (``igw``, which makes
    every router kind), ``TIKTOKEN_ENCODINGS_BASE`` naming the installed ``o200k_base.tiktoken``
    (``sglworker install-router-vocab``) unless it is set already; the router builds its Harmony encoder from it
    whenever it has a gRPC router, and downloads it otherwise."""
    environ = os.environ if environ is None else environ
    if environ.get(ROUTER_VOCAB_ENV) or not (any(url.startswith("grpc://") for url in group.urls) or igw):
        return {}
    folder = router_vocab_dir(environ)
    return {ROUTER_VOCAB_ENV: str(folder)} if folder is not None else {}


def _vocab_hint(router: Router) -> str:
    """The fix, when the router died building its Harmony encoder (no vocab file and no network)."""
    if "Failed to load Harmony encoding" not in router.log_tail(200):
        return ""
    return (f"the router's gateway and gRPC modes need OpenAI's o200k_base.tiktoken (it downloads it when it "
            f"can): run "
            f"'{ROUTER_VOCAB_HINT}', or set {ROUTER_VOCAB_ENV} to a folder that holds it")


def router_launcher(explicit: Sequence[str] | None = None) -> list[str]:
    """The router's launcher: ``explicit`` (``--sgl-router-launcher``), else ``<python> -m
    sglang_router.launch_router`` when the package is installed; :class:`RouterUnavailable` (a skip with the
    install command) otherwise."""
    if explicit:
        return list(explicit)
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterUnavailable(f"the sglang router is not installed for {sys.executable}: {INSTALL_HINT}")
    return default_router_launcher()


def start_router(group: WorkerGroup, options: RouterOptions, records: RunRecords, *, policy: str | None = None,
                 args: Sequence[str] = (), startup_timeout: float | None = None, holder: str = "",
                 environ: Mapping[str, str] | None = None, members: Sequence[ModelInstance] | None = None,
                 dp_aware: bool | None = None) -> Router:
    """Launch the router in front of ``members`` of ``group`` (default: all; none in the gateway mode) and return
    it once it reports them healthy (listed, with its health checks off; its ``/health`` alone when it starts
    with none); its figures and launch record go into ``records``. ``dp_aware``: ``--dp-aware`` as asked (default:
    when a member runs dp). ``environ``: the environment it inherits (default: this process's)."""
    environ = inherited_environ() if environ is None else environ
    from ..resources import state
    from ..resources.ports import reserve_port_block

    launcher = router_launcher(options.launcher)
    check_launcher(launcher)
    log_dir = state.ensure_private_dir(options.log_dir, what="log directory")
    lock_dir = state.ensure_private_dir(options.lock_dir or state.default_lock_dir(), what="lock directory",
                                        shared_ok=options.lock_dir is not None)
    timeout = startup_timeout or min(options.startup_timeout, DEFAULT_ROUTER_TIMEOUT)
    stats = _router_stats(records, group, policy)
    taken: list[int] = []  # blocks a port of which was taken between the reservation and the bind
    for attempt in (1, 2, 3):
        block = reserve_port_block(lock_dir, port_range=options.port_range, timeout=options.port_wait_timeout,
                                   on_wait=options.on_message, reuse_addr=options.reuse_addr, last=taken)
        ports = dict(zip(ROUTER_PORTS, block.ports, strict=False))
        argv = router_argv(launcher, port=ports["http"], prometheus_port=ports["prometheus"], group=group,
                           policy=policy, args=args, members=members, dp_aware=dp_aware)
        record = records.new_launch(kind="router", config=group.config.key, label=f"router over {group.config.label}",
                                    model="sglang-router", role="router", group=group.id,
                                    t_lease_requested=time.time(), port=ports["http"], argv=" ".join(mask_argv(argv)))
        try:
            started = start_process(argv, router_env(group, environ, igw=igw_mode(args)),
                                    log_dir / log_name("sglang-router", ports["http"]), environ=environ)
        except BaseException:
            block.release()
            record.outcome = "startup_failed"
            raise
        router = Router(host=LOOPBACK_HOST, port=ports["http"], ports=ports, port_block=block, group=group,
                        policy=policy, record=record, tail_lines=options.tail_lines,
                        stats=stats, log_policy=options.log_policy, api_key=api_key_of(args), **started)
        record.pid, record.log_path, record.node = router.pid, str(router.log_path), hostname()
        try:
            given = [] if igw_mode(args) else (list(group) if members is None else list(members))
            readiness = RouterReadiness(group, router.api_key, members=given,
                                        dp_aware=dp_aware_for(given, args, dp_aware),
                                        health_checks=HEALTH_CHECK_OFF_FLAG not in args)
            wait_until_ready(router, readiness, timeout=timeout, ready_line=None)
        except WorkerError as exc:
            router.stop()
            vocab_hint = _vocab_hint(router)
            exc.extra = "\n".join(filter(None, (exc.extra, vocab_hint)))
            record.take_times(router)
            record.failed("startup_failed", exc, replace=True)
            record.exit_code = router.returncode
            record.t_released = time.time()
            stats.failed_logs.append(str(router.log_path))
            if vocab_hint and not environ.get(ROUTER_VOCAB_ENV):
                # neither installed nor downloadable here: an optional tier's missing piece, skipped with its
                # install command (a folder the user named that lacks the file stays a failure); the summary
                # counts no failed start for it, and its log is kept
                raise RouterUnavailable(f"the router died at startup without its vocabulary: {vocab_hint}") from exc
            stats.failures += 1
            if isinstance(exc, WorkerStartupError) and "in use" in router.log_text() and attempt < 3:
                taken.append(block.port)
                continue  # the port was taken between reservation and bind: another block
            raise
        except BaseException:
            router.stop()
            raise
        router.times["ready"] = time.time()
        record.take_times(router)
        stats.launches += 1
        if router.startup_seconds is not None:
            stats.startup_seconds.append(router.startup_seconds)
        return router
    raise LaunchError(f"the router could not bind a port in {options.port_range or 'the default range'}: "
                      f"{shlex.join(mask_argv(argv))}")
