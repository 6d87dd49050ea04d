"""The simulated engine's plan: the resolved configuration of one server and its memory arithmetic.

Part of :mod:`pytest_sglworker.sim`. :func:`make_plan` resolves sglang's defaults from the parsed flags (the
CUDA-graph backends, the chunked-prefill size, the capture buckets) and does the engine's memory arithmetic with
:func:`pytest_sglworker.engine.ledger.predict_memory` (the automatic ``--mem-fraction-static``, the KV pool's
``#tokens``), over the model's dims (:func:`model_facts`: the built-in table, or a model directory's
``config.json``); the startup prints what it says (:mod:`.startup`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from ..engine.sglang_facts import (
    MODEL_DIMS,
    ModelDims,
    activation_reserve_mib,
    activation_tokens,
    automatic_fraction,
    card_defaults,
    graph_reserve_mib,
    kv_pool_tokens,
    prefill_capture_sizes,
    total_reserve_mib,
)
from .vocab import ModelDir, load_model_dir


@dataclass(frozen=True)
class Plan:
    """The resolved configuration and the memory arithmetic of one simulated server (MiB are exact, GB are
    GiB, as sglang prints them)."""

    args: dict[str, Any]
    facts: ModelDims
    served_model_name: str
    total_gib: float
    avail_before: float
    weights: float
    avail_after: float
    fraction: float
    rest: float
    kv_bytes_per_token: int
    page_size: int
    max_total_tokens: int
    profiled_tokens: int
    chunked_prefill_size: int
    decode_max_bs: int
    prefill_buckets: tuple[int, ...]
    decode_backend: str
    prefill_backend: str
    context_len: int
    max_running_requests: int
    model: ModelDir
    mode: str = "null"
    free_mib: float = 0.0
    hidden_size: int = 0
    is_embedding: bool = False

    @property
    def vocab_size(self) -> int:
        return self.model.vocab.vocab_size

    @property
    def max_req_len(self) -> int:
        """sglang's scheduler's longest request, prompt and output (``tp_worker.py``)."""
        return min(self.context_len - 1, self.max_total_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        """sglang's scheduler refuses prompts of this many tokens or more (``tp_worker.py``)."""
        return self.max_req_len - 5


def model_facts(model_path: str) -> ModelDims:
    """The dims of a model directory (its ``config.json``), of a known model (matched on its name), else
    those of Qwen3-0.6B."""
    if os.path.isfile(os.path.join(model_path, "config.json")):
        from ..engine.ledger import model_dims

        dims = model_dims(model_path)
        if dims is not None:
            return dims
    name = model_path.rstrip("/").lower()
    for dims in MODEL_DIMS.values():
        if dims.name.lower().split("/")[-1] in name:
            return dims
    return MODEL_DIMS["Qwen/Qwen3-0.6B"]


def _backends(ns: argparse.Namespace) -> tuple[str, str]:
    decode_backend = ns.cuda_graph_backend_decode or "full"
    prefill_backend = ns.cuda_graph_backend_prefill or "breakable"
    if getattr(ns, "disable_prefill_cuda_graph", False):
        prefill_backend = "disabled"
    if getattr(ns, "disable_decode_cuda_graph", False):
        decode_backend = "disabled"
    if ns.disable_cuda_graph or (ns.device or "cuda") == "cpu":
        decode_backend = prefill_backend = "disabled"
    return decode_backend, prefill_backend


def make_plan(ns: argparse.Namespace, total_gib: float, *, free_mib: int | None = None,
              argv: list[str] | None = None) -> Plan:
    """Resolve defaults and do the engine's memory arithmetic (see the module docstring). ``free_mib``: the
    memory free when the weights load (default 98.125 % of the card); ``argv``: the command line ``ns``
    came from (for the ledger; rebuilt from ``ns`` when not given)."""
    args = dict(vars(ns))
    facts = model_facts(ns.model_path)
    tp = max(int(ns.tp_size), 1)
    mode = ns.disaggregation_mode or "null"
    decode_backend, prefill_backend = _backends(ns)
    total_mib = round(total_gib * 1024)
    free = free_mib if free_mib is not None else int(total_mib * 0.98125)
    default_chunked, decode_max_bs = card_defaults(total_mib, tp)
    if ns.cuda_graph_max_bs_decode is not None:
        decode_max_bs = ns.cuda_graph_max_bs_decode
    elif ns.max_running_requests is not None:
        decode_max_bs = min(decode_max_bs, ns.max_running_requests)
    chunked = ns.chunked_prefill_size if ns.chunked_prefill_size is not None else default_chunked
    prefill_max_bs = ns.cuda_graph_max_bs_prefill or (chunked if chunked > 0 else ns.max_prefill_tokens)
    if ns.cuda_graph_max_bs_prefill is None and ns.max_total_tokens is not None:
        prefill_max_bs = min(prefill_max_bs, ns.max_total_tokens)
    buckets = prefill_capture_sizes(prefill_max_bs)
    page_size = max(ns.page_size or 1, 1)
    kv_bytes = facts.kv_bytes_per_token(tp)
    weights_mib = facts.weights_mib(tp)
    ledger = None
    if argv is not None:
        from ..engine.ledger import predict_memory

        try:
            ledger = predict_memory(facts, total_mib, gpu_free_mib=free, argv=argv, tp=tp)
        except ValueError:  # a value the engine would refuse some other way: the sim's own arithmetic
            ledger = None
    if ledger is not None:
        fraction = ledger.mem_fraction_static
        weights_mib = ledger.weights_mib
        kv_bytes = ledger.kv_bytes_per_token
        profiled, tokens = ledger.kv_tokens_profiled, ledger.kv_tokens
    else:
        if ns.mem_fraction_static is not None:
            fraction = float(ns.mem_fraction_static)
        else:
            activation = activation_reserve_mib(activation_tokens(
                mode=mode, chunked_prefill_size=chunked, max_prefill_tokens=ns.max_prefill_tokens,
                max_running_requests=ns.max_running_requests, decode_max_bs=decode_max_bs,
                speculative_num_draft_tokens=ns.speculative_num_draft_tokens), tp, ns.pp_size or 1)
            graphs = graph_reserve_mib(mode=mode, decode_backend=decode_backend, decode_max_bs=decode_max_bs,
                                       prefill_backend=prefill_backend, prefill_buckets=len(buckets))
            fraction = automatic_fraction(total_mib, total_reserve_mib(total_mib, activation, graphs))
        profiled, tokens = kv_pool_tokens(free, free - weights_mib, fraction, kv_bytes, page_size=page_size,
                                          max_total_tokens=ns.max_total_tokens)
    avail_before = free / 1024
    weights = weights_mib / 1024
    avail_after = avail_before - weights
    rest = avail_after - avail_before * (1 - fraction)
    model = load_model_dir(ns.model_path, vocab_size=facts.vocab_size or 32_000,
                           eos_token_id=facts.eos_token_id, tokenizer_path=ns.tokenizer_path)
    context_len = ns.context_length or model.context_len or facts.context_len
    max_running = ns.max_running_requests or max(min(4096, tokens // 2), 1)
    served = ns.served_model_name or ns.model_path
    args.update(
        tokenizer_path=ns.tokenizer_path or ns.model_path,
        served_model_name=served,
        mem_fraction_static=fraction,
        chunked_prefill_size=chunked,
        page_size=page_size,
        cuda_graph_backend_decode=decode_backend,
        cuda_graph_backend_prefill=prefill_backend,
        device=ns.device or "cuda",
        hicache_ratio=ns.hicache_ratio if ns.hicache_ratio is not None else 2.0,
        random_seed=ns.random_seed if ns.random_seed is not None else 42,
        disaggregation_mode=mode,
        _argv=list(argv or []),
    )
    return Plan(
        args=args,
        facts=facts,
        served_model_name=served,
        total_gib=total_mib / 1024,
        avail_before=avail_before,
        weights=weights,
        avail_after=avail_after,
        fraction=fraction,
        rest=rest,
        kv_bytes_per_token=kv_bytes,
        page_size=page_size,
        max_total_tokens=tokens,
        profiled_tokens=profiled,
        chunked_prefill_size=chunked,
        decode_max_bs=decode_max_bs,
        prefill_buckets=tuple(buckets),
        decode_backend=decode_backend,
        prefill_backend=prefill_backend,
        context_len=context_len,
        max_running_requests=max_running,
        model=model,
        mode=mode,
        free_mib=float(free),
        hidden_size=model.hidden_size or facts.hidden_size or 64,
        is_embedding=bool(ns.is_embedding),
    )
