"""Joining the Ray cluster of ``--sgl-cluster`` (:mod:`.ray`): the option's value, Ray's import, a bounded
connection with a specific error for each way it fails (:class:`ClusterUnavailable`, a usage error at collection).
Plain Python, no pytest; ``ray`` is imported only in this mode."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import InventoryUnavailable

INSTALL_HINT = "pip install 'pytest-sglworker[ray]'"
#: How long connecting to the cluster may take before it is called unreachable (after its address answered a TCP
#: check): a GCS address, and a Ray Client address (``ray://``), whose server starts a process of its own for each
#: new client (it imports Ray: seconds on an idle machine, past 15 s on a loaded 2-core CI runner). The client
#: bound is beyond the Ray Client server's own (``RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S``, 30 s by default, set
#: on the head node), so that a server that gives up says why itself.
CONNECT_TIMEOUT = 15.0
CLIENT_CONNECT_TIMEOUT = 120.0
#: the Ray namespace of the plugin's drivers (the hosts the xdist controller starts ahead are looked up there)
NAMESPACE = "pytest-sglworker"


class ClusterUnavailable(InventoryUnavailable):
    """Ray is not installed, or the cluster cannot be reached: a usage error at collection."""


@dataclass(frozen=True)
class ClusterSpec:
    """A parsed ``--sgl-cluster`` value: ``ray`` (``address="auto"``: ``RAY_ADDRESS`` or the local cluster),
    ``ray://HOST:PORT`` (Ray Client) or ``ray:HOST:PORT`` (a GCS address, joined as a driver)."""

    raw: str
    address: str

    def describe(self) -> str:
        return f"Ray cluster {self.address}" if self.address != "auto" else "Ray cluster (address auto)"


def parse_cluster(value: str) -> ClusterSpec | None:
    """``--sgl-cluster``: ``off``/``local`` (None), ``ray``, ``ray://HOST:PORT``, ``ray:HOST:PORT``."""
    text = value.strip()
    if text.lower() in ("", "off", "local", "none"):
        return None
    if text == "ray":
        return ClusterSpec(text, "auto")
    for prefix, keep in (("ray://", True), ("ray:", False)):
        if text.startswith(prefix):
            rest = text[len(prefix):]
            host, sep, port = rest.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{value!r}: give the cluster as {prefix}HOST:PORT (e.g. {prefix}127.0.0.1:"
                                 f"{10001 if keep else 6379})")
            return ClusterSpec(text, text if keep else rest)
    raise ValueError(f"{value!r} is not a cluster; choose 'ray', 'ray://HOST:PORT', 'ray:HOST:PORT' or 'off'")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ClusterUnavailable(f"Ray is needed for a Ray cluster but is not installed here ({exc}); install it "
                                 f"with {INSTALL_HINT}") from None
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    text = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _probe(address: str, timeout: float) -> str | None:
    """Why ``address`` cannot be reached (a refused or timed-out TCP connect), or None: a bounded check
    before ``ray.init``, which would retry for a long time."""
    target = _host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout):
            return None
    except OSError as exc:
        return f"cannot connect to {target[0]}:{target[1]} ({exc.strerror or type(exc).__name__})"


def cluster_address(cluster: ClusterSpec, environ: Mapping[str, str] | None = None) -> str:
    """The address ``ray.init`` joins: the spec's, or ``RAY_ADDRESS`` for ``ray`` (read on the main thread)."""
    environ = os.environ if environ is None else environ
    return (environ.get("RAY_ADDRESS") or "auto") if cluster.address == "auto" else cluster.address


def connect(ray: Any, cluster: ClusterSpec, address: str, timeout: float) -> None:
    """Join the cluster at ``address`` (bounded: a TCP check of the address, then ``ray.init`` within ``timeout``);
    :class:`ClusterUnavailable` says why not."""
    why = _probe(address, min(timeout, 5.0)) if address != "auto" else None
    if why is not None:
        raise ClusterUnavailable(f"{cluster.raw!r}: the Ray cluster is unreachable: {why}")
    if ray.is_initialized():
        return
    done: dict[str, Any] = {}

    def init() -> None:
        import logging

        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR,
                     ignore_reinit_error=True)
        except BaseException as exc:  # handed to the caller
            done["error"] = exc
        done["ok"] = True

    thread = threading.Thread(target=init, name="sglworker-ray-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if "ok" not in done:
        raise ClusterUnavailable(f"{cluster.raw!r}: no answer from the Ray cluster at {address} within {timeout:g} s")
    if "error" in done:
        raise ClusterUnavailable(f"{cluster.raw!r}: cannot join the Ray cluster at {address}: {_why(done['error'])}")


def _why(error: BaseException) -> str:
    """An error's first line; when that line only introduces what follows (Ray Client's ``Initialization failure
    from server:`` and the server's traceback), the traceback's last line too: the server's own reason."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[-1]}"
    return lines[0]
