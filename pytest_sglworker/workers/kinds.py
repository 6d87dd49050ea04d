"""What to launch: worker configurations, worker groups and the kinds of worker process.

Plain Python, no pytest. A :class:`WorkerConfig` is everything that makes two workers (or two groups)
interchangeable: the spec, the test's extra args and env, and for a group its roles. It is the pool's key and
the xdist group name. :meth:`WorkerConfig.members` expands it into :class:`MemberPlan` s, one per process to
start, each with its :class:`WorkerKind`.

A **worker kind** is one class: the ports it pins from its reserved port block, the args it adds once those
ports are known, how many GPUs it leases, how its readiness is proven and what its URL looks like. The
regular HTTP worker is :class:`HttpWorker`; a prefill/decode pair is :class:`PrefillWorker` +
:class:`DecodeWorker`. A new kind (gRPC, embedding, ...) is a new subclass, chosen by
:func:`default_kind` or by a plugin's ``pytest_sglworker_worker_kind`` hook, not edits across modules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine.budget import check_argv, describe_violation
from ..engine.sglang_facts import flag_table
from ..engine.specs import ModelSpec
from ..errors import BudgetViolation
from ..resources.ports import PORT_BLOCK_SIZE as PORT_BLOCK_SIZE  # a worker's port block: its pinned ports come first

if TYPE_CHECKING:
    from .health import Readiness

__all__ = [
    "PORT_BLOCK_SIZE",
    "ROLES",
    "DecodeWorker",
    "GroupShape",
    "HttpWorker",
    "MemberPlan",
    "PrefillWorker",
    "WorkerConfig",
    "WorkerKind",
    "default_kind",
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
        from .health import HttpHealth

        return HttpHealth()

    def url(self, host: str, port: int) -> str:
        return f"{self.scheme}://{host}:{port}"

    def gpus(self, spec: ModelSpec, args: Sequence[str]) -> int:
        return gpu_count(spec, args)

    def check_available(self, spec: ModelSpec) -> None:
        """Raise a :class:`~pytest_sglworker.errors.LaunchError` before anything starts when this kind cannot be
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


#: ``choose(role, args) -> WorkerKind``: how a session picks the kind of each member
KindChooser = Callable[[str, Sequence[str]], WorkerKind]


def default_kind(role: str, args: Sequence[str]) -> WorkerKind:
    """The kind of a member with ``role`` and these args, the spec's worker_args first
    (``pytest_sglworker_worker_kind`` may override it): ``--grpc-mode`` makes a regular worker a
    :class:`~pytest_sglworker.workers.grpc_worker.GrpcWorker`."""
    if role == "prefill":
        return PrefillWorker()
    if role == "decode":
        return DecodeWorker()
    from ..engine.grpc_facts import wants_grpc
    from .grpc_worker import GrpcWorker

    if wants_grpc(args):
        return GrpcWorker()
    return HttpWorker()


@dataclass(frozen=True)
class GroupShape:
    """The roles of a worker group: ``count`` regular workers, or ``prefill`` + ``decode`` workers; per-role
    args are added after the group's own args."""

    count: int = 0
    prefill: int = 0
    decode: int = 0
    role_args: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        for name in ("count", "prefill", "decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.count and (self.prefill or self.decode):
            raise ValueError("a group is either count=N regular workers or prefill=P, decode=D; not both")
        if not (self.count or self.prefill or self.decode):
            raise ValueError("a worker group needs at least one worker (count=N, or prefill=P and decode=D)")
        if (self.prefill == 0) != (self.decode == 0):
            raise ValueError("a prefill/decode group needs both roles: prefill=P and decode=D, each at least 1")

    @property
    def is_pd(self) -> bool:
        return self.prefill > 0

    def roles(self) -> list[str]:
        if self.is_pd:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["worker"] * self.count

    def args_for(self, role: str) -> tuple[str, ...]:
        return dict(self.role_args).get(role, ())

    def describe(self) -> str:
        return f"{self.prefill}P+{self.decode}D" if self.is_pd else f"{self.count}x"


@dataclass(frozen=True)
class MemberPlan:
    """One process of a configuration: its role, its index within the role, its kind and its extra args
    (the test's, then its role's)."""

    role: str
    index: int
    kind: WorkerKind
    extra_args: tuple[str, ...]

    def gpus(self, spec: ModelSpec) -> int:
        return self.kind.gpus(spec, self.extra_args)


@dataclass(frozen=True)
class WorkerConfig:
    """What makes two workers (or two groups) interchangeable: the spec, the test's extra args and extra env,
    and for a group its shape. ``group`` None is a single worker (``sgl_worker``)."""

    spec: ModelSpec
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    #: the reason of a budget opt-out these args needed (shown in the summary and the report, not compared)
    opt_out: str = field(default="", compare=False)
    group: GroupShape | None = None

    @classmethod
    def of(cls, spec: ModelSpec, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
           *, opt_out: str = "", group: GroupShape | None = None) -> WorkerConfig:
        return cls(spec, tuple(extra_args), tuple(sorted((env or {}).items())), opt_out, group)

    @classmethod
    def resolve(cls, spec: ModelSpec, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None, *,
                opt_out: str | None = None, group: GroupShape | None = None, subject: str = "",
                fix: str = "") -> WorkerConfig:
        """The configuration, after the mandatory budget check of every member's argv (the spec's args, the
        test's, each role's). Raises :class:`BudgetViolation` naming ``subject`` unless ``opt_out`` gives a
        reason; the one place every entry point (collection, fixtures, the spawn factory) checks."""
        config = cls.of(spec, extra_args, env, group=group)
        problems = []
        for member in config.members():
            problems += [p for p in check_argv([*spec.worker_args, *member.extra_args]) if p not in problems]
        if problems and not (opt_out or "").strip():
            raise BudgetViolation(describe_violation(subject or f"worker {spec.name}", problems,
                                                     **({"fix": fix} if fix else {})))
        return cls.of(spec, extra_args, env, opt_out=(opt_out or "").strip() if problems else "", group=group)

    # -- identity -----------------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """Stable across processes (used as the xdist group name): ``<spec>`` or ``<spec>-<hash>``."""
        if not self.extra_args and not self.env and self.group is None:
            return self.spec.name
        # Not repr(spec): its frozenset of features prints in hash-seed order, which differs per process.
        spec = self.spec
        canonical: tuple[object, ...] = (spec.name, spec.model, spec.memory_gb, spec.tp, sorted(spec.features),
                                         spec.worker_args, sorted(spec.env.items()), spec.description,
                                         self.extra_args, self.env)
        if self.group is not None:
            canonical += (self.group.count, self.group.prefill, self.group.decode, self.group.role_args)
        digest = hashlib.sha1(repr(canonical).encode()).hexdigest()[:8]
        return f"{self.spec.name}-{digest}"

    @property
    def label(self) -> str:
        from .launcher import mask_argv, mask_env

        parts = [self.spec.name]
        if self.group is not None:
            parts.append(f"[{self.group.describe()}]")
        if self.extra_args:
            # The label goes to the terminal summary and the --sgl-report JSON: never an --api-key value.
            parts.append(" ".join(mask_argv(self.extra_args)))
        if self.group is not None:
            parts += [f"{role}: {' '.join(mask_argv(args))}" for role, args in self.group.role_args if args]
        if self.env:
            parts.append("env " + ",".join(f"{k}={v}" for k, v in mask_env(dict(self.env)).items()))
        if self.opt_out:
            parts.append(f"(budget opt-out: {self.opt_out})")
        return " ".join(parts)

    # -- members ------------------------------------------------------------------------------------------
    def members(self, choose: KindChooser | None = None) -> list[MemberPlan]:
        """One plan per process, in launch order (for a PD group: prefill workers first)."""
        choose = choose or default_kind
        roles = ["worker"] if self.group is None else self.group.roles()
        plans = []
        counts: dict[str, int] = {}
        for role in roles:
            args = (*self.extra_args, *(self.group.args_for(role) if self.group is not None else ()))
            index = counts.get(role, 0)
            counts[role] = index + 1
            # The kind sees the spec's worker_args too (``--grpc-mode`` in a spec); the plan keeps the extra args.
            plans.append(MemberPlan(role, index, choose(role, (*self.spec.worker_args, *args)), tuple(args)))
        return plans

    def gpus_needed(self, choose: KindChooser | None = None) -> int:
        """All GPUs the configuration leases at once."""
        return sum(member.gpus(self.spec) for member in self.members(choose))
