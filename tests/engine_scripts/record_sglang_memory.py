"""Record what the real sglang computes for a worker's memory plan, for each serving mode (``null``, ``prefill``,
``decode``) and a few flag sets, on a few card sizes: the sizes it resolves (chunked prefill, the decode graph's
largest batch, the prefill graph's buckets), its graph and DeepEP reserves and the ``--mem-fraction-static`` it
picks. Written as JSON to ``tests/data/sglang_memory.json``, which the default run compares with the memory ledger
(``tests/engine/test_sglang_memory_recorded.py``), without the real engine installed.

Run in the real engine's Python, from the repository root (re-record after an sglang upgrade)::

    SGLANG_USE_CPU_ENGINE=1 ~/.cache/pytest-sglworker/real-engine/bin/python \
        tests/engine_scripts/record_sglang_memory.py tests/data/sglang_memory.json

sglang's own functions are called (``handle_gpu_memory_settings``, ``reserve_for_graph_mb``,
``reserve_for_deepep_a2a_mb``), not ours: this script imports nothing of the plugin. Its memory functions read a
server-args record through attribute access only, so a namespace with the fields they read stands in for a full
``ServerArgs`` (whose construction would resolve a whole model); the card's size is given to them, as a GPU would.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import sys
from types import SimpleNamespace as NS
from typing import Any

from sglang.srt.arg_groups import memory_hook
from sglang.srt.arg_groups.model_overrides import qwen3_vl
from sglang.srt.configs.model_config import AttentionArch

MODEL = "Qwen/Qwen3-0.6B"
CARDS_MIB = (23034, 81559, 143771)  # a 24 GB card, an 80 GB H100, a 141 GB H200
MODES = ("null", "prefill", "decode")
#: flag sets: the worker args, and the server-args fields they set
FLAG_SETS: list[tuple[list[str], dict[str, Any]]] = [
    ([], {}),
    (["--cuda-graph-backend-prefill", "disabled"], {"prefill_backend": "disabled"}),
    (["--cuda-graph-backend-decode", "disabled"], {"decode_backend": "disabled"}),
    (["--max-running-requests", "16", "--chunked-prefill-size", "2048"],
     {"max_running_requests": 16, "chunked_prefill_size": 2048}),
    (["--moe-a2a-backend", "deepep"], {"moe_a2a_backend": "deepep"}),
    (["--attn-dp-size", "2"], {"attn_dp_size": 2}),
]


class _Cfg(NS):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, NS) and vars(self) == vars(other)


def server_args(mode: str, fields: dict[str, Any]) -> NS:
    return NS(device="cuda", chunked_prefill_size=fields.get("chunked_prefill_size"),
              max_running_requests=fields.get("max_running_requests"), tp_size=1, pp_size=1,
              cuda_graph_config=_Cfg(decode=_Cfg(backend=fields.get("decode_backend", "full"), max_bs=None, bs=None),
                                     prefill=_Cfg(backend=fields.get("prefill_backend", "breakable"), max_bs=None,
                                                  bs=None)),
              max_total_tokens=None, model_path=MODEL, mem_fraction_static=None, language_only=False,
              language_model_only=False, disaggregation_mode=mode, max_prefill_tokens=16384,
              speculative_num_draft_tokens=None, speculative_algorithm=None, disable_cuda_graph_padding=False,
              attn_dp_size=fields.get("attn_dp_size", 1), moe_a2a_backend=fields.get("moe_a2a_backend", "none"),
              ep_join_mode=None, enable_symm_mem=False, torch_compile_max_bs=None, _cuda_graph_config_locked=set(),
              _resolved_overrides=[],
              _model_config=NS(attention_arch=AttentionArch.MHA, is_multimodal=False, hf_config=NS()))


def record() -> dict[str, Any]:
    memory_hook.post_capture_kv_sizing_planned = lambda server_args: False  # the classic (pre-capture) sizing
    qwen3_vl.expand_multimodal_decode_graph_to_running_limit = lambda *args: None  # not a VLM
    cases = []
    for card in CARDS_MIB:
        memory_hook.get_device_memory_capacity = lambda device, card=card: card
        for mode in MODES:
            for argv, fields in FLAG_SETS:
                cfg = server_args(mode, fields)
                memory_hook.handle_gpu_memory_settings(cfg)
                resolved = copy.copy(cfg)
                for _, declared in cfg._resolved_overrides:
                    for name, value in declared.items():
                        setattr(resolved, name, value)
                graphs = resolved.cuda_graph_config
                cases.append({
                    "gpu_total_mib": card, "mode": mode,
                    "argv": ["--disaggregation-mode", mode, *argv] if mode != "null" else argv,
                    "chunked_prefill_size": resolved.chunked_prefill_size,
                    "decode_max_bs": graphs.decode.max_bs,
                    "prefill_buckets": len(graphs.prefill.bs or []),
                    "graph_reserve_mib": memory_hook.reserve_for_graph_mb(resolved),
                    "deepep_reserve_mib": memory_hook.reserve_for_deepep_a2a_mb(resolved),
                    "mem_fraction_static": resolved.mem_fraction_static,
                })
    return {"sglang": importlib.metadata.version("sglang"), "model": MODEL, "cases": cases}


def main() -> None:
    text = json.dumps(record(), indent=1, sort_keys=True) + "\n"
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
