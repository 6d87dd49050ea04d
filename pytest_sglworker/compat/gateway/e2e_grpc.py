"""Upstream's older gRPC suite (``e2e_test/e2e_grpc/``), served by the plugin: the modules ``fixtures`` and ``util``
its test files import, for those files only.

Each file of that suite puts its folder's parent on ``sys.path`` and says ``from fixtures import
popen_launch_workers_and_router`` and ``from util import DEFAULT_MODEL_PATH, ..., kill_process_tree``; its
unittest classes start a gRPC cluster in ``setUpClass`` and end it in ``tearDownClass`` with
``kill_process_tree(cluster["router"].pid)`` and the same for each worker. Here:

- :func:`popen_launch_workers_and_router` (upstream's signature): ``num_workers`` workers of the spec that serves
  ``model`` in ``--grpc-mode`` (``--tp-size`` when ``tp_size`` > 1, ``worker_args`` checked against the budget),
  from the plugin's pool (a GPU lease per worker, a port block, a log file, the readiness wait, a startup failure
  with its diagnosis), and the real ``sglang-router`` in front of them on ``base_url``'s port (its Prometheus port
  the next one: upstream's fixed 9321 collides between sessions), with ``--api-key`` and ``router_args``; ready
  when it returns. It returns upstream's dict: ``workers``, ``worker_urls``, ``router``, ``base_url``; each process
  is :class:`ClusterProcess` (``pid``, ``poll()``, ``wait()``, ``terminate()``, ``kill()``). Upstream's
  ``--mem-fraction-static 0.8`` is not added (the spec's budget holds), nor its 20 s sleep (the workers are proven
  ready before the router starts).
- ``util`` (:mod:`.grpc_util`): ``kill_process_tree`` that ends a cluster's router (stopped, its ports given back)
  and gives its workers back to the pool (where the next class of the same configuration finds them running), and
  is sglang's for any other pid; the model paths (``DEFAULT_MODEL_PATH`` is the path the spec serving ``llama-8b``
  loads, ...), sglang's ``DEFAULT_URL_FOR_TEST`` and ``DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH``, ``CustomTestCase``
  and ``get_tokenizer``.
- Who owns a cluster: the test class whose ``setUpClass`` started it (the test, when a test's call did). What its
  ``tearDownClass`` leaves running is ended after the class, and the run says so.

Why only for files under an ``e2e_grpc/`` folder (:mod:`.scoped_modules`): ``fixtures`` and ``util`` are common
module names. The drop-in's modules sit in ``sys.modules`` only while pytest imports such a file, and whatever was
there before (a suite's own ``util``) is put back after, so every other file imports its own. A ``fixtures.py`` or
``util.py`` of upstream's beside the files is not imported for them (``sys.modules`` is consulted before the
path): upstream's starts ``python3 -m sglang.launch_server`` itself, outside any pool, lease or budget.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from ...workers.config import GroupShape
from ..models import CompatError
from .constants import ConnectionMode

if TYPE_CHECKING:
    from ...resources.ports import PortBlock
    from ...workers.router import Router
    from .runtime import GatewayRuntime, _Held

__all__ = ["NOT_OFFERED", "Cluster", "ClusterProcess", "end_cluster_process", "kill_process_tree",
           "popen_launch_workers_and_router"]

#: upstream ``fixtures`` names the drop-in does not offer, and why
NOT_OFFERED = {
    "find_free_port": "a port from bind(0) races other processes; the plugin reserves port blocks for workers and "
                      "routers",
    "wait_for_workers_ready": "popen_launch_workers_and_router returns once the router lists every worker healthy",
}

#: the clusters started in this process, by the pid of each of their processes
_CLUSTERS: dict[int, Cluster] = {}


class ClusterProcess:
    """A router or worker of a cluster, shaped like the ``subprocess.Popen`` upstream returns."""

    stdin = stdout = stderr = None

    def __init__(self, process: Any, args: Sequence[str]) -> None:
        self._process = process
        self.args = list(args)

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        code: int | None = self._process.process.poll()
        return code

    def wait(self, timeout: float | None = None) -> int:
        return int(self._process.process.wait(timeout))

    def terminate(self) -> None:
        """End it as ``kill_process_tree(pid)`` does."""
        end_cluster_process(self.pid)

    kill = terminate

    def send_signal(self, sig: int) -> None:
        if sig in (signal.SIGTERM, signal.SIGKILL):
            self.terminate()
        else:
            self._process.process.send_signal(sig)

    def __repr__(self) -> str:
        return f"<ClusterProcess {self._process.describe()}>"


@dataclasses.dataclass(eq=False)
class Cluster:
    """One ``popen_launch_workers_and_router`` launch: its workers' group and its router, and who owns them."""

    runtime: GatewayRuntime
    owner: str
    held: _Held
    router: Router | None = None
    #: what the run says to call when the owner left the router running
    fix: str = "kill_process_tree(cluster['router'].pid) in tearDownClass"
    guards: list[PortBlock] = dataclasses.field(default_factory=list)

    def pids(self) -> list[int]:
        return [m.pid for m in self.held.group] + ([self.router.pid] if self.router is not None else [])

    def end(self, pid: int) -> None:
        """``kill_process_tree(pid)``: the router stopped; a worker's group given back to the pool."""
        if self.router is not None and pid == self.router.pid:
            self.runtime.close_router(self)
            self._release_guards()
        elif any(m.pid == pid for m in self.held.group):
            self.runtime.give_back(self.held)  # once: the group's other workers' pids then find it given back

    def _release_guards(self) -> None:
        for guard in self.guards:
            guard.release()
        self.guards.clear()

    def forget(self) -> None:
        for pid in [p for p, c in _CLUSTERS.items() if c is self]:
            del _CLUSTERS[pid]

    def after_owner(self) -> None:
        """After the owner's teardown: what it left running is ended (the runtime says so), the group given back."""
        try:
            self.runtime.release(self.owner, after=f"the teardown of {self.owner}", check=False)
        finally:
            self._release_guards()
            self.forget()


def end_cluster_process(pid: int) -> bool:
    """End ``pid`` when it is a router or worker of a cluster of this process (True), else False."""
    cluster = _CLUSTERS.get(pid)
    if cluster is None:
        return False
    cluster.end(pid)
    return True


def _owner(rt: GatewayRuntime, calling: bool) -> tuple[str, Any]:
    """``(owner, node)``: the class whose ``setUpClass`` runs now; a launch in a test's own call (``calling``) is
    that test's, given back after its teardown by the runtime."""
    item = rt.item
    if item is None:
        return "the session", None
    cls = item.getparent(pytest.Class)
    if cls is not None and not calling:
        return cls.nodeid, cls
    return item.nodeid, None


def _model_id(model: str) -> str:
    """The suite's model id of ``model``: the one a ``util.DEFAULT_*_MODEL_PATH`` was read for, an id or upstream's
    Hugging Face name of one; else ``model`` itself (a path or name a spec serves)."""
    from .e2e_http import model_id_of

    if not isinstance(model, str) or not model:
        raise CompatError(f"popen_launch_workers_and_router: model must be a model id, name or path, got {model!r}")
    return str(getattr(model, "model_id", None) or model_id_of(model))


def _where(error: CompatError) -> CompatError:
    return CompatError(str(error).replace("popen_launch_server", "popen_launch_workers_and_router"))


def popen_launch_workers_and_router(
    model: str,
    base_url: str,
    timeout: int = 300,
    num_workers: int = 2,
    policy: str = "round_robin",
    api_key: str | None = None,
    worker_args: Sequence[Any] | None = None,
    router_args: Sequence[Any] | None = None,
    tp_size: int = 1,
    env: Mapping[str, Any] | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> dict[str, Any]:
    """Upstream's ``popen_launch_workers_and_router`` (same signature), on the plugin: see the module docstring.
    ``timeout`` is the router's readiness timeout, as upstream's; ``stdout``/``stderr`` are not used (every process
    logs to its own file, shown in the report of a test that fails); ``env`` is refused (workers of a pool share
    their configuration: put variables in the spec's ``env``)."""
    __tracebackhide__ = True
    from ..launches import parse_base_url
    from ..launches import runtime as compat_runtime
    from .runtime import runtime_or_error

    del stdout, stderr
    rt = runtime_or_error("popen_launch_workers_and_router")
    if env:
        raise CompatError(f"popen_launch_workers_and_router(env={sorted(env)!r}): workers from the plugin's pool share "
                          "their configuration; set these variables in the model spec's env (ModelSpec(env=...))")
    for name, value in (("worker_args", worker_args), ("router_args", router_args)):
        if isinstance(value, str):
            raise CompatError(f"popen_launch_workers_and_router({name}=...) is a list of arguments, not the string "
                              f"{value!r}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise CompatError(f"popen_launch_workers_and_router(num_workers={num_workers!r}): at least one worker")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise CompatError(f"popen_launch_workers_and_router(tp_size={tp_size!r}): a positive number of GPUs")
    try:
        _, port = parse_base_url(base_url)
    except CompatError as exc:
        raise _where(exc) from None
    pinner = compat_runtime()
    assert pinner is not None  # a session runs: rt is its runtime
    owner, node = _owner(rt, calling=pinner.calling is not None)
    extra = tuple(str(a) for a in worker_args or ()) + (("--tp-size", str(tp_size)) if tp_size > 1 else ())
    args = [*(["--api-key", str(api_key)] if api_key else []), *(str(a) for a in router_args or ())]
    with rt.owning(owner):
        model_id = _model_id(model)
        held = rt.group(model_id, ConnectionMode.GRPC, GroupShape(count=num_workers), fresh_owner=True, extra=extra)
        cluster = Cluster(rt, owner, held)
        try:
            options, cluster.guards = pinner.pin_port(port, base_url=base_url,
                                                      where=f"popen_launch_workers_and_router in {owner}")
            router_options = dataclasses.replace(rt.session.router_options(), port_range=options.port_range,
                                                 reuse_addr=True, on_message=options.on_port_wait)
            cluster.router = rt.start_router(cluster, list(held.group), policy=policy, args=args,
                                             timeout=float(timeout), options=router_options)
        except BaseException:
            cluster.after_owner()
            raise
    for pid in cluster.pids():
        _CLUSTERS[pid] = cluster
    if node is not None:
        # added while the class's setUpClass runs, so it runs after that fixture's own teardown (tearDownClass)
        node.addfinalizer(cluster.after_owner)
    router = cluster.router
    return {"workers": [ClusterProcess(m, m.argv) for m in held.group],
            "worker_urls": [m.url for m in held.group],
            "router": ClusterProcess(router, router.argv),
            "base_url": router.url}


def kill_process_tree(parent_pid: int | None, include_parent: bool = True, skip_pid: int | None = None,
                      wait_timeout: float | None = 60) -> None:
    """sglang's ``kill_process_tree`` (same signature): a cluster's router or worker is ended through the plugin
    (:meth:`Cluster.end`); a server of ``popen_launch_server`` likewise; any other pid as sglang does."""
    from ..dropins import kill_process_tree as compat_kill

    if parent_pid is not None and include_parent and skip_pid is None and end_cluster_process(parent_pid):
        return
    compat_kill(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)
