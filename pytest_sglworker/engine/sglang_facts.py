"""What sglang 0.5.23 does, in one place: its flags, endpoints, log lines, memory arithmetic and models.

Plain Python, stdlib only, no pytest: the budget check, the memory ledger, the launcher, the diagnosis and
the simulated engine all read their sglang knowledge from here, so that they cannot disagree. Each fact
names where it comes from in sglang's source (``SOURCE``); the real-engine test tier
(``tests/engine/test_sglang_facts_real.py``) compares the tables with sglang's own code, so that a new sglang
release that changes one fails a test instead of silently drifting.

- **Flags.** :func:`flag_table` is sglang's argument parser as data (every option string, its ``dest``, how
  many values it takes, its choices), read from ``data/sglang_flags.json``. That file is written by
  ``scripts/dump-sglang-flags`` from ``ServerArgs.add_cli_args`` in the engine's own Python.
  :meth:`FlagTable.resolve` follows argparse's rules, abbreviations included: sglang's parser has
  ``allow_abbrev=True``, so ``--mem 0.9`` sets ``mem_fraction_static``.
- **Memory.** The reserve the engine keeps for activations and CUDA graphs and its card-size defaults
  (``srt/arg_groups/memory_hook.py``), the prefill capture buckets (``srt/arg_groups/cuda_graph_hook.py``).
- **Models.** Dimensions of the built-in models (from their ``config.json``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

SGLANG_VERSION = "0.5.23"
SOURCE = f"https://github.com/sgl-project/sglang/blob/v{SGLANG_VERSION}/python/sglang"

# ---------------------------------------------------------------------------------------------- launching

#: ``python -m <this>`` starts a server (``launch_server.py``).
LAUNCH_MODULE = "sglang.launch_server"
LAUNCH_MODULES = frozenset({LAUNCH_MODULE})
#: ``prog`` of the server's argument parser: its errors read ``sglang serve: error: ...``.
PARSER_PROG = "sglang serve"
LOOPBACK_HOST = "127.0.0.1"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_PORT = 30000
#: The prefill side of a PD pair serves its KV bootstrap server here unless told otherwise.
DEFAULT_BOOTSTRAP_PORT = 8998
#: Environment variable that makes ``is_cpu()`` true (the CPU engine).
CPU_ENGINE_ENV_VAR = "SGLANG_USE_CPU_ENGINE"

# ---------------------------------------------------------------------------------------------- endpoints

#: ``/health`` and ``/health_generate`` share one handler: 503 while starting, then a one-token generation.
HEALTH_PATH = "/health_generate"
HEALTH_PATHS = ("/health", "/health_generate")
#: 200 once the tokenizer manager is ``Up`` (set after the warmup request succeeded, just before the ready
#: line) and not paused, 503 before: answered from the server's state, no generation. ``/health_generate``
#: instead schedules a one-token generation and then sleeps in 1 s steps until the scheduler has answered,
#: so confirming readiness with it costs the engine a generation and the wait a second.
READY_PATH = "/ready"
#: All server args plus ``max_total_num_tokens`` and ``version`` (the old name still answers).
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")

# ---------------------------------------------------------------------------------------------- log lines

#: Logged once the warmup request has been answered (``srt/entrypoints/http_server.py``).
READY_LINE = "The server is fired up and ready to roll!"
#: The warmup request's prompt (``max_new_tokens=8``).
WARMUP_PROMPT = "The capital city of France is"
UVICORN_RUNNING = "Uvicorn running on"
LOAD_WEIGHT_BEGIN = "Load weight begin"
LOAD_WEIGHT_END = "Load weight end"
KV_ALLOCATED = "KV Cache is allocated"
#: ``KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1024, K size: 0.00 GB, V size: 0.00 GB``
KV_LINE = re.compile(
    r"KV Cache is allocated\.(?: dtype: (?P<dtype>[\w.]+),)? #tokens: (?P<tokens>\d+)"
    r"(?:, K size: (?P<k>[\d.]+) GB, V size: (?P<v>[\d.]+) GB)?"
)

# ---------------------------------------------------------------------------------------------- flags

#: Option names whose values are secrets: ``--api-key``, ``--admin-api-key``, ``--ssl-keyfile-password`` (and,
#: for other programs' argvs such as a router's, ``--hf-token``-like names; not ``--bucket-time-to-first-token``).
SECRET_FLAG = re.compile(
    r"--(?:[a-z0-9-]*-)?(?:api-key|secret|password)|--(?:(?:[a-z0-9-]*-)?(?:hf|auth|access|bearer)-)?token"
)
GRAPH_BACKENDS = ("full", "breakable", "disabled")

_DATA_FILE = Path(__file__).with_name("data") / "sglang_flags.json"
_TABLE_FORMAT = 1


@dataclass(frozen=True)
class Flag:
    """One option of sglang's parser. ``nargs`` is argparse's (``None``: one value; ``"0"``: none)."""

    options: tuple[str, ...]
    dest: str
    nargs: str | None = None
    choices: tuple[str, ...] | None = None
    type: str | None = None
    default: Any = None
    required: bool = False

    @property
    def name(self) -> str:
        """The first long option string, e.g. ``--model-path`` for ``--model-path/--model``."""
        return next((o for o in self.options if o.startswith("--")), self.options[0])

    @property
    def takes_value(self) -> bool:
        return self.nargs != "0"

    @property
    def secret(self) -> bool:
        return any(SECRET_FLAG.fullmatch(o) for o in self.options)


class AmbiguousFlag(ValueError):
    """An abbreviation that matches several flags (argparse's ``ambiguous option``)."""


class FlagTable:
    """sglang's parser as data: resolve option strings (argparse's rules) and read values out of an argv."""

    def __init__(self, flags: Iterable[Flag], *, version: str = SGLANG_VERSION) -> None:
        self.flags = tuple(flags)
        self.version = version
        self._by_option = {o: f for f in self.flags for o in f.options}
        self._by_dest = {f.dest: f for f in self.flags}

    def __contains__(self, dest: object) -> bool:
        return dest in self._by_dest

    def by_dest(self, dest: str) -> Flag:
        return self._by_dest[dest]

    def option_strings(self) -> list[str]:
        return sorted(self._by_option)

    def resolve(self, option: str) -> Flag | None:
        """The flag that ``option`` (``--name`` or an unambiguous prefix of one, without ``=value``) selects,
        or None when it selects none. Raises :class:`AmbiguousFlag` when a prefix matches several flags."""
        if option in self._by_option:
            return self._by_option[option]
        if not option.startswith("--") or len(option) < 3:
            return None
        matches = {id(f): f for o, f in self._by_option.items() if o.startswith(option)}
        if len(matches) > 1:
            names = ", ".join(sorted(o for f in matches.values() for o in f.options if o.startswith(option)))
            raise AmbiguousFlag(f"ambiguous option: {option} could match {names}")
        return next(iter(matches.values()), None)

    def shortest_prefix(self, dest: str) -> str:
        """The shortest abbreviation of ``dest``'s first long option that resolves to it alone."""
        name = self._by_dest[dest].name
        for end in range(3, len(name) + 1):
            try:
                if self.resolve(name[:end]) is self._by_dest[dest]:
                    return name[:end]
            except AmbiguousFlag:
                continue
        return name

    def parse(self, argv: Sequence[str], *, strict: bool = False) -> ParsedArgs:
        """The values ``argv`` gives each flag, in order (argparse keeps the last for ``store`` flags).

        ``--flag=value``, ``--flag value`` and abbreviations. A value-taking flag followed by nothing or by
        another ``--option`` records ``None``. Tokens that select no flag go to :attr:`ParsedArgs.unknown`;
        an ambiguous abbreviation raises :class:`AmbiguousFlag` with ``strict`` and is unknown otherwise.
        """
        values: dict[str, list[str | None]] = {}
        unknown: list[str] = []
        args = list(argv)
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if not arg.startswith("--"):
                continue  # a value already consumed, or a positional (sglang has none)
            name, eq, value = arg.partition("=")
            try:
                flag = self.resolve(name)
            except AmbiguousFlag:
                if strict:
                    raise
                flag = None
            if flag is None:
                unknown.append(arg)
                continue
            if not flag.takes_value:
                values.setdefault(flag.dest, []).append(None if not name.startswith("--no-") else "false")
                continue
            if eq:
                values.setdefault(flag.dest, []).append(value)
            elif flag.nargs in ("*", "+"):
                taken: list[str] = []
                while i < len(args) and not args[i].startswith("--"):
                    taken.append(args[i])
                    i += 1
                values.setdefault(flag.dest, []).append(" ".join(taken) if taken else None)
            elif i < len(args) and not args[i].startswith("--"):
                values.setdefault(flag.dest, []).append(args[i])
                i += 1
            else:
                values.setdefault(flag.dest, []).append(None)
        return ParsedArgs(values, unknown)


@dataclass(frozen=True)
class ParsedArgs:
    """What :meth:`FlagTable.parse` read: values by ``dest``, in argv order, and unknown tokens."""

    values: Mapping[str, list[str | None]]
    unknown: list[str]

    def given(self, dest: str) -> bool:
        return dest in self.values

    def last(self, dest: str, default: str | None = None) -> str | None:
        found = self.values.get(dest)
        return found[-1] if found else default

    def all(self, dest: str) -> list[str | None]:
        return list(self.values.get(dest, ()))


def human_readable_int(value: str) -> int:
    """sglang's ``human_readable_int`` flag type (``--max-total-tokens 32k``): ``1024``, ``32k``, ``1M``,
    ``4Ki`` (SI and IEC suffixes, case-sensitive). Raises ``ValueError`` with sglang's wording."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value.strip())
    if match:
        number, suffix = match.groups()
        iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
        if suffix in iec:
            if "." in number:
                raise ValueError(f"Decimals are not allowed with IEC suffixes like '{suffix}'.")
            return int(number) * iec[suffix]
        return int(float(number) * {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[suffix])
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"Invalid integer value: '{value}'. Use a plain integer, SI suffixes (1k, 1M), "
            "or IEC suffixes (1Ki, 1Mi). Suffixes are case-sensitive."
        ) from None


def flag_from_dict(data: Mapping[str, Any]) -> Flag:
    choices = data.get("choices")
    return Flag(tuple(data["options"]), str(data["dest"]), data.get("nargs"),
                tuple(choices) if choices is not None else None, data.get("type"), data.get("default"),
                bool(data.get("required", False)))


def dp_ranks_bind_one_nccl_port(argv: Sequence[str]) -> bool:
    """Whether a worker of these args would give one ``--nccl-port`` to several ranks that each bind it: sglang
    0.5.23's data-parallel controller (``--dp-size N``, N > 1, without DP attention) makes each rank's ports with
    ``PortArgs.init_new``, which takes ``server_args.nccl_port`` when one is given, and holds each rank's NCCL port
    (``bind_port``): the second rank fails with ``EADDRINUSE``. Left unset, each rank picks a free port of its own.
    With DP attention the ranks share one TP group and its one NCCL port, so a pinned port is right."""
    try:
        args = flag_table().parse(argv)
        dp = int(args.last("dp_size") or 1)
        attn_dp = int(args.last("attn_dp_size") or 1)
    except ValueError:  # a malformed value: sglang's own parser refuses it at launch
        return False
    return dp > 1 and attn_dp == 1 and not args.given("enable_dp_attention")


def worker_ranks(argv: Sequence[str]) -> int:
    """The rank processes one worker of these args runs, as sglang 0.5.23 counts them where its CPU engine binds
    each rank's threads (``srt/distributed/bootstrap.py: _bind_threads_if_cpu``: ``dp_size * tp_size * pp_size``
    of the parallel config): ``--tp-size`` x ``--pp-size`` x the data-parallel replicas, which ``--dp-size`` counts
    unless DP attention turns it into attention-DP groups inside the TP ranks (``srt/arg_groups/parallel_hook.py``
    moves it to ``attn_dp_size`` and sets ``dp_size=1``). The last value of a flag counts, as argparse keeps it; a
    malformed value counts 1 (sglang's own parser refuses it at launch)."""
    args = flag_table().parse(argv)
    ranks = 1
    for dest in ("tp_size", "pp_size") + (("dp_size",) if not args.given("enable_dp_attention") else ()):
        try:
            ranks *= max(1, int(args.last(dest) or 1))
        except ValueError:
            pass
    return ranks


@functools.lru_cache(maxsize=1)
def flag_table() -> FlagTable:
    """sglang 0.5.23's parser, read once from the data file shipped with the package."""
    data = json.loads(_DATA_FILE.read_text(encoding="utf-8"))
    if data.get("format") != _TABLE_FORMAT:
        raise RuntimeError(f"{_DATA_FILE}: unknown format {data.get('format')!r}; regenerate it")
    return FlagTable((flag_from_dict(f) for f in data["flags"]), version=str(data["sglang"]))


def describe_parser(parser: Any) -> list[dict[str, Any]]:
    """An argparse parser as the data file's ``flags`` list (run in the engine's Python against
    ``ServerArgs.add_cli_args``; see ``scripts/dump-sglang-flags``). ``-h/--help`` is left out."""
    out: list[dict[str, Any]] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        nargs = action.nargs
        choices = action.choices
        if isinstance(choices, (set, frozenset)):  # iteration order differs per process: keep a stable one
            choices = sorted(choices, key=str)
        out.append({
            "options": list(action.option_strings),
            "dest": action.dest,
            "nargs": str(nargs) if nargs is not None else None,
            "choices": [str(c) for c in choices] if choices is not None else None,
            "type": getattr(action.type, "__name__", None) if action.type is not None else None,
            "default": action.default if isinstance(action.default, (str, int, float, bool, type(None))) else None,
            "required": bool(action.required),
        })
    return out


def flags_document(parser: Any, version: str) -> dict[str, Any]:
    return {"format": _TABLE_FORMAT, "sglang": version, "flags": describe_parser(parser)}


# ---------------------------------------------------------------------------------------------- memory
# srt/arg_groups/memory_hook.py (handle_gpu_memory_settings, reserve_for_graph_mb, reserve_for_deepep_a2a_mb)
# and srt/arg_groups/cuda_graph_hook.py (generate_prefill_cuda_graph_batch_sizes). All in MiB.


def card_defaults(gpu_total_mib: float, tp: int = 1) -> tuple[int, int]:
    """The engine's ``(chunked_prefill_size, decode graph max_bs)`` defaults for a card of this size."""
    if gpu_total_mib < 20 * 1024:  # T4, 4080
        return 2048, 8
    if gpu_total_mib < 35 * 1024:  # A10, 4090, 5090
        return 4096, 48 if tp < 4 else 160
    if gpu_total_mib < 60 * 1024:  # A100 40 GB, L40
        return 4096, 32 if tp < 4 else 160
    if gpu_total_mib < 160 * 1024:  # H100, A100 80 GB, H20, H200
        return 8192, 256 if tp < 4 else 512
    return 16384, 512  # B200, MI300


def prefill_capture_sizes(max_bs: int) -> list[int]:
    """The prefill CUDA graph buckets (captured token counts) up to ``max_bs``: 58 for 8192."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_bs + 1, 512))
    )
    return [s for s in sizes if s <= max_bs]


def decode_capture_sizes(max_bs: int) -> list[int]:
    """The decode CUDA graph batch sizes up to ``max_bs`` (no speculative decoding, padding on)."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    return [s for s in sizes if s <= max_bs]


def activation_tokens(
    *,
    mode: str = "null",
    chunked_prefill_size: int,
    max_prefill_tokens: int = 16384,
    max_running_requests: int | None = None,
    decode_max_bs: int | None = None,
    speculative_num_draft_tokens: int | None = None,
) -> int:
    """Tokens the activation working set scales with, per serving mode (``mode``: null, prefill, decode)."""
    if mode == "decode":
        running = max_running_requests or decode_max_bs or 1
        return max(running * (speculative_num_draft_tokens or 1), 2048)
    if chunked_prefill_size > 0:
        return max(chunked_prefill_size, 2048)
    return max(max_prefill_tokens, 2048)


def activation_reserve_mib(tokens: int, tp: int = 1, pp: int = 1) -> float:
    """``512`` (constant metadata) ``+ tokens * 1.5`` (activations) ``+ tp * pp / 8 * 1024``."""
    return 512 + tokens * 1.5 + tp * pp / 8 * 1024


def graph_reserve_mib(
    *,
    mode: str = "null",
    decode_backend: str = "full",
    decode_max_bs: int,
    prefill_backend: str = "breakable",
    prefill_buckets: int,
    dp_attention: bool = False,
    attn_dp_size: int = 1,
    mla: bool = False,
    deepep: bool = False,
) -> float:
    """``reserve_for_graph_mb``: decode graph (not on a prefill node), DP-attention padding (not on a
    prefill node), prefill graph (not on a decode node; 1.5 GiB with MLA) and the breakable prefill graph's
    DeepEP delta."""
    reserved = 0.0
    if mode != "prefill" and decode_backend != "disabled":
        reserved += decode_max_bs * 2
    if dp_attention and mode != "prefill":
        reserved += decode_max_bs * attn_dp_size * 3
        if decode_max_bs > 300:
            reserved += decode_max_bs * attn_dp_size * 1.5
    if mode != "decode" and prefill_backend != "disabled":
        reserved += prefill_buckets * 8 if not mla else 1.5 * 1024
        if prefill_backend == "breakable" and deepep:
            reserved += 1024
    return reserved


def deepep_reserve_mib(*, mode: str = "null", decode_backend: str = "full", deepep: bool = False) -> float:
    """``reserve_for_deepep_a2a_mb``: 2 GiB for DeepEP's all-to-all buffers in the decode graph."""
    return 2048.0 if mode != "prefill" and decode_backend != "disabled" and deepep else 0.0


#: Cards above this get a reserve of at least :data:`RESERVE_FLOOR_MIB` (before DeepEP's share).
RESERVE_FLOOR_ABOVE_MIB = 60 * 1024
RESERVE_FLOOR_MIB = 10 * 1024


def total_reserve_mib(gpu_total_mib: float, activation_mib: float, graph_mib: float, deepep_mib: float = 0.0) -> float:
    """The engine's ``reserved_mem`` when it picks ``--mem-fraction-static`` itself: activations + graphs,
    floored on big cards, then DeepEP's buffers on top of the floor."""
    reserved = activation_mib + graph_mib
    if gpu_total_mib > RESERVE_FLOOR_ABOVE_MIB:
        reserved = max(reserved, RESERVE_FLOOR_MIB)
    return reserved + deepep_mib


def kv_pool_tokens(
    pre_load_free_mib: float,
    post_load_free_mib: float,
    fraction: float,
    bytes_per_token: int,
    *,
    page_size: int = 1,
    max_total_tokens: int | None = None,
) -> tuple[int, int]:
    """``(profiled, allocated)`` KV tokens (``srt/mem_cache/kv_cache_configurator.py``): what is left of the
    static budget after the weights, ``post_load_free - pre_load_free * (1 - fraction)``, in tokens, rounded
    down to the page size; the pool gets at most ``--max-total-tokens`` of them."""
    rest_mib = post_load_free_mib - pre_load_free_mib * (1 - fraction)
    profiled = int(rest_mib * (1 << 20) // bytes_per_token) if rest_mib > 0 else 0
    profiled = profiled // page_size * page_size
    tokens = profiled if max_total_tokens is None else min(profiled, max(0, max_total_tokens))
    return profiled, tokens // page_size * page_size


def automatic_fraction(gpu_total_mib: float, reserved_mib: float) -> float:
    """The ``--mem-fraction-static`` the engine picks when none is given."""
    return round((gpu_total_mib - reserved_mib) / gpu_total_mib, 3)


# ---------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelDims:
    """What the memory arithmetic and the simulated engine need to know about a model.

    ``kv_heads`` is the number of key/value heads (GQA), ``params`` the parameter count, ``dtype_bytes`` the
    bytes per weight and per KV element as served (2 for bf16/fp16). The other fields are informational.
    """

    layers: int
    kv_heads: int
    head_dim: int
    params: int
    dtype_bytes: int = 2
    name: str = ""
    hidden_size: int | None = None
    vocab_size: int | None = None
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    context_len: int = 131_072
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        for attr in ("layers", "kv_heads", "head_dim", "params", "dtype_bytes"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelDims.{attr} must be a positive integer, got {value!r}")

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype_bytes: int | None = None) -> int:
        """Bytes of K and V per token on one GPU: ``layers * kv_heads/tp * head_dim * 2 * dtype_bytes``."""
        heads = max(1, self.kv_heads // max(1, tp))
        return self.layers * heads * self.head_dim * 2 * (kv_dtype_bytes or self.dtype_bytes)

    def weights_mib(self, tp: int = 1) -> float:
        """MiB of weights on one GPU (``params * dtype_bytes / tp``)."""
        return self.params * self.dtype_bytes / max(1, tp) / (1 << 20)


#: The built-in models (their ``config.json``; the parameter counts are exact).
MODEL_DIMS: Mapping[str, ModelDims] = MappingProxyType({
    "Qwen/Qwen3-0.6B": ModelDims(28, 8, 128, 596_049_920, 2, "Qwen/Qwen3-0.6B", 1024, 151_936,
                                 "Qwen3ForCausalLM", "qwen3", 40_960, 151_645),
    "meta-llama/Llama-3.2-1B-Instruct": ModelDims(16, 8, 64, 1_235_814_400, 2, "meta-llama/Llama-3.2-1B-Instruct",
                                                  2048, 128_256, "LlamaForCausalLM", "llama", 131_072, 128_009),
    "meta-llama/Llama-3.1-8B-Instruct": ModelDims(32, 8, 128, 8_030_261_248, 2, "meta-llama/Llama-3.1-8B-Instruct",
                                                  4096, 128_256, "LlamaForCausalLM", "llama", 131_072, 128_009),
})


def find_model(model: str) -> ModelDims | None:
    """The built-in dims of ``model``: its hub id, a path ending in it, or its last component alone
    (``Qwen3-0.6B``), case-insensitive."""
    key = model.strip().rstrip("/").lower()
    for name, dims in MODEL_DIMS.items():
        lname = name.lower()
        if key in (lname, lname.split("/")[-1]) or key.endswith("/" + lname):
            return dims
    return None
