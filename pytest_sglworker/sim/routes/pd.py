"""Prefill/decode disaggregation on the simulated engine's HTTP server: the checks and the handshake every
generation request of a PD server goes through (``/generate``, ``/v1/chat/completions``, ``/v1/completions``).

Part of :mod:`pytest_sglworker.sim`; stdlib only. The main server has no PD paths of its own: the prefill side's
bootstrap routes are served on their own port by :mod:`pytest_sglworker.sim.pd`, which also holds the handshakes
this module calls.
"""

from __future__ import annotations

from typing import Any

from .. import pd as sim_pd
from ..state import Sim
from ..tokens import Generation
from .common import Abort, BadRequest


def handshake(sim: Sim, req: dict[str, Any], rid: str, gen: Generation | None = None) -> None:
    """The PD checks and handshake of one request (nothing in a plain server); raises BadRequest/Abort."""
    mode = sim.mode
    if mode == "null":
        return
    room = req.get("bootstrap_room")
    host = req.get("bootstrap_host")
    fake = sim.plan.args.get("disaggregation_transfer_backend") == "fake" or host == sim_pd.FAKE_BOOTSTRAP_HOST
    if isinstance(room, list):
        room = room[0] if room else None
    if isinstance(host, list):
        host = host[0] if host else None
    if room is None and not fake:
        message = f"Invalid request: Disaggregated request received without bootstrap room id. req.rid={rid!r}"
        sim.log.rank0(message, level=40)
        raise BadRequest(message)
    if fake or room is None:
        return
    if not isinstance(room, int) or isinstance(room, bool):
        raise BadRequest(f"1 validation error:\n  bootstrap_room: Input should be a valid integer, got {room!r}",
                         validation=True)
    port = req.get("bootstrap_port")
    if isinstance(port, list):
        port = port[0] if port else None
    sim.loads.pd_wait(True)  # in its PD queue (prefill: bootstrap; decode: pre-allocation) until the peer is there
    try:
        if mode == "decode":
            sim_pd.decode_handshake(sim.prefill_infos, str(host), int(port or 8998), room, rid, sim.pd_wait,
                                    sim.log)
        elif sim.bootstrap is not None:
            info = {"prompt_tokens": gen.prompt_tokens if gen else 0,
                    "first_token": gen.output_ids[0] if gen and gen.output_ids else None}
            sim_pd.prefill_handshake(sim.bootstrap, room, rid, info, sim.pd_wait)
    except sim_pd.PDError as exc:
        sim.log.rank0(str(exc), level=40)
        raise Abort(str(exc), exc.status) from None
    finally:
        sim.loads.pd_wait(False)
