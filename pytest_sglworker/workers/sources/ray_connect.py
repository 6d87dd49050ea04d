"""Joining the Ray cluster of ``--sgl-cluster`` (:mod:`.ray`): the option's value, Ray's import, a bounded
connection with a specific error for each way it fails (:class:`ClusterUnavailable`, a usage error at collection).
Plain Python, no pytest; ``ray`` is imported only in this mode.

Token authentication (Ray 2.60, the version the test extra installs): a cluster whose head runs with
``RAY_AUTH_MODE=token`` (which ``ray start --head`` turns on by itself when ``~/.ray/auth_token`` exists) answers only
clients that send its token.
Ray's client sends one only when its own process runs with ``RAY_AUTH_MODE=token``, taking the token from
``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``; for an address given
explicitly (``ray:HOST:PORT``, ``ray://HOST:PORT``, ``RAY_ADDRESS``) it never turns the mode on by itself. A client
without the token is not told so: ``ray.init`` retries until it gives up with ``Failed to connect to Ray cluster``
(a GCS address) or ``ray client connection timeout`` (Ray Client), tens of seconds later. So before ``ray.init``
the plugin makes the first call Ray's client makes (:func:`auth_refused`) with the credentials Ray would send
(:class:`RayAuth`, read on the main thread), and a cluster that refuses them is a usage error naming
``RAY_AUTH_MODE`` and the token file. The plugin sets nothing of Ray's: Ray reads the same variables of this
process when it joins, and the xdist workers inherit them.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
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
#: Ray's token authentication: the mode, the token itself, the file holding it, the default file (under ``HOME``)
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path(".ray") / "auth_token"
#: The first call of Ray's own client, made with this process's credentials: a GCS address's ``GetClusterId``, a
#: Ray Client server's ``ClusterInfo`` ping (``type: PING``, field 1 = 6), each as its raw request bytes.
GCS_AUTH_CALL = ("/ray.rpc.NodeInfoGcsService/GetClusterId", b"")
CLIENT_AUTH_CALL = ("/ray.rpc.RayletDriver/ClusterInfo", b"\x08\x06")
#: how long that call may take (within the connect timeout)
AUTH_CHECK_TIMEOUT = 10.0


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


@dataclass(frozen=True)
class RayAuth:
    """How Ray's client in this process authenticates, as Ray reads it from the environment (read on the main
    thread): the mode (``RAY_AUTH_MODE``, lowercased; None when unset) and the token Ray would send in that mode
    (``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``), with where it
    comes from (``source``) and the default file's path."""

    mode: str | None
    source: str
    default_file: Path
    token: str | None = field(default=None, repr=False)

    @property
    def sends_token(self) -> bool:
        return self.mode == "token" and bool(self.token)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata Ray's client sends (``authorization: Bearer <token>`` in token mode)."""
        return (("authorization", f"Bearer {self.token}"),) if self.sends_token else ()

    def describe(self) -> str:
        """This process's side, for a message: the mode, and the token Ray sends (where from) or why none."""
        mode = f"{AUTH_MODE_ENV}={self.mode}" if self.mode is not None else f"{AUTH_MODE_ENV} unset"
        if self.mode != "token":
            return f"{mode}: no token sent"
        if self.token:
            return f"{mode}, the token from {self.source}"
        return f"{mode} but no token found ({self.source})"

    def fix(self) -> str:
        """How to send the cluster's token."""
        return (f"run pytest with {AUTH_MODE_ENV}=token and the cluster's token in {self.default_file} (or in the "
                f"file {AUTH_TOKEN_PATH_ENV} names, or in {AUTH_TOKEN_ENV})")


def ray_auth(environ: Mapping[str, str] | None = None) -> RayAuth:
    """This process's :class:`RayAuth` (call it on the main thread: it reads ``environ``, default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    mode = environ.get(AUTH_MODE_ENV)
    home = environ.get("HOME")
    default_file = (Path(home) if home else Path.home()) / DEFAULT_TOKEN_FILE
    if environ.get(AUTH_TOKEN_ENV, "").strip():
        return RayAuth(mode.lower() if mode is not None else None, AUTH_TOKEN_ENV, default_file,
                       environ[AUTH_TOKEN_ENV].strip())
    named = environ.get(AUTH_TOKEN_PATH_ENV)
    path = Path(named).expanduser() if named else default_file
    where = f"{AUTH_TOKEN_PATH_ENV}={named}" if named else str(default_file)
    try:
        with path.open("rb") as file:  # bounded: a token is short
            token = file.read(4096).decode("utf-8", errors="replace").strip() or None
    except OSError as exc:
        token = None
        where = f"{where}: {exc.strerror or type(exc).__name__}"
    else:
        if token is None:
            where = f"{where}: empty"
    return RayAuth(mode.lower() if mode is not None else None, where, default_file, token)


def auth_refused(address: str, auth: RayAuth, timeout: float) -> bool | None:
    """Whether the cluster at ``address`` refuses ``auth``'s credentials: Ray's client's first call, made with
    them, answered ``UNAUTHENTICATED`` (True), answered otherwise (False); None when there is no verdict (gRPC
    missing, the call failed another way or took longer than ``timeout``: ``ray.init`` then says what it says)."""
    target = _host_port(address)
    if target is None:
        return None
    try:
        import grpc
    except ImportError:
        return None
    method, request = CLIENT_AUTH_CALL if address.startswith("ray://") else GCS_AUTH_CALL
    host, port = target
    with grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") as channel:
        call = channel.unary_unary(method)  # bytes in, bytes out: no Ray protobuf module needed
        try:
            call(request, timeout=timeout, metadata=auth.metadata())
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            return True if code == grpc.StatusCode.UNAUTHENTICATED else None
    return False


def _check_auth(cluster: ClusterSpec, address: str, auth: RayAuth, timeout: float) -> None:
    """:class:`ClusterUnavailable` when token mode has no token, or the cluster refuses this process's
    credentials: at once, instead of ``ray.init``'s retries."""
    if auth.mode == "token" and not auth.token:
        raise ClusterUnavailable(f"{cluster.raw!r}: {AUTH_MODE_ENV}=token but Ray finds no token to send: "
                                 f"{AUTH_TOKEN_ENV} unset, {auth.source}; {auth.fix()}")
    if address == "auto" or auth_refused(address, auth, timeout) is not True:
        return
    refused = "refused the token this process sends" if auth.sends_token else "requires token authentication"
    raise ClusterUnavailable(f"{cluster.raw!r}: the Ray cluster at {address} {refused} ({auth.describe()}); "
                             f"{auth.fix()}")


def cluster_address(cluster: ClusterSpec, environ: Mapping[str, str] | None = None) -> str:
    """The address ``ray.init`` joins: the spec's, or ``RAY_ADDRESS`` for ``ray`` (read on the main thread)."""
    environ = os.environ if environ is None else environ
    return (environ.get("RAY_ADDRESS") or "auto") if cluster.address == "auto" else cluster.address


def connect(ray: Any, cluster: ClusterSpec, address: str, timeout: float, auth: RayAuth) -> None:
    """Join the cluster at ``address`` (bounded: a TCP check of the address, a check that it takes this process's
    credentials (``auth``, read on the main thread), then ``ray.init`` within ``timeout``); :class:`ClusterUnavailable`
    says why not."""
    why = _probe(address, min(timeout, 5.0)) if address != "auto" else None
    if why is not None:
        raise ClusterUnavailable(f"{cluster.raw!r}: the Ray cluster is unreachable: {why}")
    if ray.is_initialized():
        return
    _check_auth(cluster, address, auth, min(timeout, AUTH_CHECK_TIMEOUT))
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
        raise ClusterUnavailable(f"{cluster.raw!r}: no answer from the Ray cluster at {address} within {timeout:g} s"
                                 f"{_auth_hint(auth)}")
    if "error" in done:
        raise ClusterUnavailable(f"{cluster.raw!r}: cannot join the Ray cluster at {address}: {_why(done['error'])}"
                                 f"{_auth_hint(auth)}")


def _auth_hint(auth: RayAuth) -> str:
    """For a failure with no verdict on the credentials: a cluster with token authentication fails a client
    without its token this way too."""
    if auth.sends_token:
        return ""
    return f" (a Ray cluster with token authentication fails a client without its token this way: {auth.describe()})"


def _why(error: BaseException) -> str:
    """An error's first line; when that line only introduces what follows (Ray Client's ``Initialization failure
    from server:`` and the server's traceback), the traceback's last line too: the server's own reason."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[-1]}"
    return lines[0]
