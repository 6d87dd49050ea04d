"""The kinds of worker process.

Plain Python, no pytest. A **worker kind** is one class: the ports it pins from its reserved port block, the
args it adds once those ports are known, how many GPUs it leases, how its readiness is proven and what its URL
looks like. The regular HTTP worker is :class:`HttpWorker`; a prefill/decode pair is :class:`PrefillWorker` +
:class:`DecodeWorker`; the gRPC worker is :class:`~pytest_sglworker.workers.grpc_worker.GrpcWorker`. A new kind is
a new subclass, chosen by :func:`~pytest_sglworker.workers.config.default_kind` or by a plugin's
``pytest_sglworker_worker_kind`` hook, not edits across modules. What to launch for a test (its configuration
and its members' kinds) is :mod:`pytest_sglworker.workers.config`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..engine.sglang_facts import flag_table
from ..engine.specs import ModelSpec
from ..resources.ports import PORT_BLOCK_SIZE as PORT_BLOCK_SIZE  # a worker's port block: its pinned ports come first
from .health import HttpHealth, Readiness

__all__ = [
    "PORT_BLOCK_SIZE",
    "ROLES",
    "DecodeWorker",
    "HttpWorker",
    "PrefillWorker",
    "WorkerKind",
    "data_parallel_size",
    "gpu_count",
]

#: Roles of worker group members.
ROLES = ("worker", "prefill", "decode")


def gpu_count(spec: ModelSpec, args: Sequence[str]) -> int:
    """GPUs one worker process needs: ``tp`` (the spec's, or ``--tp-size`` in ``args``) times the number of
    data-parallel replicas (``--dp-size``). With DP attention (``--attn-dp-size``, or the deprecated
    ``--enable-dp-attention``) the attention groups live inside the tp group and need no GPU of their own."""
    parsed = flag_table().parse([*spec.worker_args, *args])

    def last_int(dest: str, default: int) -> int:
        value = parsed.last(dest)
        try:
            return int(value) if value is not None else default
        except ValueError:
            return default  # sglang's parser rejects it before anything launches

    tp = last_int("tp_size", spec.tp)
    dp = last_int("dp_size", 1)
    if parsed.given("enable_dp_attention") or last_int("attn_dp_size", 1) > 1:
        dp = 1
    return max(1, tp) * max(1, dp)


def data_parallel_size(spec: ModelSpec, args: Sequence[str]) -> int:
    """``--dp-size`` of a worker (1 without it): a dp-aware router addresses each rank."""
    value = flag_table().parse([*spec.worker_args, *args]).last("dp_size")
    try:
        return max(1, int(value)) if value is not None else 1
    except ValueError:
        return 1


class WorkerKind:
    """The regular sglang HTTP worker; subclasses override what differs."""

    name = "http"
    role = "worker"
    scheme = "http"
    #: ports pinned from the worker's reserved block, in block order (the first is its main port)
    port_names: tuple[str, ...] = ("http", "nccl")

    def role_args(self, ports: Mapping[str, int]) -> list[str]:
        """Args this kind adds to the argv once its ports are known."""
        return []

    def readiness(self) -> Readiness:
        return HttpHealth()

    def url(self, host: str, port: int) -> str:
        return f"{self.scheme}://{host}:{port}"

    def gpus(self, spec: ModelSpec, args: Sequence[str]) -> int:
        return gpu_count(spec, args)

    def check_available(self, spec: ModelSpec) -> None:
        """Raise a :class:`~pytest_sglworker.workers.errors.LaunchError` before anything starts when this kind cannot be
        launched from this Python (a gRPC worker without the gRPC packages)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class HttpWorker(WorkerKind):
    """A regular (prefill and decode in one) HTTP worker."""


class PrefillWorker(WorkerKind):
    """The prefill side of a PD pair: ``--disaggregation-mode prefill`` and a KV bootstrap server on a port
    pinned from its block (the router sends it with every request)."""

    name = "prefill"
    role = "prefill"
    port_names = ("http", "nccl", "bootstrap")

    def role_args(self, ports: Mapping[str, int]) -> list[str]:
        return ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports["bootstrap"])]


class DecodeWorker(WorkerKind):
    """The decode side of a PD pair: ``--disaggregation-mode decode``."""

    name = "decode"
    role = "decode"

    def role_args(self, ports: Mapping[str, int]) -> list[str]:
        return ["--disaggregation-mode", "decode"]
