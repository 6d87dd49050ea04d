"""The simulated engine's HTTP endpoints, one module per endpoint family, each declaring its routes in a table
(``ROUTES``: :class:`~.common.Route` records, methods and path -> a function taking the request context).

A new endpoint family is one new module with its ``ROUTES`` plus one line in :data:`FAMILIES`; what routes share
(the request context and its replies, the request checks, the error envelopes, the request-fault hook) is in
:mod:`.common`. The dispatch is :class:`pytest_sglworker.sim.server.Handler`'s.

- :mod:`.admin`: health and readiness, model and server info, the cache flush, the metrics, ``/_sim/faults``;
- :mod:`.generate`: sglang's native ``/generate`` and ``/encode``;
- :mod:`.openai`: the OpenAI-compatible ``/v1/...`` endpoints;
- :mod:`.anthropic`: the Anthropic-compatible ``/v1/messages`` and ``/v1/messages/count_tokens``;
- :mod:`.tokenizer`: ``/tokenize``, ``/detokenize``, ``/v1/score``;
- :mod:`.sessions`: ``/abort_request`` and the session routes;
- :mod:`.loads`: ``/v1/loads`` and the legacy ``/get_load`` (the requests in flight, per DP rank);
- :mod:`.pd`: the prefill/decode checks and handshake of the generation requests (the PD bootstrap routes
  have their own server and port: :mod:`pytest_sglworker.sim.pd`).
"""

from __future__ import annotations

from . import admin, anthropic, generate, loads, openai, sessions, tokenizer
from .common import Route

#: The endpoint families of the simulated engine's HTTP server.
FAMILIES = (
    admin,
    generate,
    openai,
    anthropic,
    tokenizer,
    loads,
    sessions,
)
#: Every route of the HTTP server.
ROUTES: tuple[Route, ...] = tuple(route for family in FAMILIES for route in family.ROUTES)

__all__ = ["FAMILIES", "ROUTES", "Route"]
