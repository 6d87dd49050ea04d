"""What to launch for a test: its worker configuration, the shape of its worker group, and the kind of each
member.

Plain Python, no pytest. A :class:`WorkerConfig` is everything that makes two workers (or two groups)
interchangeable: the spec, the test's extra args and env, and for a group its roles. It is the pool's key and
the xdist group name. :meth:`WorkerConfig.members` expands it into :class:`MemberPlan` s, one per process to
start, each with its :class:`~pytest_sglworker.workers.kinds.WorkerKind`, chosen by :func:`default_kind` (or a
plugin's ``pytest_sglworker_worker_kind`` hook, passed in as a :data:`KindChooser`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..engine.budget import check_argv, describe_violation
from ..engine.grpc_facts import wants_grpc
from ..engine.redaction import mask_argv, mask_env
from ..engine.specs import ModelSpec
from ..errors import BudgetViolation
from .grpc_worker import GrpcWorker
from .kinds import DecodeWorker, HttpWorker, PrefillWorker, WorkerKind

__all__ = ["GroupShape", "KindChooser", "MemberPlan", "WorkerConfig", "default_kind"]


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
    if wants_grpc(args):
        return GrpcWorker()
    return HttpWorker()


@dataclass(frozen=True)
class GroupShape:
    """The roles of a worker group: ``count`` regular workers, or ``prefill`` + ``decode`` workers. Per-role args
    are added after the group's own args, then one member's own args (``member_args``: ``(role, index, args)``);
    one member's own env (``member_env``: ``(role, index, env items)``) is added to the group's."""

    count: int = 0
    prefill: int = 0
    decode: int = 0
    role_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    member_args: tuple[tuple[str, int, tuple[str, ...]], ...] = ()
    member_env: tuple[tuple[str, int, tuple[tuple[str, str], ...]], ...] = ()

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
        sizes = {"worker": self.count, "prefill": self.prefill, "decode": self.decode}
        for role, index, _ in (*self.member_args, *self.member_env):
            if not 0 <= index < sizes.get(role, 0):
                raise ValueError(f"no {role} member {index} in a group of {self.describe()}")

    @property
    def is_pd(self) -> bool:
        return self.prefill > 0

    def roles(self) -> list[str]:
        if self.is_pd:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["worker"] * self.count

    def args_for(self, role: str, index: int | None = None) -> tuple[str, ...]:
        """The args of ``role`` (its members' shared ones), then those of its member ``index`` (when given)."""
        shared = dict(self.role_args).get(role, ())
        own = next((args for r, i, args in self.member_args if r == role and i == index), ())
        return (*shared, *own)

    def env_for(self, role: str, index: int) -> tuple[tuple[str, str], ...]:
        """The env of member ``index`` of ``role`` beyond the group's."""
        return next((env for r, i, env in self.member_env if r == role and i == index), ())

    @property
    def per_member(self) -> bool:
        """Whether some member has args or env of its own (beyond its role's)."""
        return bool(self.member_args or self.member_env)

    def describe(self) -> str:
        return f"{self.prefill}P+{self.decode}D" if self.is_pd else f"{self.count}x"


@dataclass(frozen=True)
class MemberPlan:
    """One process of a configuration: its role, its index within the role, its kind, its extra args (the
    test's, then its role's, then its own) and its own env (beyond the configuration's)."""

    role: str
    index: int
    kind: WorkerKind
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

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
            if self.group.per_member:
                canonical += (self.group.member_args, self.group.member_env)
        digest = hashlib.sha1(repr(canonical).encode()).hexdigest()[:8]
        return f"{self.spec.name}-{digest}"

    @property
    def label(self) -> str:
        parts = [self.spec.name]
        if self.group is not None:
            parts.append(f"[{self.group.describe()}]")
        if self.extra_args:
            # The label goes to the terminal summary and the --sgl-report JSON: never an --api-key value.
            parts.append(" ".join(mask_argv(self.extra_args)))
        if self.group is not None:
            parts += [f"{role}: {' '.join(mask_argv(args))}" for role, args in self.group.role_args if args]
            parts += [f"{role} {index}: {' '.join(mask_argv(args))}" for role, index, args in self.group.member_args
                      if args]
            parts += [f"{role} {index} env " + ",".join(f"{k}={v}" for k, v in mask_env(dict(env)).items())
                      for role, index, env in self.group.member_env if env]
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
            index = counts.get(role, 0)
            counts[role] = index + 1
            own = self.group.args_for(role, index) if self.group is not None else ()
            args = (*self.extra_args, *own)
            env = self.group.env_for(role, index) if self.group is not None else ()
            # The kind sees the spec's worker_args too (``--grpc-mode`` in a spec); the plan keeps the extra args.
            plans.append(MemberPlan(role, index, choose(role, (*self.spec.worker_args, *args)), tuple(args), env))
        return plans

    def gpus_needed(self, choose: KindChooser | None = None) -> int:
        """All GPUs the configuration leases at once."""
        return sum(member.gpus(self.spec) for member in self.members(choose))
