"""Run in the real engine's Python (PYTHONPATH = the repository): compares pytest_sglworker.engine.sglang_facts with
sglang's own code and prints one JSON line of findings. Used by tests/engine/test_sglang_facts_real.py.

sglang's memory functions read a server-args record through attribute access only, so a namespace with the
fields they read stands in for a full ``ServerArgs`` (whose construction would resolve a whole model)."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import sys
from types import SimpleNamespace as NS
from typing import Any

from sglang.srt.arg_groups import cuda_graph_hook, memory_hook
from sglang.srt.arg_groups.model_overrides import qwen3_vl
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.server_args import ServerArgs

from pytest_sglworker.engine import ledger
from pytest_sglworker.engine import sglang_facts as facts

findings: dict[str, Any] = {"sglang": importlib.metadata.version("sglang")}

# 1. the parser: the committed table is what add_cli_args builds, option for option
parser = argparse.ArgumentParser(prog=facts.PARSER_PROG)
ServerArgs.add_cli_args(parser)
findings["flags_equal"] = facts.flags_document(parser, findings["sglang"])["flags"] == json.loads(
    facts._DATA_FILE.read_text(encoding="utf-8"))["flags"]
# every flag's shortest abbreviation by our resolver selects that flag in the real parser, one character less does not
mismatched = []
table = facts.flag_table()
for flag in table.flags:
    prefix = table.shortest_prefix(flag.dest)
    if prefix == flag.name:
        continue
    action = parser._option_string_actions.get(prefix)
    tuples = parser._get_option_tuples(prefix)
    if action is None and {t[0].dest for t in tuples} != {flag.dest}:
        mismatched.append(prefix)
findings["abbreviations_mismatched"] = mismatched[:20]

# 2. capture sizes
findings["prefill_sizes_equal"] = all(
    cuda_graph_hook.generate_prefill_cuda_graph_batch_sizes(n) == facts.prefill_capture_sizes(n)
    for n in (8, 512, 2048, 4096, 8192, 16384))
findings["decode_sizes_equal"] = all(
    cuda_graph_hook.generate_decode_cuda_graph_batch_sizes(
        NS(_resolved_overrides=[], disable_cuda_graph_padding=False, speculative_algorithm=None), n
    ) == facts.decode_capture_sizes(n) for n in (8, 48, 160, 256, 512))


# 3. graph and DeepEP reserves
class _Cfg(NS):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, NS) and vars(self) == vars(other)


def model_config(mla: bool = False) -> NS:
    return NS(attention_arch=AttentionArch.MLA if mla else AttentionArch.MHA, is_multimodal=False, hf_config=NS())


reserve_bad = []
cases = 0
for mode, dec, pre, attn_dp, a2a, max_bs, mla in itertools.product(
        ("null", "prefill", "decode"), ("full", "disabled"), ("breakable", "full", "disabled"), (1, 4),
        ("none", "deepep"), (48, 512), (False, True)):
    cfg = NS(disaggregation_mode=mode, attn_dp_size=attn_dp, moe_a2a_backend=a2a, ep_join_mode=None,
             cuda_graph_config=NS(decode=NS(backend=dec, max_bs=max_bs),
                                  prefill=NS(backend=pre, bs=facts.prefill_capture_sizes(8192))),
             _model_config=model_config(mla))
    theirs = (memory_hook.reserve_for_graph_mb(cfg), memory_hook.reserve_for_deepep_a2a_mb(cfg))
    ours = (facts.graph_reserve_mib(mode=mode, decode_backend=dec, decode_max_bs=max_bs, prefill_backend=pre,
                                    prefill_buckets=58, dp_attention=attn_dp > 1, attn_dp_size=attn_dp, mla=mla,
                                    deepep=a2a == "deepep"),
            facts.deepep_reserve_mib(mode=mode, decode_backend=dec, deepep=a2a == "deepep"))
    cases += 1
    if theirs != ours:
        reserve_bad.append([mode, dec, pre, attn_dp, a2a, max_bs, mla, theirs, ours])
findings["reserve_cases"] = cases
findings["reserve_mismatches"] = reserve_bad[:10]

# 4. the automatic --mem-fraction-static of handle_gpu_memory_settings against the ledger's
memory_hook.post_capture_kv_sizing_planned = lambda server_args: False  # the classic (pre-capture) sizing
qwen3_vl.expand_multimodal_decode_graph_to_running_limit = lambda *args: None  # not a VLM
fraction_bad = []
cases = 0
for total, mode, chunked, dec, pre, running, tp, a2a, attn_dp in itertools.product(
        (15000, 23034, 40960, 81559, 143771, 196608), ("null", "prefill", "decode"), (None, 2048),
        ("full", "disabled"), ("breakable", "disabled"), (None, 16), (1, 4), ("none", "deepep"), (1, 2)):
    memory_hook.get_device_memory_capacity = lambda device, total=total: total
    cfg = NS(device="cuda", chunked_prefill_size=chunked, max_running_requests=running, tp_size=tp, pp_size=1,
             cuda_graph_config=_Cfg(decode=_Cfg(backend=dec, max_bs=None, bs=None),
                                    prefill=_Cfg(backend=pre, max_bs=None, bs=None)),
             max_total_tokens=None, model_path="Qwen/Qwen3-0.6B", mem_fraction_static=None, language_only=False,
             language_model_only=False, disaggregation_mode=mode, max_prefill_tokens=16384,
             speculative_num_draft_tokens=None, speculative_algorithm=None, disable_cuda_graph_padding=False,
             attn_dp_size=attn_dp, moe_a2a_backend=a2a, ep_join_mode=None, enable_symm_mem=False,
             torch_compile_max_bs=None, _cuda_graph_config_locked=set(), _resolved_overrides=[],
             _model_config=model_config())
    memory_hook.handle_gpu_memory_settings(cfg)
    resolved: dict[str, Any] = {}
    for _, declared in cfg._resolved_overrides:
        resolved.update(declared)
    argv = ["--disaggregation-mode", mode, "--cuda-graph-backend-decode", dec, "--cuda-graph-backend-prefill", pre,
            "--tp-size", str(tp), "--moe-a2a-backend", a2a, "--attn-dp-size", str(attn_dp)]
    argv += ["--chunked-prefill-size", str(chunked)] if chunked else []
    argv += ["--max-running-requests", str(running)] if running else []
    ours = ledger.predict_memory(facts.MODEL_DIMS["Qwen/Qwen3-0.6B"], total, argv=argv, tp=tp).mem_fraction_static
    cases += 1
    if resolved["mem_fraction_static"] != ours:
        fraction_bad.append([total, mode, chunked, dec, pre, running, tp, a2a, attn_dp,
                             resolved["mem_fraction_static"], ours])
findings["fraction_cases"] = cases
findings["fraction_mismatches"] = fraction_bad[:10]
sys.stdout.write("@@FINDINGS@@ " + json.dumps(findings) + "\n")
