"""Upstream's ``ModelPool`` over the plugin's pool of worker groups (:class:`~.runtime.GatewayRuntime` owns what it
hands out). Workers start when first asked for, not all up front."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ...workers.config import GroupShape
from .collect import Wanted, selected_out
from .constants import ENV_SKIP_MODEL_POOL, ConnectionMode, WorkerType
from .runtime import GatewayRuntime, ModelInstance, WorkerIdentity, runtime_or_error

__all__ = ["ModelPool"]

_TRUE = ("1", "true", "yes")


def _shape(count: int = 1, prefill: int = 0, decode: int = 0) -> GroupShape:
    return GroupShape(prefill=prefill, decode=decode) if prefill or decode else GroupShape(count=count)


class ModelPool:
    """Upstream's ``ModelPool`` over the plugin's pool: ``get(model_id, mode)``, ``get_workers_by_type``,
    ``launch_workers``, ``launch_pd_workers``, ``get_client``, ``get_base_url``, ``instances``, ``shutdown()``.
    Workers start when first asked for (not all up front); ``SKIP_MODEL_POOL=1`` makes it an empty pool whose
    ``get`` raises ``KeyError`` (the tests that need a worker then skip, as upstream's do), and so does a ``get`` of
    a model or backend that ``E2E_MODELS`` / ``E2E_BACKENDS`` leave out (upstream's pool starts only those)."""

    def __init__(self, rt: GatewayRuntime | None = None, *, empty: bool | None = None) -> None:
        self._rt = rt or runtime_or_error("infra.ModelPool")
        self.empty = os.environ.get(ENV_SKIP_MODEL_POOL, "").lower() in _TRUE if empty is None else empty

    @property
    def instances(self) -> dict[str, ModelInstance]:
        return {inst.key: inst for held in self._rt.held for inst in held.instances}

    def get(self, model_id: str, mode: ConnectionMode | str = ConnectionMode.HTTP) -> ModelInstance:
        """A running worker of ``model_id`` in ``mode`` (one already held in this scope, else one from the pool)."""
        mode = ConnectionMode(mode)
        if self.empty:
            raise KeyError(f"{model_id}:{mode.value} ({ENV_SKIP_MODEL_POOL} is set: the pool starts no worker)")
        left_out = selected_out(Wanted(model_id, mode, _shape(), mode.value))
        if left_out:
            raise KeyError(left_out)
        return self._rt.group(model_id, mode, _shape()).instances[0]

    def get_workers_by_type(self, model_id: str, worker_type: WorkerType | str) -> list[ModelInstance]:
        """The running workers of ``model_id`` of that type held in this scope (none launched here)."""
        worker_type = WorkerType(worker_type)
        return [inst for held in self._rt.held if held.model_id == model_id for inst in held.instances
                if inst.worker_type == worker_type]

    def launch_workers(self, workers: Sequence[WorkerIdentity], startup_timeout: float | None = None
                       ) -> list[ModelInstance]:
        """Workers for these identities: the regular ones of one model and mode as one group of that count, the
        prefill and decode ones as one prefill/decode group (a group is the plugin's unit of launch and reuse)."""
        del startup_timeout  # the session's startup timeout (E2E_STARTUP_TIMEOUT) applies
        if self.empty:
            raise KeyError(f"{ENV_SKIP_MODEL_POOL} is set: the pool starts no worker")
        out: list[ModelInstance] = []
        by_shape: dict[tuple[str, ConnectionMode, bool], list[WorkerIdentity]] = {}
        for ident in workers:
            pd = WorkerType(ident.worker_type) != WorkerType.REGULAR
            by_shape.setdefault((ident.model_id, ConnectionMode(ident.mode), pd), []).append(ident)
        for (model_id, mode, pd), idents in by_shape.items():
            if pd:
                prefill = sum(1 for i in idents if WorkerType(i.worker_type) == WorkerType.PREFILL)
                decode = len(idents) - prefill
                shape = _shape(prefill=max(prefill, 1), decode=max(decode, 1))
            else:
                shape = _shape(count=len(idents))
            out += self._rt.group(model_id, mode, shape, fresh_owner=True).instances
        return out

    def launch_pd_workers(self, model_id: str, num_prefill: int = 1, num_decode: int = 1,
                          startup_timeout: float | None = None) -> tuple[list[ModelInstance], list[ModelInstance]]:
        del startup_timeout
        held = self._rt.group(model_id, ConnectionMode.HTTP, _shape(prefill=num_prefill, decode=num_decode))
        return ([i for i in held.instances if i.worker_type == WorkerType.PREFILL],
                [i for i in held.instances if i.worker_type == WorkerType.DECODE])

    def get_base_url(self, model_id: str) -> str:
        return self.get(model_id).base_url

    def get_client(self, model_id: str) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.get_base_url(model_id)}/v1", api_key="not-used")

    def startup(self, requirements: Any = None, startup_timeout: Any = None) -> None:
        """Upstream starts its workers here; the plugin starts each when first asked for."""

    def shutdown(self) -> None:
        """Upstream ends its workers here; the plugin gives them back when their owners end."""


