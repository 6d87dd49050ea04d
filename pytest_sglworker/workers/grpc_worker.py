"""gRPC workers: sglang's ``--grpc-mode`` as a worker kind (:class:`GrpcWorker`) and its readiness
(:class:`GrpcHealth`). What the engine does in that mode, and the packages this Python needs to speak to it,
are engine knowledge: :mod:`pytest_sglworker.engine.grpc_facts`.

Plain Python, no pytest; ``grpc`` and the generated stubs are imported inside the probe.

:class:`GrpcHealth` asks the standard health service for the scheduler service (``SERVING``), falls back to
the servicer's ``HealthCheck`` RPC on a server without the standard service, bounds every call by grpc's
``timeout=`` (a whole-request deadline), stops at once when the process exits, and counts an answer only
when the listening socket belongs to the worker's own process tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..engine.grpc_facts import (
    DERIVED_GRPC_PORT_OFFSET,
    SCHEDULER_SERVICE,
    grpc_missing_reason,
    grpc_module,
    proto,
)
from .errors import LaunchError
from .health import Probe, Readiness, Watched
from .kinds import WorkerKind

if TYPE_CHECKING:
    from ..engine.specs import ModelSpec

__all__ = ["GrpcHealth", "GrpcUnavailable", "GrpcWorker"]


class GrpcUnavailable(LaunchError):
    """The gRPC packages are missing from this Python (a gRPC worker cannot be proven ready here)."""


class GrpcHealth(Readiness):
    """Ready when the standard gRPC health service reports the scheduler service ``SERVING`` (the servicer's
    ``HealthCheck`` RPC on a server without it), answered by the worker's own process."""

    what = "gRPC health"
    ready_word = "healthy"

    def __init__(self, service: str = SCHEDULER_SERVICE) -> None:
        self.service = service

    def probe(self, target: Watched, deadline: float, abort: Callable[[], bool]) -> Probe:
        grpc = grpc_module("grpc")
        # A fresh channel per probe: no reconnect backoff carried over, nothing left open between probes.
        channel = grpc.insecure_channel(f"{target.host}:{target.port}", options=[("grpc.enable_retries", 0)])
        try:
            ok, status = self._standard(channel, deadline, abort)
            if ok is None:  # no standard health service: the servicer's own RPC
                ok, status = self._servicer(channel, deadline, abort)
        except _NotListening as exc:
            return Probe(False, f"not listening yet ({exc})", listening=False)
        except _Timeout:
            return Probe(False, "no complete gRPC health answer in time", complete=False)
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
        health_pb2 = grpc_module("grpc_health.v1.health_pb2")
        stub = grpc_module("grpc_health.v1.health_pb2_grpc").HealthStub(channel)
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
    grpc = grpc_module("grpc")
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
        if ports["grpc"] + DERIVED_GRPC_PORT_OFFSET > 65535:
            args += ["--grpc-port", str(ports["grpc"])]  # validated only: the legacy mode never binds it
        return args

    def readiness(self) -> Readiness:
        return GrpcHealth()

    def check_available(self, spec: ModelSpec) -> None:
        """Raise :class:`GrpcUnavailable` (with the install command) when this Python cannot speak gRPC."""
        reason = grpc_missing_reason(f"worker {spec.name} (--grpc-mode)")
        if reason:
            raise GrpcUnavailable(reason)
