"""Unit tests of :mod:`pytest_sglworker.engine.ledger`: the engine's memory arithmetic."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pytest_sglworker.engine.ledger import (
    GPU_CARDS,
    MODEL_DIMS,
    MemoryLedger,
    ModelDims,
    Verdict,
    activation_reserve_mib,
    activation_tokens,
    automatic_fraction,
    card_defaults,
    dims_from_config,
    gpu_card_mib,
    model_dims,
    predict_memory,
    prefill_capture_sizes,
    total_reserve_mib,
)
from pytest_sglworker.engine.log_lines import parse_memory

LOGS = Path(__file__).resolve().parents[1] / "data" / "logs"
CI = ("--mem-fraction-static=0.6", "--cuda-graph-backend-prefill=disabled")
QWEN = MODEL_DIMS["Qwen/Qwen3-0.6B"]
LLAMA1B = MODEL_DIMS["meta-llama/Llama-3.2-1B-Instruct"]
LLAMA8B = MODEL_DIMS["meta-llama/Llama-3.1-8B-Instruct"]
H100 = GPU_CARDS["H100-80G"]

# The models' config.json (the fields the arithmetic reads), as published on the Hugging Face hub.
CONFIGS = {
    "Qwen/Qwen3-0.6B": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    },
    "meta-llama/Llama-3.2-1B-Instruct": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    },
}


# ---------------------------------------------------------------------------------------------- cards


def test_card_table() -> None:
    assert dict(GPU_CARDS) == {
        "H100-80G": 81559,
        "H200": 143771,
        "A100-80G": 81920,
        "A100-40G": 40960,
        "L4": 23034,
        "A10G": 23028,
        "L40S": 46068,
    }
    with pytest.raises(TypeError):
        GPU_CARDS["X"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "mib"),
    [
        ("H100-80G", 81559),
        ("h100-80g", 81559),
        ("H100_80G", 81559),
        ("h100", 81559),
        ("h200", 143771),
        ("a100-40g", 40960),
        ("l40s", 46068),
        ("L4", 23034),
        ("a10g", 23028),
    ],
)
def test_card_lookup(name: str, mib: int) -> None:
    assert gpu_card_mib(name) == mib


def test_card_lookup_errors_list_the_known_cards() -> None:
    with pytest.raises(ValueError, match=r"unknown GPU card 'B300'.*H100-80G, H200"):
        gpu_card_mib("B300")
    with pytest.raises(ValueError, match=r"ambiguous.*A100-80G, A100-40G"):
        gpu_card_mib("a100")
    with pytest.raises(ValueError, match="known cards"):
        gpu_card_mib("")


# ---------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize(
    ("model", "per_token"),
    [
        ("Qwen/Qwen3-0.6B", 114_688),
        ("meta-llama/Llama-3.2-1B-Instruct", 32_768),
        ("meta-llama/Llama-3.1-8B-Instruct", 131_072),
    ],
)
def test_kv_bytes_per_token_match_facts(model: str, per_token: int) -> None:
    assert MODEL_DIMS[model].kv_bytes_per_token() == per_token
    assert MODEL_DIMS[model].kv_bytes_per_token(tp=2) == per_token // 2
    assert MODEL_DIMS[model].kv_bytes_per_token(tp=16) == per_token // 8  # kv_heads/tp is at least 1


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_param_estimate_from_config_is_exact_for_the_builtin_models(model: str) -> None:
    dims = dims_from_config(CONFIGS[model], name=model)
    table = MODEL_DIMS[model]
    assert (dims.layers, dims.kv_heads, dims.head_dim, dims.dtype_bytes) == (
        table.layers,
        table.kv_heads,
        table.head_dim,
        table.dtype_bytes,
    )
    assert dims.params == table.params


def test_dims_from_config_details() -> None:
    cfg = dict(CONFIGS["meta-llama/Llama-3.1-8B-Instruct"])
    cfg.pop("num_key_value_heads")
    assert dims_from_config(cfg).kv_heads == 32  # falls back to num_attention_heads
    assert dims_from_config({**cfg, "torch_dtype": "float32"}).dtype_bytes == 2  # served in 16 bits
    nested = {"text_config": CONFIGS["Qwen/Qwen3-0.6B"], "torch_dtype": "bfloat16"}
    assert dims_from_config(nested).params == QWEN.params
    with pytest.raises(ValueError, match="num_hidden_layers"):
        dims_from_config({"hidden_size": 8, "num_attention_heads": 2})


def test_model_dims_lookup(tmp_path: Path) -> None:
    assert model_dims("Qwen/Qwen3-0.6B") == QWEN
    assert model_dims("qwen/qwen3-0.6b") == QWEN
    assert model_dims("/models/Qwen/Qwen3-0.6B") == QWEN  # a path ending in a known id, without config
    assert model_dims("acme/unknown") is None


def test_model_dims_reads_a_local_config(tmp_path: Path) -> None:
    tiny = {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny))
    dims = model_dims("acme/tiny", str(d))
    assert dims is not None
    assert (dims.layers, dims.kv_heads, dims.head_dim) == (2, 2, 16)
    assert dims.params == 2 * 1000 * 64 + 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert model_dims(str(d)) == ModelDims(2, 2, 16, dims.params, 2, str(d), 64, 1000)
    # a local copy of a known model: dims from its config, the exact param count from the table
    q = tmp_path / "Qwen3-0.6B"
    q.mkdir()
    (q / "config.json").write_text(json.dumps(CONFIGS["Qwen/Qwen3-0.6B"]))
    assert model_dims("Qwen/Qwen3-0.6B", q) == QWEN
    # a broken config falls back to the table, or to None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert model_dims("Qwen/Qwen3-0.6B", bad) == QWEN
    assert model_dims("acme/x", bad) is None


def test_model_dims_validation() -> None:
    with pytest.raises(ValueError, match="layers"):
        ModelDims(0, 8, 128, 10)
    with pytest.raises(ValueError, match="params"):
        ModelDims(1, 8, 128, True)


# ---------------------------------------------------------------------------------------------- engine rules


def test_engine_rules() -> None:
    assert len(prefill_capture_sizes(8192)) == 58  # 58 buckets for 8192
    assert len(prefill_capture_sizes(4096)) == 50
    assert prefill_capture_sizes(8192)[-1] == 8192 and prefill_capture_sizes(8192)[0] == 4
    assert card_defaults(23034) == (4096, 48)
    assert card_defaults(40960) == (4096, 32)
    assert card_defaults(H100) == (8192, 256)
    assert card_defaults(143771) == (8192, 256)
    assert card_defaults(H100, tp=4) == (8192, 512)
    assert card_defaults(15000) == (2048, 8)
    assert card_defaults(192 * 1024) == (16384, 512)
    assert activation_reserve_mib(activation_tokens(chunked_prefill_size=8192)) == 12928  # the seed's "~12.6 GB"
    assert activation_reserve_mib(activation_tokens(chunked_prefill_size=1024)) == 512 + 2048 * 1.5 + 128
    assert activation_reserve_mib(activation_tokens(chunked_prefill_size=-1, max_prefill_tokens=16384)) == (
        512 + 16384 * 1.5 + 128)
    assert automatic_fraction(H100, 13904) == 0.83  # the engine's default is ~0.83 on an 80 GB H100
    assert automatic_fraction(H100, total_reserve_mib(H100, 5000, 0)) == round((H100 - 10240) / H100, 3)  # floor
    assert automatic_fraction(23034, total_reserve_mib(23034, 5000, 0)) == round((23034 - 5000) / 23034, 3)
    assert total_reserve_mib(H100, 5000, 0, 2048) == 10240 + 2048  # DeepEP's share lies on top of the floor


# ---------------------------------------------------------------------------------------- the seed finding


def test_seed_default_fraction_leaves_slack_below_the_reserve() -> None:
    led = predict_memory(QWEN, H100, argv=["--mem-fraction-static=0.83"])
    assert led.verdict is Verdict.SLACK_BELOW_RESERVE
    assert not led.fits and not led.fraction_automatic
    assert led.slack_mib == pytest.approx(H100 * 0.17)  # ~13.5 GiB: the seed analysis' "~13 GB"
    assert 13 * 1024 < led.slack_mib < 14 * 1024
    assert led.activation_reserve_mib / 1024 == pytest.approx(12.6, abs=0.05)  # the seed analysis' "~12.6 GB"
    assert led.prefill_buckets == 58 and led.prefill_graph_reserve_mib == 58 * 8
    assert led.decode_graph_reserve_mib == 256 * 2
    assert led.slack_mib < led.required_mib  # below the engine's own reserve even without the margin
    assert led.headroom_mib < 0
    assert led.weights_mib == pytest.approx(QWEN.params * 2 / 2**20)
    # the seed log's own free memory (Load weight begin. avail mem=73.11 GB) gives its ~556K KV tokens
    mem = parse_memory((LOGS / "seed_prefill_capture_oom.log").read_text())
    assert mem.load_begin_avail_gb is not None and mem.kv_tokens is not None
    seen = predict_memory(
        QWEN, H100, gpu_free_mib=round(mem.load_begin_avail_gb * 1024), argv=["--mem-fraction-static", "0.83"]
    )
    assert seen.kv_tokens == pytest.approx(556_000, rel=0.01)
    assert seen.kv_tokens == pytest.approx(mem.kv_tokens, rel=0.01)
    assert seen.verdict is Verdict.SLACK_BELOW_RESERVE
    # with the whole card free the pool is bigger (the formula with free = total)
    assert led.kv_tokens == 608_522


def test_seed_automatic_fraction_is_the_same_as_083() -> None:
    led = predict_memory(QWEN, H100)
    assert led.fraction_automatic and led.mem_fraction_static == 0.83
    assert led.verdict is Verdict.SLACK_BELOW_RESERVE


def test_ci_budget_fits() -> None:
    led = predict_memory(QWEN, H100, argv=list(CI))
    assert led.verdict is Verdict.FITS and led.fits
    assert led.prefill_graph == "disabled" and led.prefill_graph_reserve_mib == 0
    assert led.slack_mib == pytest.approx(H100 * 0.4)
    assert led.kv_tokens == pytest.approx(437_015, abs=1)
    assert led.headroom_mib > 0


def test_healthy_log_matches_the_prediction() -> None:
    text = (LOGS / "healthy.log").read_text()
    mem = parse_memory(text)
    assert mem.load_begin_avail_gb is not None and mem.kv_tokens is not None
    led = predict_memory(QWEN, H100, gpu_free_mib=round(mem.load_begin_avail_gb * 1024), argv=list(CI))
    assert led.kv_tokens == pytest.approx(mem.kv_tokens, rel=0.01)
    assert led.verdict is Verdict.FITS


def test_llama_8b_on_l4() -> None:
    led = predict_memory(LLAMA8B, gpu_card_mib("L4"), argv=list(CI))
    assert led.verdict is Verdict.WEIGHTS_DO_NOT_FIT
    assert led.kv_tokens == 0
    assert "static budget" in led.explanation
    tiny_free = predict_memory(LLAMA8B, gpu_card_mib("L4"), gpu_free_mib=9000, argv=list(CI))
    assert tiny_free.verdict is Verdict.WEIGHTS_DO_NOT_FIT
    assert "exceed the free memory" in tiny_free.explanation
    # tp=2 halves the weights per GPU: it fits under the budget on two L4s
    assert predict_memory(LLAMA8B, gpu_card_mib("L4"), argv=list(CI), tp=2).verdict is Verdict.FITS


def test_max_total_tokens_caps_the_pool() -> None:
    free = predict_memory(QWEN, H100, argv=list(CI))
    capped = predict_memory(QWEN, H100, argv=[*CI, "--max-total-tokens", "4096"])
    assert capped.kv_tokens == 4096 and capped.kv_tokens_profiled == free.kv_tokens
    assert capped.kv_pool_mib == pytest.approx(4096 * 114_688 / 2**20)
    assert capped.after_kv_mib > free.after_kv_mib  # what the pool does not take stays free
    assert "capped by --max-total-tokens=4096" in capped.render()
    # the cap also bounds the prefill graph buckets
    on = predict_memory(QWEN, H100, argv=["--mem-fraction-static=0.6", "--max-total-tokens=1024"])
    assert on.prefill_buckets == len(prefill_capture_sizes(1024)) == 38


def test_argv_forms() -> None:
    a = predict_memory(
        QWEN, H100, argv=["--mem-fraction-static", "0.6", "--cuda-graph-backend-prefill", "disabled"]
    )
    b = predict_memory(QWEN, H100, argv=list(CI))
    assert a == b
    last = predict_memory(QWEN, H100, argv=["--mem-fraction-static=0.9", "--mem-fraction-static=0.6"])
    assert last.mem_fraction_static == 0.6
    ignored = predict_memory(QWEN, H100, argv=["--model-path", "Qwen/Qwen3-0.6B", "--port", "30000", *CI])
    assert ignored == b
    # sglang's argparse accepts unambiguous prefixes; so does the ledger
    abbrev = predict_memory(QWEN, H100, argv=["--mem-frac", "0.6", "--cuda-graph-backend-pref=disabled"])
    assert abbrev == b
    assert predict_memory(QWEN, H100, argv=["--mem=0.83"]).mem_fraction_static == 0.83
    assert predict_memory(LLAMA1B, H100, argv=[*CI, "--tp", "2"]).tp == 2
    chunked = predict_memory(QWEN, H100, argv=[*CI, "--chunked-prefill-size=2048"])
    assert chunked.chunked_prefill_size == 2048 and chunked.activation_reserve_mib == 512 + 3072 + 128


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mem-fraction-static=lots"], "--mem-fraction-static must be a number, got 'lots'"),
        (["--mem-fraction-static"], "--mem-fraction-static needs a value"),
        (["--mem-fraction-static=1.5"], "between 0 and 1"),
        (["--chunked-prefill-size=8k"], "--chunked-prefill-size must be an integer"),
        (["--cuda-graph-backend-prefill=off"], "must be one of full, breakable, disabled, got 'off'"),
    ],
)
def test_argv_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        predict_memory(QWEN, H100, argv=argv)


def test_tensor_parallel() -> None:
    one = predict_memory(LLAMA1B, H100, argv=list(CI))
    two = predict_memory(LLAMA1B, H100, argv=list(CI), tp=2)
    assert two.tp == 2 and two.weights_mib == pytest.approx(one.weights_mib / 2)
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.activation_reserve_mib == one.activation_reserve_mib + 128
    via_argv = predict_memory(LLAMA1B, H100, argv=[*CI, "--tp-size", "2"])
    assert via_argv == two
    with pytest.raises(ValueError, match="disagrees"):
        predict_memory(LLAMA1B, H100, argv=[*CI, "--tp-size", "2"], tp=4)


def test_graph_switches() -> None:
    off = predict_memory(QWEN, H100, argv=["--mem-fraction-static=0.6", "--disable-cuda-graph"])
    assert off.decode_graph == off.prefill_graph == "disabled" and off.graph_reserve_mib == 0
    no_decode = predict_memory(QWEN, H100, argv=[*CI, "--cuda-graph-backend-decode=disabled"])
    assert no_decode.decode_graph_reserve_mib == 0
    capped_bs = predict_memory(QWEN, H100, argv=[*CI, "--max-running-requests", "16"])
    assert capped_bs.decode_max_bs == 16 and capped_bs.decode_graph_reserve_mib == 32
    explicit = predict_memory(
        QWEN, H100, argv=[*CI, "--cuda-graph-max-bs-decode=64", "--max-running-requests=16"]
    )
    assert explicit.decode_max_bs == 64


def test_kv_pool_empty() -> None:
    huge = ModelDims(layers=1000, kv_heads=64, head_dim=256, params=1000, name="huge-kv")
    led = predict_memory(huge, 1000, argv=["--mem-fraction-static=0.05"])
    assert led.verdict is Verdict.KV_POOL_EMPTY and led.kv_tokens == 0
    assert "raise --mem-fraction-static" in led.explanation


def test_suggestion_when_the_ci_budget_itself_is_too_small() -> None:
    led = predict_memory(LLAMA8B, gpu_card_mib("L4"))  # the automatic fraction: 0.684
    assert led.fraction_automatic and led.mem_fraction_static == 0.684
    assert led.verdict is Verdict.SLACK_BELOW_RESERVE
    assert led.suggested_fraction == 0.68  # 0.6 would not hold the weights
    assert "--mem-fraction-static=0.68 --cuda-graph-backend-prefill=disabled" in led.explanation
    assert predict_memory(QWEN, H100).suggested_fraction == 0.6
    assert predict_memory(LLAMA8B, 16000).suggested_fraction is None


def test_margin() -> None:
    # the automatic fraction on an H200 leaves 42 MiB more than the engine's own reserve: inside the margin
    auto = predict_memory(QWEN, GPU_CARDS["H200"])
    assert auto.mem_fraction_static == 0.903 and auto.slack_mib > auto.required_mib
    assert auto.verdict is Verdict.SLACK_BELOW_RESERVE
    assert predict_memory(QWEN, GPU_CARDS["H200"], margin=0.0).verdict is Verdict.FITS


def test_render_and_frozen() -> None:
    led = predict_memory(QWEN, H100, argv=["--mem-fraction-static=0.83"])
    lines = led.render().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(
        "Qwen/Qwen3-0.6B on 81559 MiB GPU (free 81559), tp=1, mem_fraction_static=0.83 (given)"
    )
    assert "608,522 tokens (114,688 B/token)" in lines[1] and "slack 13865 MiB" in lines[1]
    assert (
        "activations 12928 (chunked 8192)" in lines[2]
        and "prefill graph 464 (58 buckets, breakable)" in lines[2]
    )
    assert lines[3].startswith("  verdict: slack_below_reserve: graph capture will likely run out of memory")
    assert str(led) == led.render()
    assert "(automatic)" in predict_memory(QWEN, H100).render()
    assert "verdict: fits" in predict_memory(QWEN, H100, argv=list(CI)).render()
    assert isinstance(led, MemoryLedger)
    with pytest.raises(dataclasses.FrozenInstanceError):
        led.verdict = Verdict.FITS  # type: ignore[misc]
    assert Verdict("fits") is Verdict.FITS and str(Verdict.KV_POOL_EMPTY) == "kv_pool_empty"


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="gpu_total_mib"):
        predict_memory(QWEN, 0)
    with pytest.raises(ValueError, match="gpu_free_mib"):
        predict_memory(QWEN, H100, gpu_free_mib=-1)


def test_the_ledgers_reading_of_the_log_agrees_with_a_kv_pool_that_does_not_fit() -> None:
    """Beside a KV pool that found no room, the ledger's reading of agreeing memory lines speaks of the pool, not of
    "memory the ledger does not model (activations or graphs)", which is what it says beside an allocation that ran
    out."""
    import dataclasses

    # a pool that did not fit logs no "KV Cache is allocated" line: free memory at load and the weights only
    mem = dataclasses.replace(parse_memory((LOGS / "healthy.log").read_text()), kv_tokens=None)
    assert mem.load_begin_avail_gb is not None and mem.weights_gb is not None
    led = predict_memory(QWEN, H100, gpu_free_mib=round(mem.load_begin_avail_gb * 1024), argv=list(CI))
    assert led.verdict is Verdict.FITS
    pool = led.against_log(mem, kv_pool=True)
    assert "found no room for the KV pool" in pool and "activations or graphs" not in pool
    assert "ran out of memory" not in pool
    ran_out = led.against_log(mem)
    assert "the engine ran out of memory" in ran_out and "activations or graphs" in ran_out
