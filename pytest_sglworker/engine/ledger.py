"""The engine's memory arithmetic: predicted KV pool, slack, reserves and a verdict, before any launch.

Plain Python, stdlib only: no pytest here. All memory figures are MiB (the unit sglang's own arithmetic
uses, and NVML's), token counts are tokens.

What sglang 0.5.23 does (``srt/arg_groups/memory_hook.py``, ``srt/mem_cache/kv_cache_configurator.py``):

* ``pre_model_load_free`` is the GPU memory free when the worker starts loading (not the card's total).
* The static budget is ``pre_model_load_free * mem_fraction_static``; it holds the weights and the KV pool.
  The KV pool gets ``available_after_weights - pre_model_load_free * (1 - mem_fraction_static)``, i.e. the
  budget minus the weights, in units of ``layers * kv_heads * head_dim * 2 * dtype_bytes`` per token.
* The *slack*, ``pre_model_load_free * (1 - mem_fraction_static)``, is all that is left for activations
  and every CUDA graph. Without ``--mem-fraction-static`` the engine picks the fraction so that the slack
  equals its own reserve estimate: ``512 + max(chunked_prefill_size, 2048) * 1.5 + tp*pp/8 * 1024`` (the
  activation reserve) ``+ decode_max_bs * 2 + len(prefill_buckets) * 8`` (the graph reserve), floored at
  10240 MiB on cards above 60 GiB, ``fraction = round((card - reserved) / card, 3)``. The serving mode
  changes the terms: on a decode node (PD) the activations scale with ``max(running requests x draft
  tokens, 2048)`` and there is no prefill graph; a prefill node has no decode graph and no DP-attention
  padding; DeepEP adds 2 GiB off prefill nodes. The formulas themselves are in :mod:`sglang_facts`.

The activation reserve (why this estimate). The "about 12.6 GB for chunked_prefill_size=8192" that the seed
failure's analysis quotes is exactly this formula: ``512 + 8192 * 1.5 + 1/8 * 1024 = 12928 MiB = 12.6 GiB``.
It is the engine's own empirical heuristic ("the coefficient 1.5 is a heuristic value"), independent of the
model. A vocab- or hidden-size-based estimate was considered and rejected: during prefill graph capture the
dummy batch has one request slot, so the logits are computed for one token (not ``chunked * vocab``), and
the per-layer hidden-state working set of a 0.6B model at 8192 tokens is well under 1 GiB. Neither explains
12.6 GB, and fitting one to that figure would be a number dressed up as a model. What the seed run does show
is that the engine's reserve is *not enough* for a breakable prefill graph: at ``0.83`` (the automatic
fraction on an 80 GB H100) the slack is within rounding of that reserve and capture ran out of memory at
bucket 26 of 58. So the verdict compares the memory left after the KV pool with the engine's reserve plus a
safety ``margin`` (default 5 %): a configuration that leaves the graphs no more than the engine's own
estimate is flagged ``slack_below_reserve``. The 5 % is a judgement, not a measurement: it flags every
automatic fraction (which sits at the reserve by construction, give or take the 3-decimal rounding) and none
of the CI budget (``0.6`` with the prefill graph off leaves 2.4x the reserve on an 80 GB card).

KV tokens: with the whole card free (81559 MiB on an H100) the formula gives 608,522 tokens for Qwen3-0.6B
at 0.83; the ~556K seen on a real H100 corresponds to ~73.1 GiB free at load (``Load weight begin. avail mem=`` in the
log), which is why ``gpu_free_mib`` should come from NVML or from the log when it is known.

Why one module: the prediction (:func:`predict_memory`), its rendering and its comparison with a log's memory lines
(``MemoryLedger.against_log``) are one model of sglang's allocator; split, a change to one term would have to be
made in three places that must agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .log_lines import LogMemory
from .sglang_facts import (
    GRAPH_BACKENDS,
    MODEL_DIMS,
    ModelDims,
    ParsedArgs,
    activation_reserve_mib,
    activation_tokens,
    automatic_fraction,
    card_defaults,
    deepep_reserve_mib,
    find_model,
    flag_table,
    graph_reserve_mib,
    human_readable_int,
    kv_pool_tokens,
    prefill_capture_sizes,
    total_reserve_mib,
)

if TYPE_CHECKING:
    from .specs import ModelSpec

__all__ = [
    "GPU_CARDS",
    "MODEL_DIMS",
    "MemoryLedger",
    "ModelDims",
    "Verdict",
    "activation_reserve_mib",
    "activation_tokens",
    "automatic_fraction",
    "card_defaults",
    "dims_from_config",
    "gpu_card_mib",
    "model_dims",
    "predict_memory",
    "prefill_capture_sizes",
    "total_reserve_mib",
]

MIB = 1 << 20

#: Named cards → total memory in MiB as NVML reports it.
GPU_CARDS: Mapping[str, int] = MappingProxyType(
    {
        "H100-80G": 81559,
        "H200": 143771,
        "A100-80G": 81920,
        "A100-40G": 40960,
        "L4": 23034,
        "A10G": 23028,
        "L40S": 46068,
    }
)


def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def gpu_card_mib(name: str) -> int:
    """Total MiB of a named card, case- and punctuation-insensitive (``"h100-80g"``, ``"H100_80G"``).

    A unique prefix also works (``"h100"``); an unknown or ambiguous name raises :class:`ValueError`
    that lists the known names.
    """
    key = _norm(name)
    exact = [card for card in GPU_CARDS if _norm(card) == key]
    if exact:
        return GPU_CARDS[exact[0]]
    matches = [card for card in GPU_CARDS if key and _norm(card).startswith(key)]
    if len(matches) == 1:
        return GPU_CARDS[matches[0]]
    known = ", ".join(GPU_CARDS)
    if len(matches) > 1:
        raise ValueError(f"GPU card name {name!r} is ambiguous ({', '.join(matches)}); known cards: {known}")
    raise ValueError(f"unknown GPU card {name!r}; known cards: {known}")


# ---------------------------------------------------------------------------------------------- models


_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bf16": 2,
    # sglang's dtype "auto" serves a float32 checkpoint in 16 bits
    "float32": 2,
    "float": 2,
    "fp32": 2,
}


def dims_from_config(config: Mapping[str, Any], name: str = "", *, known: ModelDims | None = None) -> ModelDims:
    """:class:`ModelDims` from a Hugging Face ``config.json`` mapping.

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (else ``num_attention_heads``), ``head_dim`` (else
    ``hidden_size / num_attention_heads``) and ``torch_dtype``/``dtype``; multimodal configs are read from
    their ``text_config``. The parameter count is estimated as embeddings + layers * (attention + gated MLP
    + norms) + final norm + lm_head (unless ``tie_word_embeddings``); for the built-in models this gives
    their exact counts. Raises :class:`ValueError` when a required key is missing.
    """
    cfg = dict(config)
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        outer = cfg
        cfg = dict(cfg["text_config"])
        cfg.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
        cfg.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings", False))
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json of {name or 'the model'} lacks a usable {exc}") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(cfg.get("vocab_size") or 0)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    dtype_bytes = _DTYPE_BYTES.get(dtype.lower(), 2)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        attention += q_dim + 2 * kv_dim
    if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
        attention += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * hidden * inter
    per_layer = attention + mlp + 2 * hidden
    embed = vocab * hidden
    params = embed + layers * per_layer + hidden
    if not cfg.get("tie_word_embeddings", False):
        params += embed
    extra: dict[str, Any] = {}
    if known is not None:  # what the config leaves out is taken from the built-in table
        extra = {k: getattr(known, k) for k in ("architecture", "model_type", "context_len", "eos_token_id")}
    architectures = cfg.get("architectures") or (config.get("architectures") if cfg is not config else None)
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        extra["architecture"] = architectures[0]
    if isinstance(cfg.get("model_type"), str):
        extra["model_type"] = cfg["model_type"]
    if isinstance(cfg.get("max_position_embeddings"), int) and cfg["max_position_embeddings"] > 0:
        extra["context_len"] = cfg["max_position_embeddings"]
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if isinstance(eos, int) and not isinstance(eos, bool):
        extra["eos_token_id"] = eos
    return ModelDims(layers, kv_heads, head_dim, params, dtype_bytes, name, hidden, vocab or None, **extra)


def model_dims(model: str, local_path: str | os.PathLike[str] | None = None) -> ModelDims | None:
    """Dims of ``model``: from ``config.json`` of a local copy when there is one, else the built-in table.

    ``local_path`` (or ``model`` itself when it is a directory) is read if it holds a ``config.json``; the
    parameter count then comes from the table when the model is a known one (the config estimate otherwise).
    Returns None for an unknown model without a readable config.
    """
    table = find_model(model)
    for candidate in (local_path, model):
        if candidate is None:
            continue
        config_file = Path(candidate) / "config.json"
        if not config_file.is_file():
            continue
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict):
            continue
        try:
            dims = dims_from_config(config, name=table.name if table else model, known=table)
        except ValueError:
            continue
        if table is not None:  # the exact parameter count of a known model
            dims = dataclasses.replace(dims, params=table.params, name=table.name)
        return dims
    return table


# ---------------------------------------------------------------------------------------------- argv


def _human(args: ParsedArgs, dest: str) -> int | None:
    """A ``human_readable_int`` flag (``--max-total-tokens 32k``)."""
    if not args.given(dest):
        return None
    try:
        return human_readable_int(args.last(dest) or "")
    except ValueError as exc:
        raise ValueError(f"{flag_table().by_dest(dest).name}: {exc}") from None


def _number(args: ParsedArgs, dest: str, kind: type[int] | type[float]) -> Any:
    flag = flag_table().by_dest(dest).name
    if not args.given(dest):
        return None
    raw = args.last(dest)
    if raw is None:
        raise ValueError(f"{flag} needs a value")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None



# ---------------------------------------------------------------------------------------------- the ledger


class Verdict(str, Enum):
    """What :func:`predict_memory` expects of a launch."""

    FITS = "fits"
    SLACK_BELOW_RESERVE = "slack_below_reserve"
    WEIGHTS_DO_NOT_FIT = "weights_do_not_fit"
    KV_POOL_EMPTY = "kv_pool_empty"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class MemoryLedger:
    """A predicted memory plan for one GPU of a worker (MiB unless named otherwise).

    ``slack_mib`` is the engine's ``free * (1 - fraction)``; ``after_kv_mib`` is what is really left for
    activations and graphs once weights and the (possibly ``--max-total-tokens``-capped) KV pool are in;
    ``required_mib`` is the engine's own reserve for them; the verdict compares the two with ``margin``.
    """

    model: str
    gpu_total_mib: float
    free_mib: float
    tp: int
    mem_fraction_static: float
    fraction_automatic: bool
    chunked_prefill_size: int
    decode_graph: str
    prefill_graph: str
    decode_max_bs: int
    prefill_buckets: int
    weights_mib: float
    static_budget_mib: float
    slack_mib: float
    kv_bytes_per_token: int
    kv_tokens_profiled: int
    kv_tokens: int
    max_total_tokens: int | None
    kv_pool_mib: float
    after_kv_mib: float
    activation_reserve_mib: float
    decode_graph_reserve_mib: float
    prefill_graph_reserve_mib: float
    margin: float
    verdict: Verdict
    #: sglang's serving mode: ``null`` (prefill and decode in one server), ``prefill`` or ``decode`` (PD)
    mode: str = "null"
    #: DeepEP's all-to-all buffers (``--moe-a2a-backend deepep``, not on a prefill node)
    deepep_reserve_mib: float = 0.0

    @property
    def graph_reserve_mib(self) -> float:
        return self.decode_graph_reserve_mib + self.prefill_graph_reserve_mib + self.deepep_reserve_mib

    @property
    def required_mib(self) -> float:
        """Activation reserve + graph reserves: the engine's own estimate of what the slack must hold."""
        return self.activation_reserve_mib + self.graph_reserve_mib

    @property
    def headroom_mib(self) -> float:
        """``after_kv_mib - required_mib * (1 + margin)``: negative for slack_below_reserve."""
        return self.after_kv_mib - self.required_mib * (1 + self.margin)

    @property
    def fits(self) -> bool:
        return self.verdict is Verdict.FITS

    @property
    def suggested_fraction(self) -> float | None:
        """A ``--mem-fraction-static`` (with the prefill graph disabled) that leaves the reserve + margin and
        still holds the weights: 0.6 (the CI budget) when that works, else the highest that does; None when
        no fraction does (the model is too big for this GPU with room for graphs)."""
        if self.free_mib <= 0:
            return None
        need = (self.activation_reserve_mib + self.decode_graph_reserve_mib) * (1 + self.margin)
        highest = math.floor((1 - need / self.free_mib) * 100) / 100
        lowest = self.weights_mib / self.free_mib
        if highest <= lowest:
            return None
        return 0.6 if lowest < 0.6 <= highest else highest

    @property
    def suggestion(self) -> str:
        fraction = self.suggested_fraction
        if fraction is None:
            return (
                "no --mem-fraction-static leaves room for both the weights and the graphs: "
                "use a bigger GPU or more tp"
            )
        return f"use --mem-fraction-static={fraction:g} --cuda-graph-backend-prefill=disabled"

    @property
    def explanation(self) -> str:
        """One sentence on the verdict, with the fix when there is one."""
        if self.verdict is Verdict.WEIGHTS_DO_NOT_FIT:
            if self.weights_mib > self.free_mib:
                return (
                    f"the weights ({self.weights_mib:.0f} MiB per GPU) exceed the free memory "
                    f"({self.free_mib:.0f} MiB): use a bigger GPU or more tensor parallelism"
                )
            return (
                f"the weights ({self.weights_mib:.0f} MiB per GPU) exceed the static budget "
                f"free*{self.mem_fraction_static:g} = {self.static_budget_mib:.0f} MiB: sglang will refuse "
                "to allocate a KV pool; use a bigger GPU, more tensor parallelism or a higher fraction"
            )
        if self.verdict is Verdict.KV_POOL_EMPTY:
            return "the static budget left after the weights holds no KV token: raise --mem-fraction-static"
        if self.verdict is Verdict.SLACK_BELOW_RESERVE:
            return (
                f"graph capture will likely run out of memory: {self.after_kv_mib:.0f} MiB left after the "
                f"KV pool < {self.required_mib:.0f} MiB reserve + {self.margin:.0%}; {self.suggestion}"
            )
        return (
            f"{self.after_kv_mib:.0f} MiB left for activations and graphs, "
            f"{self.headroom_mib:+.0f} MiB beyond the reserve + {self.margin:.0%}"
        )

    def render(self) -> str:
        """A compact table (a few lines) for ``--sgl-list-models`` and failure messages."""
        fraction = f"{self.mem_fraction_static:g} ({'automatic' if self.fraction_automatic else 'given'})"
        cap = (
            f", capped by --max-total-tokens={self.max_total_tokens}"
            if (self.max_total_tokens is not None and self.kv_tokens < self.kv_tokens_profiled)
            else ""
        )
        graphs = [f"activations {self.activation_reserve_mib:.0f} (chunked {self.chunked_prefill_size})"]
        if self.decode_graph != "disabled":
            graphs.append(f"decode graph {self.decode_graph_reserve_mib:.0f} (max_bs {self.decode_max_bs})")
        if self.prefill_graph != "disabled":
            graphs.append(
                f"prefill graph {self.prefill_graph_reserve_mib:.0f} "
                f"({self.prefill_buckets} buckets, {self.prefill_graph})"
            )
        return "\n".join(
            [
                f"{self.model or 'model'} on {self.gpu_total_mib:.0f} MiB GPU (free {self.free_mib:.0f}), "
                f"tp={self.tp}, mem_fraction_static={fraction}",
                f"  weights {self.weights_mib:.0f} MiB | KV pool {self.kv_pool_mib:.0f} MiB = "
                f"{self.kv_tokens:,} tokens "
                f"({self.kv_bytes_per_token:,} B/token{cap}) | slack {self.slack_mib:.0f} MiB",
                f"  reserve {self.required_mib:.0f} MiB: " + " + ".join(graphs),
                f"  verdict: {self.verdict.value}: {self.explanation}",
            ]
        )

    def __str__(self) -> str:
        return self.render()

    def against_log(self, memory: LogMemory, *, kv_pool: bool = False) -> str:
        """Beside a memory failure: what this prediction said and, when it said ``fits``, which of its
        assumptions the log's memory lines contradict (the memory free when the weights loaded, the weights, the
        KV pool), or that they agree with it, which means what ran out is memory the ledger does not model.
        ``kv_pool``: the failure is the KV pool finding no room (not an allocation that ran out of memory)."""
        if self.verdict is not Verdict.FITS:
            return f"the ledger predicted this failure: {self.verdict.value}: {self.explanation}"
        said = (f"the ledger predicted 'fits' ({self.headroom_mib:+.0f} MiB beyond the engine's reserve + "
                f"{self.margin:.0%}), but " + ("the engine found no room for the KV pool" if kv_pool else
                                               "the engine ran out of memory"))
        contradictions = []
        if memory.load_begin_avail_gb is not None:
            free = memory.load_begin_avail_gb * 1024
            if free < self.free_mib * 0.95:
                contradictions.append(f"the GPU had {free:.0f} MiB free when the weights loaded, the ledger assumed "
                                      f"{self.free_mib:.0f} (another process held {self.free_mib - free:.0f} MiB?)")
        if memory.weights_gb is not None:
            weights = memory.weights_gb * 1024
            if abs(weights - self.weights_mib) > max(256.0, 0.1 * self.weights_mib):
                contradictions.append(f"the weights took {weights:.0f} MiB, the ledger predicted "
                                      f"{self.weights_mib:.0f}")
        if memory.kv_tokens is not None and memory.kv_tokens != self.kv_tokens:
            contradictions.append(f"the KV pool got {memory.kv_tokens:,} tokens, the ledger predicted "
                                  f"{self.kv_tokens:,}")
        if contradictions:
            return f"{said}: the log contradicts its assumptions: " + "; ".join(contradictions)
        if memory.kv_tokens is None and memory.weights_gb is None:
            return f"{said}; the log shows no memory line to check its assumptions against"
        if kv_pool:
            return (f"{said}, although the log's memory lines agree with its assumptions (free memory at load, "
                    "weights): something the ledger does not model took memory between the weights and the pool (a "
                    "draft model, another process); the engine's error gives its own figures")
        return (f"{said}, and the log's memory lines agree with its assumptions (free memory at load, weights, KV "
                "pool): what ran out is memory the ledger does not model (activations or graphs beyond the "
                "engine's own reserve)")


def predict_memory(
    dims: ModelDims,
    gpu_total_mib: int,
    *,
    gpu_free_mib: int | None = None,
    argv: Sequence[str] = (),
    tp: int = 1,
    margin: float = 0.05,
) -> MemoryLedger:
    """Predict the engine's memory plan for ``dims`` on one GPU of ``gpu_total_mib`` MiB.

    ``gpu_free_mib`` is the memory free when the worker loads (default: the whole card). ``argv`` is read
    for ``--mem-fraction-static`` (absent: the engine's automatic fraction), ``--chunked-prefill-size``,
    ``--cuda-graph-backend-prefill`` (absent: breakable) / ``-decode`` (absent: full),
    ``--disable-cuda-graph``,
    ``--cuda-graph-max-bs-prefill`` / ``-decode``, ``--max-total-tokens`` (caps the pool),
    ``--max-running-requests``, ``--page-size``, ``--kv-cache-dtype``, ``--dtype`` and ``--tp-size``
    (which must agree with ``tp`` when both are given). Raises :class:`ValueError` for a malformed value.
    """
    args = flag_table().parse(argv)
    if gpu_total_mib <= 0:
        raise ValueError(f"gpu_total_mib must be positive, got {gpu_total_mib!r}")
    argv_tp = _number(args, "tp_size", int)
    if argv_tp is not None and tp != 1 and argv_tp != tp:
        raise ValueError(f"tp={tp} disagrees with --tp-size {argv_tp} in the worker args")
    tp = argv_tp or tp
    pp = _number(args, "pp_size", int) or 1
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor/pipeline parallel sizes must be >= 1, got tp={tp}, pp={pp}")
    total = float(gpu_total_mib)
    free = float(gpu_free_mib) if gpu_free_mib is not None else total
    if free < 0:
        raise ValueError(f"gpu_free_mib must not be negative, got {gpu_free_mib!r}")
    mode = args.last("disaggregation_mode") or "null"
    if mode not in ("null", "prefill", "decode"):
        raise ValueError(f"--disaggregation-mode must be null, prefill or decode, got {mode!r}")
    attn_dp = _number(args, "attn_dp_size", int) or 1
    if attn_dp == 1 and args.given("enable_dp_attention"):  # the deprecated spelling: --dp-size K --enable-dp-attention
        attn_dp = _number(args, "dp_size", int) or 1
    deepep = (args.last("moe_a2a_backend") or "none") == "deepep"

    default_chunked, default_decode_bs = card_defaults(total, tp)
    chunked = _number(args, "chunked_prefill_size", int)
    chunked = default_chunked if chunked is None else chunked
    max_prefill = _human(args, "max_prefill_tokens") or 16384
    max_total_tokens = _human(args, "max_total_tokens")
    max_running = _number(args, "max_running_requests", int)
    page_size = max(1, _number(args, "page_size", int) or 1)

    backends = {}
    for dest, default in (("cuda_graph_backend_decode", "full"), ("cuda_graph_backend_prefill", "breakable")):
        backend = args.last(dest) or default
        if backend not in GRAPH_BACKENDS:
            raise ValueError(f"{flag_table().by_dest(dest).name} must be one of {', '.join(GRAPH_BACKENDS)}, "
                             f"got {backend!r}")
        backends[dest] = backend
    decode_backend, prefill_backend = backends["cuda_graph_backend_decode"], backends["cuda_graph_backend_prefill"]
    if args.given("disable_cuda_graph"):
        decode_backend = prefill_backend = "disabled"
    if args.given("disable_prefill_cuda_graph"):
        prefill_backend = "disabled"
    if args.given("disable_decode_cuda_graph"):
        decode_backend = "disabled"

    decode_max_bs = _number(args, "cuda_graph_max_bs_decode", int)
    if decode_max_bs is None:
        decode_max_bs = default_decode_bs
        if max_running is not None and max_running < decode_max_bs:
            decode_max_bs = max_running
    prefill_max_bs = _number(args, "cuda_graph_max_bs_prefill", int)
    if prefill_max_bs is None:
        prefill_max_bs = chunked if chunked > 0 else max_prefill
        if max_total_tokens is not None:
            prefill_max_bs = min(prefill_max_bs, max_total_tokens)
        if "llama-2" in dims.name.lower():
            prefill_max_bs = min(prefill_max_bs, 4096)
    buckets = len(prefill_capture_sizes(prefill_max_bs))

    tokens_for_activations = activation_tokens(
        mode=mode, chunked_prefill_size=chunked, max_prefill_tokens=max_prefill, max_running_requests=max_running,
        decode_max_bs=decode_max_bs, speculative_num_draft_tokens=_number(args, "speculative_num_draft_tokens", int))
    activation = activation_reserve_mib(tokens_for_activations, tp, pp)
    decode_reserve = graph_reserve_mib(mode=mode, decode_backend=decode_backend, decode_max_bs=decode_max_bs,
                                       prefill_backend="disabled", prefill_buckets=0,
                                       dp_attention=attn_dp > 1, attn_dp_size=attn_dp)
    prefill_reserve = graph_reserve_mib(mode=mode, decode_backend="disabled", decode_max_bs=decode_max_bs,
                                        prefill_backend=prefill_backend, prefill_buckets=buckets, deepep=deepep)
    deepep_reserve = deepep_reserve_mib(mode=mode, decode_backend=decode_backend, deepep=deepep)

    fraction = _number(args, "mem_fraction_static", float)
    automatic = fraction is None
    if fraction is None:
        fraction = automatic_fraction(total, total_reserve_mib(total, activation, decode_reserve + prefill_reserve,
                                                               deepep_reserve))
    if not 0 < fraction < 1:
        raise ValueError(f"--mem-fraction-static must be between 0 and 1, got {fraction!r}")

    kv_dtype = (args.last("kv_cache_dtype") or "auto").lower()
    kv_dtype_bytes = 1 if kv_dtype.startswith(("fp8", "fp4", "int8")) else None
    weight_bytes = dims.dtype_bytes
    if (args.last("dtype") or "").lower() in ("float32", "float"):
        weight_bytes = 4
    weights = dims.params * weight_bytes / tp / MIB
    if kv_dtype_bytes is None:
        kv_dtype_bytes = weight_bytes
    per_token = dims.kv_bytes_per_token(tp, kv_dtype_bytes)

    static_budget = free * fraction
    slack = free - static_budget
    profiled, tokens = kv_pool_tokens(free, free - weights, fraction, per_token, page_size=page_size,
                                      max_total_tokens=max_total_tokens)
    kv_pool = tokens * per_token / MIB
    after_kv = free - weights - kv_pool
    required = activation + decode_reserve + prefill_reserve + deepep_reserve

    if weights > free or weights >= static_budget:
        verdict = Verdict.WEIGHTS_DO_NOT_FIT
    elif tokens <= 0:
        verdict = Verdict.KV_POOL_EMPTY
    elif after_kv < required * (1 + margin):
        verdict = Verdict.SLACK_BELOW_RESERVE
    else:
        verdict = Verdict.FITS

    return MemoryLedger(
        model=dims.name,
        gpu_total_mib=total,
        free_mib=free,
        tp=tp,
        mem_fraction_static=fraction,
        fraction_automatic=automatic,
        chunked_prefill_size=chunked,
        decode_graph=decode_backend,
        prefill_graph=prefill_backend,
        decode_max_bs=decode_max_bs,
        prefill_buckets=buckets,
        weights_mib=weights,
        static_budget_mib=static_budget,
        slack_mib=slack,
        kv_bytes_per_token=per_token,
        kv_tokens_profiled=profiled,
        kv_tokens=tokens,
        max_total_tokens=max_total_tokens,
        kv_pool_mib=kv_pool,
        after_kv_mib=after_kv,
        activation_reserve_mib=activation,
        decode_graph_reserve_mib=decode_reserve,
        prefill_graph_reserve_mib=prefill_reserve,
        deepep_reserve_mib=deepep_reserve,
        mode=mode,
        margin=margin,
        verdict=verdict,
    )


def ledger_for_spec(
    spec: ModelSpec,
    gpu_total_mib: int,
    *,
    gpu_free_mib: int | None = None,
    extra_args: Sequence[str] = (),
) -> MemoryLedger | None:
    """The ledger of a spec (its worker args, then ``extra_args``) on one of its GPUs; None when the model's
    dimensions are unknown (not in the built-in table, no local ``config.json``)."""
    local = spec.resolve_model_path()
    dims = model_dims(spec.model, local if os.path.isdir(local) else None)
    if dims is None:
        return None
    try:
        return predict_memory(dims, gpu_total_mib, gpu_free_mib=gpu_free_mib,
                              argv=[*spec.worker_args, *extra_args], tp=spec.tp)
    except ValueError:
        return None
