"""What sglang 0.5.23 does in ``--grpc-mode``, and what this Python needs to speak to it: engine knowledge that
the gRPC worker kind (:mod:`pytest_sglworker.workers.grpc_worker`), the router and the simulated engine's gRPC
server share.

Plain Python, no pytest. ``grpc`` and the generated stubs are imported lazily (:func:`grpc_module`,
:func:`proto`): the plugin is loaded by every pytest run and a run without gRPC workers never imports them.

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

"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .sglang_facts import flag_table

__all__ = [
    "DERIVED_GRPC_PORT_OFFSET",
    "GRPC_MODE_DESTS",
    "GRPC_PACKAGES",
    "INSTALL_HINT",
    "ROUTER_VOCAB_ENV",
    "ROUTER_VOCAB_FILE",
    "ROUTER_VOCAB_HINT",
    "SCHEDULER_SERVICE",
    "grpc_missing_reason",
    "grpc_module",
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
DERIVED_GRPC_PORT_OFFSET = 10000


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


# ---------------------------------------------------------------------------------------------- the router

#: sglang-router 0.3.2 builds its Harmony encoder with its gRPC router, from this file (SHA-256 checked).
ROUTER_VOCAB_FILE = "o200k_base.tiktoken"
ROUTER_VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ROUTER_VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"
ROUTER_VOCAB_HINT = "sglworker install-router-vocab"


def router_vocab_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder for the router's ``TIKTOKEN_ENCODINGS_BASE``: ``$TIKTOKEN_ENCODINGS_BASE``, else the default
    install folder (``sglworker install-router-vocab``: ``<user cache dir>/pytest-sglworker/tiktoken``), when its
    ``o200k_base.tiktoken`` has the router's hash; None otherwise (the router's gRPC mode then needs the network
    at startup)."""
    import hashlib
    import os

    from .install_dirs import default_router_vocab_dir

    environ = os.environ if environ is None else environ
    folder = Path(environ[ROUTER_VOCAB_ENV]) if environ.get(ROUTER_VOCAB_ENV) else default_router_vocab_dir()
    try:
        digest = hashlib.sha256((folder / ROUTER_VOCAB_FILE).read_bytes()).hexdigest()
    except OSError:
        return None
    return folder if digest == ROUTER_VOCAB_SHA256 else None


def grpc_module(name: str) -> Any:
    """``name`` imported now (by name: the optional gRPC packages have no type stubs, and a run without gRPC
    workers never imports them)."""
    return importlib.import_module(name)


def proto(name: str) -> Any:
    """A generated module of ``smg-grpc-proto`` (the servicer's own): ``proto("sglang_scheduler_pb2")``."""
    return getattr(grpc_module("smg_grpc_proto"), name)
