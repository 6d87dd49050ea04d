"""gRPC workers: sglang's ``--grpc-mode`` as a worker kind (:class:`GrpcWorker`) and its readiness
(:class:`GrpcHealth`).

Plain Python, no pytest. ``grpc`` and the generated stubs are imported lazily, inside the probe: the plugin is
loaded by every pytest run and a run without gRPC workers never imports them.

What sglang 0.5.23 does with ``--grpc-mode`` (``srt/entrypoints/grpc_server.py``, which hands over to the
``smg-grpc-servicer`` package; checked live on the CPU with smg-grpc-servicer 0.14.1):

- ``--grpc-mode`` is a deprecated alias of ``--smg-grpc-mode`` (the legacy SMG servicer); either selects it.
  The servicer serves ``sglang.grpc.scheduler.SglangScheduler`` (``smg-grpc-proto``), the standard
  ``grpc.health.v1.Health`` service and reflection on ``--port``; there is no HTTP API on that port.
- The standard health service answers ``NOT_SERVING`` until the servicer's warmup request has been answered,
  then ``SERVING`` for ``""`` and for the scheduler service (the servicer's readiness level, which also turns
  ``NOT_SERVING`` when the scheduler stalls with requests pending); the log then says ``The server is fired
  up and ready to roll!``. The servicer's own ``HealthCheck`` RPC submits a one-token request and answers
  ``healthy`` as soon as the scheduler answers, warmup or not: the router uses that one.
- An HTTP sidecar (aiohttp) listens on ``--smg-http-sidecar-port`` (default ``--port + 1``): ``POST
  /start_profile``, ``POST /stop_profile`` and, with ``--enable-metrics``, ``GET /metrics``; everything else
  is 404 (no ``/health``). The sidecar port is pinned from the worker's reserved block.
- The legacy mode also derives ``grpc_port = port + 10000`` and refuses a value above 65535, though nothing
  binds it: above port 55535 it is pinned to the worker's own port (never bound in this mode either).
- The servicer's warmup request is the token ids 123 ... 890: a model with a smaller vocab (the tiny test
  Llama's 512) crashes the scheduler (``IndexError: index out of range in self``); such a model needs
  ``--skip-server-warmup``.

The real router (``sglang-router`` 0.3.2) takes ``--worker-urls grpc://HOST:PORT`` (or ``POST /workers``), tells
gRPC from HTTP by probing both, checks gRPC workers with the servicer's ``HealthCheck`` RPC, reads the
tokenizer path from ``GetModelInfo`` and loads that tokenizer itself (no ``--model-path`` needed when the path
is local), serves ``/v1/chat/completions`` (streamed or not) and ``/generate`` (with ``"model"`` in the body)
but not ``/v1/completions``, and, whenever it creates its gRPC router, builds a Harmony encoder from OpenAI's
``o200k_base.tiktoken`` (``TIKTOKEN_ENCODINGS_BASE``, SHA-256 checked; see :func:`router_vocab_dir`).

:class:`GrpcHealth` asks the standard health service for the scheduler service (``SERVING``), falls back to
the servicer's ``HealthCheck`` RPC on a server without the standard service, bounds every call by grpc's
``timeout=`` (a whole-request deadline), stops at once when the process exits, and counts an answer only
when the listening socket belongs to the worker's own process tree.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.sglang_facts import flag_table
from ..errors import LaunchError
from .health import Probe, Readiness, Watched
from .kinds import WorkerKind

if TYPE_CHECKING:
    from ..engine.specs import ModelSpec
    from .kinds import KindChooser, WorkerConfig

__all__ = [
    "GRPC_MODE_DESTS",
    "GRPC_PACKAGES",
    "INSTALL_HINT",
    "ROUTER_VOCAB_ENV",
    "ROUTER_VOCAB_HINT",
    "SCHEDULER_SERVICE",
    "GrpcHealth",
    "GrpcUnavailable",
    "GrpcWorker",
    "grpc_missing_reason",
    "grpc_refusal",
    "missing_grpc_packages",
    "proto",
    "router_vocab_dir",
    "wants_grpc",
]

#: The parser dests that select the legacy SMG gRPC server (``--grpc-mode`` is the deprecated alias).
GRPC_MODE_DESTS = ("grpc_mode", "smg_grpc_mode")
#: The service the servicer registers (and names in the standard health service).
SCHEDULER_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
#: What this process needs to talk to a gRPC worker, and the simulated engine to be one: ``(distribution,
#: module)``. The real engine's own venv needs ``smg-grpc-servicer`` (sglang's error says so).
GRPC_PACKAGES: tuple[tuple[str, str], ...] = (
    ("grpcio", "grpc"),
    ("grpcio-health-checking", "grpc_health"),
    ("smg-grpc-proto", "smg_grpc_proto"),
)
INSTALL_HINT = "pip install 'pytest-sglworker[grpc]'"
#: The legacy mode's derived ``grpc_port`` (``port + 10000``) must stay a valid port.
_DERIVED_GRPC_PORT_OFFSET = 10000


class GrpcUnavailable(LaunchError):
    """The gRPC packages are missing from this Python (a gRPC worker cannot be proven ready here)."""


def wants_grpc(args: Sequence[str]) -> bool:
    """Whether ``args`` select sglang's gRPC server (``--grpc-mode``, ``--smg-grpc-mode`` or an abbreviation
    sglang's parser accepts)."""
    try:
        parsed = flag_table().parse(list(args))
    except ValueError:  # an ambiguous abbreviation: sglang's parser refuses it before anything launches
        return False
    return any(parsed.given(dest) for dest in GRPC_MODE_DESTS)


def missing_grpc_packages() -> list[str]:
    """The distributions of :data:`GRPC_PACKAGES` this Python cannot import (found, not imported)."""
    missing = []
    for dist, module in GRPC_PACKAGES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    return missing


def grpc_missing_reason(subject: str = "a gRPC worker (--grpc-mode)") -> str:
    """Why ``subject`` cannot run here (a skip reason or a usage error), or "" when the packages are there."""
    import sys

    missing = missing_grpc_packages()
    if not missing:
        return ""
    return f"{subject} needs {', '.join(missing)}, missing for {sys.executable}: {INSTALL_HINT}"


def grpc_refusal(config: WorkerConfig, choose: KindChooser | None = None) -> tuple[str, str] | None:
    """What a session does with a configuration that has gRPC workers when this Python lacks the gRPC
    packages: ``("usage", message)`` when the spec's own worker_args run ``--grpc-mode`` (the run selected that
    spec: a usage error before anything starts), ``("skip", reason)`` when only a test's args do; None when no
    member is a gRPC worker or the packages are there."""
    if not any(isinstance(member.kind, GrpcWorker) for member in config.members(choose)):
        return None
    reason = grpc_missing_reason()
    if not reason:
        return None
    if wants_grpc(config.spec.worker_args):
        return "usage", f"model spec {config.spec.name!r} runs --grpc-mode (its worker_args): {reason}"
    return "skip", reason


# ---------------------------------------------------------------------------------------------- the router

#: sglang-router 0.3.2 builds its Harmony encoder with its gRPC router, from this file (SHA-256 checked).
ROUTER_VOCAB_FILE = "o200k_base.tiktoken"
ROUTER_VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ROUTER_VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"
ROUTER_VOCAB_HINT = "bash scripts/install-router-vocab.sh"
_DEFAULT_VOCAB_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tiktoken"


def router_vocab_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder for the router's ``TIKTOKEN_ENCODINGS_BASE``: ``$TIKTOKEN_ENCODINGS_BASE``, else
    ``<repo>/.cache/tiktoken`` (``scripts/install-router-vocab.sh``), when its ``o200k_base.tiktoken`` has the
    router's hash; None otherwise (the router's gRPC mode then needs the network at startup)."""
    import hashlib
    import os

    environ = os.environ if environ is None else environ
    folder = Path(environ[ROUTER_VOCAB_ENV]) if environ.get(ROUTER_VOCAB_ENV) else _DEFAULT_VOCAB_DIR
    try:
        digest = hashlib.sha256((folder / ROUTER_VOCAB_FILE).read_bytes()).hexdigest()
    except OSError:
        return None
    return folder if digest == ROUTER_VOCAB_SHA256 else None


class GrpcHealth(Readiness):
    """Ready when the standard gRPC health service reports the scheduler service ``SERVING`` (the servicer's
    ``HealthCheck`` RPC on a server without it), answered by the worker's own process."""

    what = "gRPC health"
    ready_word = "healthy"

    def __init__(self, service: str = SCHEDULER_SERVICE) -> None:
        self.service = service

    def probe(self, target: Watched, deadline: float, abort: Callable[[], bool]) -> Probe:
        grpc = _module("grpc")
        # A fresh channel per probe: no reconnect backoff carried over, nothing left open between probes.
        channel = grpc.insecure_channel(f"{target.host}:{target.port}", options=[("grpc.enable_retries", 0)])
        try:
            ok, status = self._standard(channel, deadline, abort)
            if ok is None:  # no standard health service: the servicer's own RPC
                ok, status = self._servicer(channel, deadline, abort)
        except _NotListening as exc:
            return Probe(False, f"not listening yet ({exc})", listening=False)
        except _Timeout:
            return Probe(False, "no complete gRPC health answer in time")
        except _RpcFailed as exc:
            return Probe(False, str(exc))
        finally:
            channel.close()
        if not ok:
            return Probe(False, status)
        if not target.owns_port():
            return Probe(False, f"{status} from a process that is not this worker (stale server on the port?)",
                         stale=True)
        return Probe(True, status)

    def _standard(self, channel: Any, deadline: float, abort: Callable[[], bool]) -> tuple[bool | None, str]:
        health_pb2 = _module("grpc_health.v1.health_pb2")
        stub = _module("grpc_health.v1.health_pb2_grpc").HealthStub(channel)
        try:
            answer = _call(stub.Check, health_pb2.HealthCheckRequest(service=self.service), deadline, abort)
        except _Unimplemented:
            return None, ""
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        return answer.status == health_pb2.HealthCheckResponse.SERVING, f"Health/Check {self.service}: {name}"

    def _servicer(self, channel: Any, deadline: float, abort: Callable[[], bool]) -> tuple[bool, str]:
        sglang_scheduler_pb2 = proto("sglang_scheduler_pb2")
        stub = proto("sglang_scheduler_pb2_grpc").SglangSchedulerStub(channel)
        try:
            answer = _call(stub.HealthCheck, sglang_scheduler_pb2.HealthCheckRequest(), deadline, abort)
        except _Unimplemented as exc:
            raise _RpcFailed(f"neither grpc.health.v1.Health nor {SCHEDULER_SERVICE}/HealthCheck answers "
                             f"({exc})") from None
        verdict = "healthy" if answer.healthy else "unhealthy"
        return bool(answer.healthy), f"HealthCheck: {verdict}{f' ({answer.message})' if answer.message else ''}"


def _module(name: str) -> Any:
    """``name`` imported now (by name: the optional gRPC packages have no type stubs, and a run without gRPC
    workers never imports them)."""
    return importlib.import_module(name)


def proto(name: str) -> Any:
    """A generated module of ``smg-grpc-proto`` (the servicer's own): ``proto("sglang_scheduler_pb2")``."""
    return getattr(_module("smg_grpc_proto"), name)


class _NotListening(Exception):
    pass


class _Timeout(Exception):
    pass


class _Unimplemented(Exception):
    pass


class _RpcFailed(Exception):
    pass


def _call(method: Any, request: Any, deadline: float, abort: Callable[[], bool]) -> Any:
    """One unary call, complete before ``deadline`` (grpc's ``timeout=``: the whole request) and cancelled as
    soon as ``abort()`` says so (the process exited)."""
    grpc = _module("grpc")
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        raise _Timeout()
    future = method.future(request, timeout=timeout)
    while not future.done():
        if abort():
            future.cancel()
            raise _Timeout()
        time.sleep(0.005)
    try:
        return future.result()
    except grpc.FutureCancelledError:
        raise _Timeout() from None
    except grpc.RpcError as exc:
        code = exc.code()
        details = exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise _Timeout() from None
        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
            raise _Unimplemented(f"{code.name}: {details}") from None
        if code == grpc.StatusCode.UNAVAILABLE and ("connect" in details.lower() or "refused" in details.lower()):
            raise _NotListening(code.name) from None
        raise _RpcFailed(f"{code.name}: {details}"[:300]) from None


class GrpcWorker(WorkerKind):
    """A worker serving sglang's gRPC API (``--grpc-mode``): URL ``grpc://host:port``, the HTTP sidecar's port
    pinned from its block, readiness proven over gRPC (:class:`GrpcHealth`)."""

    name = "grpc"
    role = "worker"
    scheme = "grpc"
    port_names = ("grpc", "nccl", "sidecar")

    def role_args(self, ports: Mapping[str, int]) -> list[str]:
        args = ["--grpc-mode", "--smg-http-sidecar-port", str(ports["sidecar"])]
        if ports["grpc"] + _DERIVED_GRPC_PORT_OFFSET > 65535:
            args += ["--grpc-port", str(ports["grpc"])]  # validated only: the legacy mode never binds it
        return args

    def readiness(self) -> Readiness:
        return GrpcHealth()

    def check_available(self, spec: ModelSpec) -> None:
        """Raise :class:`GrpcUnavailable` (with the install command) when this Python cannot speak gRPC."""
        reason = grpc_missing_reason(f"worker {spec.name} (--grpc-mode)")
        if reason:
            raise GrpcUnavailable(reason)
