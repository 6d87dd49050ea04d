"""Unit tests of :mod:`pytest_sglworker.engine.sglang_facts`, and proof that its readers agree with each other.

The real-engine tier (``test_sglang_facts_real.py``) pins the tables to sglang itself; these tests pin the
modules that read them (budget, ledger, launcher, simulated engine) to the same answers, so that the copies
that once disagreed (prefill capture buckets 4,8,12,... vs 4,8,16,...; decode max_bs 512 vs 256 at tp>=4
on 80 GB cards) cannot come back."""

from __future__ import annotations

import pytest

from pytest_sglworker.engine.budget import flag_values
from pytest_sglworker.engine.ledger import GPU_CARDS, predict_memory
from pytest_sglworker.engine.redaction import mask_argv, secret_values
from pytest_sglworker.engine.sglang_facts import (
    MODEL_DIMS,
    AmbiguousFlag,
    card_defaults,
    decode_capture_sizes,
    flag_table,
    human_readable_int,
    prefill_capture_sizes,
)
from pytest_sglworker.sim import main as simmod
from pytest_sglworker.workers.launcher import foreign_hosts

QWEN = MODEL_DIMS["Qwen/Qwen3-0.6B"]


def test_resolve_follows_argparse() -> None:
    table = flag_table()
    assert table.resolve("--mem-fraction-static").dest == "mem_fraction_static"  # type: ignore[union-attr]
    assert table.resolve("--mem").dest == "mem_fraction_static"  # type: ignore[union-attr]
    assert table.resolve("--tensor-parallel-size").dest == "tp_size"  # type: ignore[union-attr]
    assert table.resolve("--model").dest == "model_path"  # type: ignore[union-attr]  (an exact alias)
    assert table.resolve("--no-such-flag") is None
    with pytest.raises(AmbiguousFlag, match="--cuda-graph-max-bs could match --cuda-graph-max-bs-decode"):
        table.resolve("--cuda-graph-max-bs")
    assert table.shortest_prefix("mem_fraction_static") == "--mem"
    assert table.shortest_prefix("cuda_graph_backend_prefill") == "--cuda-graph-backend-p"


def test_parse_reads_every_form() -> None:
    parsed = flag_table().parse(["--mem", "0.5", "--cuda-graph-backend-prefill=disabled", "--skip-server-warmup",
                                 "--no-enable-tf32-matmul", "--host", "--port", "1", "--bogus", "x"])
    assert parsed.all("mem_fraction_static") == ["0.5"]
    assert parsed.last("cuda_graph_backend_prefill") == "disabled"
    assert parsed.given("skip_server_warmup") and parsed.last("enable_tf32_matmul") == "false"
    assert parsed.all("host") == [None]  # a value-taking flag followed by another option
    assert parsed.last("port") == "1" and parsed.unknown == ["--bogus"]


def test_human_readable_int() -> None:
    assert human_readable_int("32k") == 32_000 and human_readable_int("4Ki") == 4096
    with pytest.raises(ValueError, match="Invalid integer value"):
        human_readable_int("lots")


def test_budget_ledger_and_launcher_read_flags_through_the_table() -> None:
    # abbreviations the real parser accepts are seen by every reader
    assert flag_values(["--mem-frac", "0.9", "--cuda-graph-backend-pre=breakable"]) == {
        "--mem-fraction-static": ["0.9"], "--cuda-graph-backend-prefill": ["breakable"]}
    assert predict_memory(QWEN, 81559, argv=["--mem-fra", "0.5"]).mem_fraction_static == 0.5
    assert foreign_hosts(["--ho", "0.0.0.0", "--host=127.0.0.1"]) == ["0.0.0.0"]
    argv = ["--api-k", "abc", "--admin-api-key=xy", "--max-total-tokens", "64", "--hf-token", "hf_zz"]
    assert mask_argv(argv) == ["--api-k", "***", "--admin-api-key=***", "--max-total-tokens", "64", "--hf-token",
                               "***"]
    assert secret_values({}, ["--api-k", "long-secret"]) == ["long-secret"]


@pytest.mark.parametrize("card", sorted(GPU_CARDS))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("extra", [(), ("--cuda-graph-backend-prefill=disabled",), ("--disaggregation-mode", "decode"),
                                   ("--max-running-requests", "16", "--chunked-prefill-size", "2048")])
def test_the_simulated_engine_and_the_ledger_agree(card: str, tp: int, extra: tuple[str, ...]) -> None:
    total = GPU_CARDS[card]
    ns = simmod.build_parser().parse_args(["--model-path", "Qwen/Qwen3-0.6B", "--tp-size", str(tp), *extra])
    plan = simmod.make_plan(ns, total / 1024)
    ledger = predict_memory(QWEN, total, argv=["--tp-size", str(tp), *extra], tp=tp)
    assert plan.fraction == ledger.mem_fraction_static
    assert (plan.chunked_prefill_size, plan.decode_max_bs) == (ledger.chunked_prefill_size, ledger.decode_max_bs)
    assert len(plan.prefill_buckets) == ledger.prefill_buckets


def test_capture_sizes_and_card_defaults() -> None:
    assert len(prefill_capture_sizes(8192)) == 58 and prefill_capture_sizes(8192)[:10] == [4, 8, 12, 16, 20, 24, 28,
                                                                                          32, 48, 64]
    assert decode_capture_sizes(256)[:6] == [1, 2, 4, 8, 12, 16] and decode_capture_sizes(256)[-1] == 256
    assert card_defaults(81559, tp=4) == (8192, 512) and card_defaults(81559, tp=2) == (8192, 256)
