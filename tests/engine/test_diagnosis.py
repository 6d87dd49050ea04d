"""Unit tests of :mod:`pytest_sglworker.engine.diagnosis` over the log fixtures in ``tests/data/logs``.

``real_*.log`` were captured from the real sglang 0.5.23 server on a CPU-only machine (tiny random model);
``github_<kind>_<number>.log`` are real GPU logs copied from sglang's public issue tracker (each file starts with a
``# `` header: the issue's link, the sglang version where stated, what was trimmed and scrubbed); the others are
synthetic GPU logs in 0.5.23's format (see the fixture table below for what each shows). Where a real log disagreed
with the synthetic ones or with the classifier, the real one won.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from pytest_sglworker.engine.diagnosis import FATAL_KINDS, MEMORY_KINDS, Diagnosis, Kind, Rule, _interesting, diagnose
from pytest_sglworker.engine.diagnosis_rules import RULES, required_literals, rule_for, using_rules
from pytest_sglworker.engine.log_lines import (
    parse_kv_tokens,
    parse_max_total_tokens,
    parse_memory,
    startup_phase,
    startup_phase_from_file,
)

LOGS = Path(__file__).resolve().parents[1] / "data" / "logs"


def read(name: str) -> str:
    return (LOGS / name).read_text(encoding="utf-8")


def line_of(name: str, needle: str, occurrence: int = 1) -> int:
    """1-based number of the ``occurrence``-th line of a fixture containing ``needle``."""
    seen = 0
    for number, line in enumerate(read(name).split("\n"), start=1):
        if needle in line:
            seen += 1
            if seen == occurrence:
                return number
    raise AssertionError(f"{needle!r} not in {name}")


# (fixture, returncode, kind, text of the first error's line (None: no first error), words of the summary)
CASES: list[tuple[str, int | None, Kind, str | None, tuple[str, ...]]] = [
    (
        "seed_prefill_capture_oom.log",
        -9,
        Kind.GRAPH_CAPTURE_OOM,
        "torch.AcceleratorError: CUDA error: out of memory",
        ("prefill CUDA graph", "bucket 26 of 58", "num_tokens=704"),
    ),
    (
        "kv_does_not_fit.log",
        -9,
        Kind.KV_POOL_DOES_NOT_FIT,
        "ValueError: Loaded weights leave no GPU memory",
        ("--mem-fraction-static=0.6",),
    ),
    (
        "kv_does_not_fit_old.log",
        -9,
        Kind.KV_POOL_DOES_NOT_FIT,
        "RuntimeError: Not enough memory.",
        ("KV cache",),
    ),
    (
        "weights_oom.log",
        -9,
        Kind.WEIGHTS_OOM,
        "torch.OutOfMemoryError: CUDA out of memory",
        ("loading the weights",),
    ),
    ("port_in_use.log", None, Kind.PORT_IN_USE, "[Errno 98]", ("30000",)),
    ("rpc_port_in_use.log", 1, Kind.PORT_IN_USE, "Port is already in use.", ("rpc_port 31236",)),
    (
        "model_not_found_repo.log",
        1,
        Kind.MODEL_NOT_FOUND,
        "errors.RepositoryNotFoundError: 401",
        ("acme/Qwen3-0.6B-typo",),
    ),
    ("nccl_error.log", -9, Kind.NCCL_ERROR, "NCCL WARN Cuda failure 217", ("peer access is not supported",)),
    ("silent_sigkill.log", -9, Kind.KILLED_BY_SIGNAL, None, ("SIGKILL", "-9")),
    (
        "unknown_traceback.log",
        1,
        Kind.UNKNOWN,
        "ValueError: The checkpoint you are trying to load",
        ("qwen9_moe", "traceback starts at log line 4"),
    ),
    ("healthy.log", None, Kind.NONE, None, ("ready",)),
    ("healthy.log", 0, Kind.NONE, None, ()),
    # captured from the real engine
    ("real_healthy_sigterm.log", -9, Kind.NONE, None, ("SIGTERM",)),
    (
        "real_model_path_missing.log",
        1,
        Kind.MODEL_NOT_FOUND,
        "errors.HFValidationError: Repo id",
        ("/tmp/diagcap/no-such-model",),
    ),
    ("real_hub_offline.log", 1, Kind.MODEL_NOT_FOUND, "errors.LocalEntryNotFoundError: Cannot", ("offline",)),
    (
        "real_bad_flag_unrecognized.log",
        2,
        Kind.BAD_FLAG,
        "sglang serve: error: unrecognized arguments",
        ("unrecognized arguments: --no-such-flag 1",),
    ),
    (
        "real_bad_flag_invalid_choice.log",
        2,
        Kind.BAD_FLAG,
        "invalid choice: 'bogus'",
        ("argument --cuda-graph-backend-decode: invalid choice",),
    ),
    (
        "real_bad_flag_ambiguous.log",
        2,
        Kind.BAD_FLAG,
        "ambiguous option: --cuda-graph-max-bs",
        ("--cuda-graph-max-bs-decode",),
    ),
    ("real_port_in_use.log", None, Kind.PORT_IN_USE, "[Errno 98]", ("44721",)),
    ("real_nccl_port_in_use.log", -9, Kind.PORT_IN_USE, "DistNetworkError", ("53242",)),
    (
        "real_scheduler_sigkill.log",
        1,
        Kind.KILLED_BY_SIGNAL,
        "scheduler died during initialization",
        ("SIGKILL",),
    ),
    (
        "real_no_cpu_engine.log",
        -9,
        Kind.UNKNOWN,
        "ModuleNotFoundError: No module named 'vllm'",
        ("No module named 'vllm'",),
    ),
    ("real_no_accelerator.log", 1, Kind.UNKNOWN, "RuntimeError: No accelerator", ("No accelerator",)),
    # real GPU logs from sglang's public issue tracker (the link and what was trimmed are in each file's header)
    (
        "github_graph_capture_oom_5285.log",
        None,
        Kind.GRAPH_CAPTURE_OOM,
        "Exception: Capture cuda graph failed: CUDA out of memory",
        ("decode CUDA graph",),
    ),
    (
        "github_graph_capture_oom_14476.log",
        None,
        Kind.GRAPH_CAPTURE_OOM,
        "torch.OutOfMemoryError:",
        ("prefill CUDA graph", "bucket 2 of 58, num_tokens=3968"),
    ),
    (
        "github_graph_capture_error_7227.log",
        None,
        Kind.GRAPH_CAPTURE_ERROR,
        "self.worker = TpModelWorker(",
        ("decode CUDA graph",),
    ),
    (
        "github_kv_pool_does_not_fit_2128.log",
        None,
        Kind.KV_POOL_DOES_NOT_FIT,
        "ValueError: Loaded weights leave no GPU memory for the KV cache",
        ("--mem-fraction-static=0.88",),
    ),
    (
        "github_cuda_oom_12496.log",
        None,
        Kind.CUDA_OOM,
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB",
        ("while allocating the KV cache pool",),
    ),
    (
        "github_nccl_error_4289.log",
        None,
        Kind.NCCL_ERROR,
        "RuntimeError: NCCL error: unhandled system error",
        ("unhandled system error",),
    ),
    (
        "github_unknown_3456.log",
        None,
        Kind.UNKNOWN,
        "initialize_model_parallel(tensor_model_parallel_size=self.tp_size)",
        ("traceback starts at log line 10",),
    ),
    ("github_none_7691.log", None, Kind.NONE, None, ("allocating KV pool",)),
    ("web_worker_crash_loop.log", None, Kind.WEB_WORKER_CRASH_LOOP, "Child process [5660] died",
     ("died 3 times", "Child process [N] died")),
    ("github_none_4840.log", None, Kind.NONE, None, ("capturing CUDA graphs",)),
    ("github_none_11716.log", None, Kind.NONE, None, ("capturing CUDA graphs",)),
]


@pytest.mark.parametrize(
    ("name", "returncode", "kind", "first_line", "words"), CASES, ids=[f"{c[0]}-rc{c[1]}" for c in CASES]
)
def test_fixture_is_classified(
    name: str, returncode: int | None, kind: Kind, first_line: str | None, words: tuple[str, ...]
) -> None:
    d = diagnose(read(name), returncode)
    assert d.kind is kind, d.render()
    if first_line is None:
        assert d.first_error_line is None and d.first_error == ""
    else:
        assert d.first_error_line == line_of(name, first_line), d.render()
        assert first_line in d.first_error.splitlines()[0]
    for word in words:
        assert word in d.summary, d.summary
    assert d.returncode == returncode
    assert d.is_error is (kind is not Kind.NONE)
    if kind not in (Kind.NONE,):
        assert d.advice


def test_every_fixture_is_in_the_table() -> None:
    assert {c[0] for c in CASES} == {p.name for p in LOGS.glob("*.log")}


# ---------------------------------------------------------------------------------------------- the seed


def test_seed_cause_is_the_oom_not_the_assertion_logged_before_it() -> None:
    name = "seed_prefill_capture_oom.log"
    d = diagnose(read(name), -9)
    assertion = line_of(name, "markCaptureEnd called with no captures in progress")
    # sglang's breakable-graph context logs the assertion *before* the scheduler prints the chained traceback
    assert assertion < d.first_error_line  # type: ignore[operator]
    assert d.first_error_line == line_of(name, "CUDA error: out of memory")
    assert "markCaptureEnd" not in d.first_error and "markCaptureEnd" not in d.summary
    cleanup = [s for s in d.secondary if "markCaptureEnd" in s]
    assert len(cleanup) == 1  # the logged copy and the traceback copy are one secondary entry
    assert cleanup[0].startswith(f"log line {assertion}: ")
    assert "not the cause" in cleanup[0]
    assert any("Received sigquit" in s for s in d.secondary)
    assert "--cuda-graph-backend-prefill=disabled" in d.advice and "--mem-fraction-static" in d.advice
    assert d.phase == "capturing CUDA graphs"


def test_seed_render() -> None:
    d = diagnose(read("seed_prefill_capture_oom.log"), -9)
    lines = d.render().splitlines()
    assert lines[0] == f"diagnosis: {d.summary}"
    assert (
        lines[1]
        == f"first error (log line {d.first_error_line}): torch.AcceleratorError: CUDA error: out of memory"
    )
    assert any(line.startswith("secondary (not the cause): log line ") for line in lines)
    assert lines[-1].startswith("advice: ")
    assert str(d) == d.render()
    assert len(d.first_error.splitlines()) <= 5


def _decode_first(text: str) -> str:
    """The seed with a successful decode capture before the prefill one (the order older versions use)."""
    decode = (
        "[2026-12-02 10:00:20] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
        "avail mem=12.20 GB\n"
        "[2026-12-02 10:00:31] Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=11.2 s, "
        "mem usage=0.45 GB, avail mem=11.75 GB.\n"
    )
    marker = "Capture target prefill CUDA graph begin"
    start = text.index(marker)
    start = text.rindex("\n", 0, start) + 1
    return text[:start] + decode + text[start:]


def test_capture_oom_after_a_finished_decode_capture() -> None:
    d = diagnose(_decode_first(read("seed_prefill_capture_oom.log")), -9)
    assert d.kind is Kind.GRAPH_CAPTURE_OOM
    assert "prefill" in d.summary


def test_oom_inside_an_open_decode_capture() -> None:
    log = (
        "[2026-12-02 10:00:00] Load weight begin. avail mem=78.50 GB\n"
        "[2026-12-02 10:00:02] Load weight end. elapsed=1.2 s, type=Qwen3ForCausalLM, avail mem=77.30 GB, "
        "mem usage=1.20 GB.\n"
        "[2026-12-02 10:00:03] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
        "avail mem=0.40 GB\n"
        "[2026-12-02 10:00:04] Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "/x/sglang/srt/managers/scheduler.py", line 1, in run_scheduler_process\n'
        "    scheduler = Scheduler(server_args, port_args)\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB.\n"
    )
    d = diagnose(log, -9)
    assert d.kind is Kind.GRAPH_CAPTURE_OOM
    assert "decode CUDA graph" in d.summary
    assert d.first_error_line == 7


def test_cleanup_assertion_alone_is_never_called_an_oom() -> None:
    log = (
        "[2026-12-02 10:00:00] Capture target prefill CUDA graph begin. backend=breakable, avail mem=1.0 GB\n"
        "[2026-12-02 10:00:01] RuntimeError: num_active_captures_ > 0 INTERNAL ASSERT FAILED at "
        '"/pytorch/c10/'
        'cuda/CUDACachingAllocator.cpp":2969, please report a bug to PyTorch. markCaptureEnd called with no '
        "captures in progress\n"
        "[2026-12-02 10:00:01] Received sigquit from a child process. It usually means the child failed.\n"
    )
    d = diagnose(log, -9)
    assert d.kind is Kind.GRAPH_CAPTURE_ERROR
    assert "cleanup assertion" in d.summary and "prefill" in d.summary
    assert d.first_error_line == 2


def test_oom_wins_over_an_assertion_printed_first_in_the_same_traceback_order() -> None:
    """Even in a log where the assertion's traceback comes before the OOM's, the OOM is the cause."""
    log = (
        "Traceback (most recent call last):\n"
        '  File "/x/torch/cuda/graphs.py", line 169, in capture_end\n'
        "    super().capture_end()\n"
        'RuntimeError: num_active_captures_ > 0 INTERNAL ASSERT FAILED at "x":1, please report a bug to '
        "PyTorch. markCaptureEnd called with no captures in progress\n"
        "Traceback (most recent call last):\n"
        '  File "/x/sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", line 1, in capture\n'
        "    self._capture_one_stream()\n"
        '  File "/x/torch/cuda/graphs.py", line 169, in capture_end\n'
        "    super().capture_end()\n"
        "torch.AcceleratorError: CUDA error: out of memory\n"
    )
    d = diagnose(log, 1)
    assert d.kind is Kind.GRAPH_CAPTURE_OOM
    assert d.first_error_line == 10
    assert any("markCaptureEnd" in s and "not the cause" in s for s in d.secondary)


# ---------------------------------------------------------------------------------------------- noise, codes


NOISE = (
    "/usr/lib/python3/dist-packages/sglang/launch_server.py:71: UserWarning: "
    "'python -m sglang.launch_server' is "
    "still supported, but 'sglang serve' is the recommended entrypoint.\n"
    "  warnings.warn(\n"
    "[2026-12-02 10:00:00] Ignore import error when loading sglang.srt.models.glm_ocr: No module named "
    "'transformers.models.glm_ocr'\n"
    "[2026-12-02 10:00:00 TP0] Ignore import error when loading sglang.srt.models.inkling: "
    "ImportError: cutlass\n"
    "[2026-12-02 10:00:00] OpenAI Responses API (/v1/responses) disabled: OpenAIServingResponses init failed "
    "(ModuleNotFoundError: No module named 'openai_harmony')\n"
    "[rank0]:[W1202 10:00:14.1 ProcessGroupNCCL.cpp:1552] Warning: WARNING: destroy_process_group() was not "
    "called before program exit, which can leak resources.\n"
    "[2026-12-02 10:00:01] Port 30000 is already in use, trying port 30001\n"
    "[2026-12-02 10:00:02] The server is fired up and ready to roll!\n"
)


def test_noise_is_not_an_error() -> None:
    d = diagnose(NOISE, 0)
    assert d.kind is Kind.NONE, d.render()
    assert d.phase == "ready"
    assert diagnose(NOISE).kind is Kind.NONE


def test_empty_log() -> None:
    assert diagnose("").kind is Kind.NONE
    d = diagnose("", -9)
    assert d.kind is Kind.KILLED_BY_SIGNAL and "SIGKILL" in d.summary


@pytest.mark.parametrize(
    ("rc", "name"), [(-9, "SIGKILL"), (-15, "SIGTERM"), (-11, "SIGSEGV"), (-6, "SIGABRT")]
)
def test_signal_names(rc: int, name: str) -> None:
    d = diagnose(NOISE, rc)
    assert d.kind is Kind.KILLED_BY_SIGNAL
    assert name in d.summary and str(rc) in d.summary
    assert d.advice


def test_sigkill_advice_points_at_the_host_oom_killer() -> None:
    assert "OOM killer" in diagnose("", -9).advice


def test_positive_exit_code_without_error() -> None:
    d = diagnose(NOISE, 3)
    assert d.kind is Kind.UNKNOWN
    assert "code 3" in d.summary and d.first_error_line is None


def test_error_found_while_the_worker_still_runs() -> None:
    """uvicorn's failed bind leaves the process up: the launcher can diagnose before any exit."""
    d = diagnose(read("real_port_in_use.log"), None)
    assert d.kind is Kind.PORT_IN_USE


def test_errors_after_a_requested_shutdown_are_not_causes() -> None:
    log = read("healthy.log") + (
        "[2026-12-02 10:05:00] SIGTERM received. signum=None frame=None. Draining requests and shutting "
        "down...\n"
        "[2026-12-02 10:05:01] Subprocess scheduler_0 (pid=4243) crashed with exit code -15. "
        "Triggering SIGQUIT "
        "for cleanup...\n"
        "[2026-12-02 10:05:01] SIGQUIT received. signum=None, frame=None. It usually means one child "
        "failed.\n"
    )
    d = diagnose(log, -9)
    assert d.kind is Kind.NONE
    assert "SIGTERM" in d.summary


def test_child_killed_during_startup_without_parent_signal() -> None:
    log = (
        "[2026-12-02 10:00:00] Load weight begin. avail mem=78.50 GB\n"
        "[2026-12-02 10:00:09] Subprocess scheduler_0 (pid=4243) crashed with exit code -9. "
        "Triggering SIGQUIT "
        "for cleanup...\n"
        "[2026-12-02 10:00:09] Received sigquit from a child process. It usually means the child failed.\n"
    )
    d = diagnose(log, 1)
    assert d.kind is Kind.KILLED_BY_SIGNAL
    assert "SIGKILL" in d.summary and d.first_error_line == 2


# ---------------------------------------------------------------------------------------------- patterns


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("sglang serve: error: the following arguments are required: --model-path", Kind.BAD_FLAG),
        ("launch_server.py: error: unrecognized arguments: --cuda-graph-max-bs 8", Kind.BAD_FLAG),
        ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:30001')", Kind.PORT_IN_USE),
        (
            "ValueError: nccl_port at 31005 is not available in 30 seconds. "
            "nccl_port at 31005 is not available",
            Kind.PORT_IN_USE,
        ),
        ("OSError: [Errno 98] Address already in use", Kind.PORT_IN_USE),
        (
            "OSError: /models/Qwen3-0.6B does not appear to have a file named config.json. Checkout "
            "'https://huggingface.co//models/Qwen3-0.6B/tree/None' for available files.",
            Kind.MODEL_NOT_FOUND,
        ),
        (
            "FileNotFoundError: [Errno 2] No such file or directory: '/models/Qwen3-0.6B/config.json'",
            Kind.MODEL_NOT_FOUND,
        ),
        ("huggingface_hub.errors.GatedRepoError: 403 Client Error.", Kind.MODEL_NOT_FOUND),
        (
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, "
            "internal error - please "
            "report this issue to the NCCL developers, NCCL version 2.27.3",
            Kind.NCCL_ERROR,
        ),
        (
            "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
            Kind.NCCL_ERROR,
        ),
        ("RuntimeError: ncclInternalError: Internal check failed.", Kind.NCCL_ERROR),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", Kind.CUDA_OOM),
        (
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
            "mem_fraction_static=0.3",
            Kind.KV_POOL_DOES_NOT_FIT,
        ),
    ],
)
def test_error_patterns_in_a_traceback(line: str, kind: Kind) -> None:
    if kind is Kind.BAD_FLAG:
        log = (
            "usage: sglang serve [-h] [--model-path MODEL_PATH]\n                    [--port PORT]\n"
            + line
            + "\n"
        )
    else:
        log = (
            "[2026-12-02 10:00:00] Scheduler hit an exception: Traceback (most recent call last):\n"
            '  File "/x/sglang/srt/managers/scheduler.py", line 6362, in run_scheduler_process\n'
            "    scheduler = Scheduler(server_args, port_args)\n" + line + "\n"
        )
    d = diagnose(log, 1)
    assert d.kind is kind, d.render()
    assert d.first_error_line == log.count("\n")


def test_kv_summary_reads_the_fraction() -> None:
    log = (
        "Traceback (most recent call last):\n"
        '  File "/x/a.py", line 1, in f\n'
        "    g()\n"
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
        "mem_fraction_static=0.3\n"
    )
    assert "--mem-fraction-static=0.3" in diagnose(log, 1).summary


def test_the_first_of_two_errors_wins_and_the_second_is_secondary() -> None:
    log = (
        "[2026-12-02 10:00:00] ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', "
        "30000): address already in use\n"
        "Traceback (most recent call last):\n"
        '  File "/x/a.py", line 1, in f\n'
        "    g()\n"
        "KeyError: 'boom'\n"
    )
    d = diagnose(log, 1)
    assert d.kind is Kind.PORT_IN_USE and d.first_error_line == 1
    assert d.secondary == ("log line 5: KeyError: 'boom' (a later error)",)


def test_unknown_chain_quotes_the_propagated_exception_and_where_the_traceback_starts() -> None:
    d = diagnose(read("real_no_accelerator.log"), 1)
    assert d.summary.endswith(
        f"(traceback starts at log line {line_of('real_no_accelerator.log', 'Traceback')})"
    )
    assert "(chained from: NotImplementedError)" in d.first_error
    assert "--device cpu" in d.advice


def test_secondary_is_bounded() -> None:
    log = "".join(
        f"Traceback (most recent call last):\n  File \"/x.py\", line {i}, in f\n    g()\nKeyError: 'k{i}'\n"
        for i in range(20)
    )
    d = diagnose(log, 1)
    assert d.first_error_line == 4
    assert len(d.secondary) == 7 and d.secondary[-1] == "... and 13 more"


def test_carriage_returns_and_ansi_codes() -> None:
    log = (
        "\x1b[32m[2026-12-02 10:00:00]\x1b[0m Capture target prefill CUDA graph begin. backend=breakable\n"
        "Capturing prefill shape (num_tokens=8192 avail_mem=3.00 GB):   0%|          | 0/58 [00:00<?, ?it/s]"
        "\rCapturing prefill shape (num_tokens=7680 avail_mem=2.10 GB):   2%|▏         | 1/58 [00:02<02:00, "
        "2.0s/it]\n"
        "[2026-12-02 10:00:05] OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.\n"
        "Fail when using backend: breakable for prefill runner.\n"
    )
    d = diagnose(log, -9)
    assert d.kind is Kind.GRAPH_CAPTURE_OOM
    assert "bucket 2 of 58, num_tokens=7680" in d.summary
    assert d.first_error_line == 3
    assert d.first_error.splitlines() == [
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.",
        "Fail when using backend: breakable for prefill runner.",
    ]


def test_diagnosis_is_frozen_and_kind_is_a_string() -> None:
    d = diagnose("", None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.kind = Kind.UNKNOWN  # type: ignore[misc]
    assert Kind("graph_capture_oom") is Kind.GRAPH_CAPTURE_OOM
    assert Kind.GRAPH_CAPTURE_OOM.value == "graph_capture_oom" and str(Kind.BAD_FLAG) == "bad_flag"
    assert isinstance(Kind.NONE, str)
    assert isinstance(d, Diagnosis)


def test_diagnose_is_fast_on_a_large_log() -> None:
    filler = (
        "[2026-12-02 10:00:00] Decode batch, #running-req: 1, #token: 31, token usage: 0.00, "
        "cuda graph: True\n"
    )
    text = read("healthy.log") + filler * 40_000 + read("seed_prefill_capture_oom.log")
    assert len(text) > 4_000_000
    start = time.perf_counter()
    d = diagnose(text, -9)
    assert time.perf_counter() - start < 5.0
    assert d.kind is Kind.GRAPH_CAPTURE_OOM


# ---------------------------------------------------------------------------------------------- phases


@pytest.mark.parametrize(
    ("name", "phase"),
    [
        ("healthy.log", "ready"),
        ("seed_prefill_capture_oom.log", "capturing CUDA graphs"),
        ("weights_oom.log", "loading weights"),
        ("kv_does_not_fit.log", "allocating KV pool"),
        ("port_in_use.log", "starting HTTP server"),
        ("real_healthy_sigterm.log", "ready"),
        ("real_bad_flag_unrecognized.log", None),
    ],
)
def test_startup_phase_of_fixtures(name: str, phase: str | None) -> None:
    assert startup_phase(read(name)) == phase


def test_startup_phase_sequence() -> None:
    steps = [
        ("[t] Init parallel begin.", None),
        ("[t] Load weight begin. avail mem=78.50 GB", "loading weights"),
        (
            "[t] Load weight end. elapsed=1 s, type=X, avail mem=77.3 GB, mem usage=1.2 GB.",
            "allocating KV pool",
        ),
        (
            "[t] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 10, K size: 0 GB, V size: 0 GB",
            "allocating KV pool",
        ),
        ("[t] Capture target decode CUDA graph begin. backend=full", "capturing CUDA graphs"),
        ("[t] Capture target decode CUDA graph end. bs=[1]", "capturing CUDA graphs"),
        ("[t] max_total_num_tokens=10, chunked_prefill_size=8192", "starting HTTP server"),
        ("[t] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)", "warming up"),
        ("[t] The server is fired up and ready to roll!", "ready"),
    ]
    text = ""
    for line, phase in steps:
        text += line + "\n"
        assert startup_phase(text) == phase, line


def test_startup_phase_on_a_tail_and_from_a_flooded_file(tmp_path: Path) -> None:
    seed = read("seed_prefill_capture_oom.log")
    assert startup_phase(seed[-64 * 1024 :]) == "capturing CUDA graphs"
    log = tmp_path / "w.log"
    log.write_text(seed[: seed.index("Scheduler hit")] + "x" * 80 + "\n" + ("flood " * 20 + "\n") * 30_000)
    assert log.stat().st_size > 3_000_000
    assert startup_phase(log.read_text()[-64 * 1024 :]) is None  # the tail alone has no marker
    start = time.perf_counter()
    assert startup_phase_from_file(log, max_bytes=64 * 1024) == "capturing CUDA graphs"
    assert time.perf_counter() - start < 2.0
    assert startup_phase_from_file(tmp_path / "missing.log") is None
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert startup_phase_from_file(empty) is None


def test_startup_phase_marker_across_chunk_boundary(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    marker = "Load weight begin. avail mem=1 GB\n"
    body = "a" * (4096 - 10) + marker + "b" * 5000
    log.write_text(body)
    assert startup_phase_from_file(log, max_bytes=4096) == "loading weights"


def test_startup_phase_is_cheap() -> None:
    text = read("healthy.log") * 200
    start = time.perf_counter()
    for _ in range(20):
        startup_phase(text)
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------------------------------------- memory lines


def test_parse_kv_tokens() -> None:
    assert parse_kv_tokens(read("seed_prefill_capture_oom.log")) == 557442
    assert parse_kv_tokens(read("healthy.log")) == 430740
    assert parse_kv_tokens(read("real_healthy_sigterm.log")) == 1024
    assert parse_kv_tokens(read("weights_oom.log")) is None
    old = (
        "[2025-01-15 21:17:30 TP0] KV Cache is allocated. #tokens: 1304738, K size: 74.66 GB, "
        "V size: 74.66 GB\n"
    )
    assert parse_kv_tokens(old) == 1304738
    two = (
        old
        + "[2025-01-15 21:18:30 TP0] KV Cache is allocated. #tokens: 5, K size: 0.00 GB, V size: 0.00 GB\n"
    )
    assert parse_kv_tokens(two) == 5


def test_parse_max_total_tokens() -> None:
    assert parse_max_total_tokens(read("healthy.log")) == 430740
    assert parse_max_total_tokens(read("real_healthy_sigterm.log")) == 1024
    assert parse_max_total_tokens(read("seed_prefill_capture_oom.log")) is None


def test_parse_memory() -> None:
    m = parse_memory(read("seed_prefill_capture_oom.log"))
    assert m.load_begin_avail_gb == pytest.approx(73.11)
    assert m.load_end_avail_gb == pytest.approx(71.97)
    assert m.weights_gb == pytest.approx(1.14)
    assert m.kv_dtype == "torch.bfloat16"
    assert m.kv_tokens == 557442
    assert m.k_size_gb == m.v_size_gb == pytest.approx(29.77, abs=0.01)
    assert m.max_total_num_tokens is None
    empty = parse_memory("")
    assert empty.kv_tokens is None and empty.load_begin_avail_gb is None


def test_native_crash_lines() -> None:
    log = (
        "[2026-12-02 10:00:00] Load weight begin. avail mem=78.50 GB\n"
        "terminate called after throwing an instance of 'c10::Error'\n"
        "  what():  CUDA error: out of memory\n"
    )
    d = diagnose(log, -6)
    assert d.kind is Kind.WEIGHTS_OOM and d.first_error_line == 2
    assert "what():  CUDA error: out of memory" in d.first_error
    fatal = "[2026-12-02 10:00:00] Load weight end. elapsed=1 s\nFatal Python error: Segmentation fault\n"
    d = diagnose(fatal, -11)
    assert d.kind is Kind.UNKNOWN and d.first_error_line == 2


# ---------------------------------------------------------------------------------------------- the rule records


def test_every_kind_has_exactly_one_rule_and_its_flags() -> None:
    assert [rule.kind for rule in RULES].count(Kind.UNKNOWN) == 1
    assert {rule.kind for rule in RULES} == set(Kind) and len(RULES) == len(Kind)
    for kind in Kind:
        rule = rule_for(kind)
        assert rule.kind is kind and kind.rule is rule
        assert kind.fatal is rule.fatal and kind.memory is rule.memory
    assert {k.value for k in FATAL_KINDS} == {
        "graph_capture_oom", "graph_capture_error", "kv_pool_does_not_fit", "weights_oom", "cuda_oom",
        "port_in_use", "model_not_found", "nccl_error", "bad_flag", "sim_fault",
    }
    assert {k.value for k in MEMORY_KINDS} == {
        "graph_capture_oom", "kv_pool_does_not_fit", "weights_oom", "cuda_oom", "killed_by_signal",
    }
    assert "port_in_use" in FATAL_KINDS  # a str Enum: the old string sets' callers keep working


@pytest.mark.parametrize(
    ("name", "returncode", "fatal", "memory"),
    [
        ("seed_prefill_capture_oom.log", -9, True, True),
        ("real_port_in_use.log", None, True, False),
        ("silent_sigkill.log", -9, False, True),
        ("real_no_accelerator.log", 1, False, False),
        ("healthy.log", None, False, False),
    ],
)
def test_diagnosis_fatal_and_memory_related(name: str, returncode: int | None, fatal: bool, memory: bool) -> None:
    d = diagnose(read(name), returncode)
    assert d.fatal is fatal and d.kind.fatal is fatal
    assert d.memory_related is memory and d.kind.memory is memory


def test_required_literals() -> None:
    assert required_literals(r"(?:foo|barbaz)\d+quux") == {"quux"}
    assert required_literals(r"(?:FileNotFoundError|No such file)[^\n]*(?:x|y)") == {
        "FileNotFoundError", "No such file"
    }
    assert required_literals(r"\bEADDRINUSE\b|\[Errno 98\]") == {"EADDRINUSE", "[Errno 98]"}
    assert required_literals(r"(?i:Address) is in use now") == {" is in use now"}
    assert required_literals(r"(?i:Address already) in") == {"address already"}
    assert required_literals(r"\d+|abc") == frozenset()  # one branch needs no literal: nothing is required


def test_a_rule_without_literal_text_is_refused() -> None:
    with pytest.raises(ValueError, match="no literal text"):
        Rule(Kind.UNKNOWN, lambda f: "", lambda f: "", patterns=(r"^\w+: \d+$",))


def test_the_prefilter_covers_every_rule_pattern() -> None:
    """Every match of every rule pattern contains one of its required literals, and the pre-filter matches each."""
    interesting = _interesting()
    for rule in RULES:
        sources = (*rule.patterns, *(rule.standalone or ()), *rule.symptoms, *rule.warnings)
        for source in sources:
            literals = required_literals(source, rule.flags)
            assert literals, (rule.kind, source)
            for literal in literals:
                assert interesting.search(literal), (rule.kind, source, literal)


def test_a_new_pattern_is_enabled_by_its_record_alone() -> None:
    """A synthetic rule: one more pattern in the port record, nothing else touched, and the scanner sees it."""
    line = "[2026-12-02 10:00:00] flux capacitor is busy on 127.0.0.1:31000"
    log = read("healthy.log") + line + "\n"
    assert not _interesting().search(line)
    assert diagnose(log, None).kind is Kind.NONE
    port = rule_for(Kind.PORT_IN_USE)
    extended = dataclasses.replace(port, patterns=(*port.patterns, r"flux capacitor is busy"))
    with using_rules(extended if rule is port else rule for rule in RULES):
        assert _interesting().search(line)
        d = diagnose(log, None)
        assert d.kind is Kind.PORT_IN_USE, d.render()
        assert d.first_error_line == log.count("\n")
        assert d.fatal
    assert diagnose(log, None).kind is Kind.NONE  # the built-in records are back


def test_no_reference_to_files_outside_the_repository() -> None:
    import pytest_sglworker.engine.diagnosis as module
    import pytest_sglworker.engine.diagnosis_rules as rules

    for mod in (module, rules):
        assert "FACTS.md" not in Path(str(mod.__file__)).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------- real GPU logs

GITHUB = sorted(p.name for p in LOGS.glob("github_*.log"))


def header_of(name: str) -> list[str]:
    lines = read(name).split("\n")
    header = [line for line in lines if line.startswith("# ")]
    assert lines[: len(header)] == header, f"{name}: the '# ' header must be the file's first lines"
    return header


def test_there_are_real_logs_of_each_gpu_failure() -> None:
    kinds = {name.removeprefix("github_").rsplit("_", 1)[0] for name in GITHUB}
    assert {"graph_capture_oom", "kv_pool_does_not_fit", "nccl_error", "cuda_oom"} <= kinds
    assert sum(1 for name in GITHUB if "KV Cache is allocated" in read(name)) >= 2


@pytest.mark.parametrize("name", GITHUB)
def test_real_log_header_names_the_source_and_is_harmless(name: str) -> None:
    header = header_of(name)
    assert header and "https://github.com/" in header[0]
    assert any(line.startswith("# Trimmed:") for line in header) and any(
        line.startswith("# Scrubbed:") for line in header
    )
    text = read(name)
    assert "/home/" not in text or all("/home/user/" in line for line in text.split("\n") if "/home/" in line)
    header_text = "\n".join(header) + "\n"
    d = diagnose(header_text, None)
    assert d.kind is Kind.NONE and d.secondary == () and d.phase is None, d.render()
    body = text[len(header_text) :]
    full, alone = diagnose(text, None), diagnose(body, None)
    assert full.kind is alone.kind and full.advice == alone.advice and full.phase == alone.phase
    assert (full.first_error_line is None) is (alone.first_error_line is None)
    if alone.first_error_line is not None:
        assert full.first_error_line == alone.first_error_line + len(header)
        assert full.first_error == alone.first_error


@pytest.mark.parametrize(
    ("name", "tokens", "load_end_avail", "weights", "k_size"),
    [
        ("github_graph_capture_error_7227.log", 132681, 21.96, 8.81, 9.11),
        ("github_none_4840.log", 46045, None, None, 2.99),
        ("github_none_11716.log", 2795207, None, None, 53.31),
        ("github_kv_pool_does_not_fit_2128.log", None, 12.25, 125.65, None),
        ("github_none_7691.log", None, 21.73, 166.59, None),
    ],
)
def test_real_memory_lines(
    name: str, tokens: int | None, load_end_avail: float | None, weights: float | None, k_size: float | None
) -> None:
    """Older versions print "KV Cache is allocated. #tokens: N, K size: ..." without the dtype; rank prefixes."""
    text = read(name)
    assert parse_kv_tokens(text) == tokens
    m = parse_memory(text)
    assert m.kv_tokens == tokens and m.kv_dtype is None
    assert m.load_end_avail_gb == (pytest.approx(load_end_avail) if load_end_avail is not None else None)
    assert m.weights_gb == (pytest.approx(weights) if weights is not None else None)
    assert m.k_size_gb == (pytest.approx(k_size) if k_size is not None else None)
    assert m.v_size_gb == m.k_size_gb


def test_piecewise_capture_bar_marks_the_capture() -> None:
    """Real 0.5.x: no "Capture ... graph begin" line is in view, only the piecewise bar, and the stack starts on the
    bar's own line; an unfinished bar is a capture in progress (and names the bucket)."""
    name = "github_graph_capture_oom_14476.log"
    d = diagnose(read(name), None)
    assert d.kind is Kind.GRAPH_CAPTURE_OOM and d.memory_related and d.fatal
    assert "--cuda-graph-backend-prefill=disabled" in d.advice
    finished = read(name).replace("| 1/58 [", "| 58/58 [")
    assert diagnose(finished, None).kind is Kind.CUDA_OOM  # a finished bar is no capture in progress
    old_bar = "Capturing batches (avail_mem=2.85 GB):   0%|          | 0/4 [00:00<?, ?it/s]Traceback"
    d = diagnose(old_bar + " (most recent call last):\n  File \"/x/y.py\", line 1, in f\n    g()\nRuntimeError: boom\n")
    assert d.kind is Kind.GRAPH_CAPTURE_ERROR and "decode CUDA graph" in d.summary


def test_capture_failed_wrapper_alone_says_capture() -> None:
    """0.4.x wraps the OOM as "Exception: Capture cuda graph failed: ..." (issue 5285): enough without frames."""
    line = read("github_graph_capture_oom_5285.log").split("\n")[-2]
    assert line.startswith("Exception: Capture cuda graph failed")
    assert diagnose(line + "\n", 1).kind is Kind.GRAPH_CAPTURE_OOM
    other = "Exception: Capture cuda graph failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection c\n"
    assert diagnose(other, 1).kind is Kind.GRAPH_CAPTURE_ERROR


def test_headerless_traceback_frames_are_not_errors() -> None:
    """A copy that starts inside a stack (issue 4289): the frame's source line `raise RuntimeError(f"NCCL error:
    ...")` is code, not the error; the exception line under the frames is."""
    name = "github_nccl_error_4289.log"
    d = diagnose(read(name), None)
    assert d.first_error_line == line_of(name, "RuntimeError: NCCL error: unhandled system error")
    assert d.first_error_line != line_of(name, 'raise RuntimeError(f"NCCL error')
    assert any("Received sigquit" in s for s in d.secondary)
    kv = diagnose(read("github_cuda_oom_12496.log"), None)
    assert kv.memory_related and "--max-total-tokens" in kv.advice


def test_old_sigquit_spelling_and_its_place_before_the_stack() -> None:
    """sglang 0.4.2 wrote "child proces." and printed it before the failing scheduler's stack (issue 3456)."""
    name = "github_unknown_3456.log"
    d = diagnose(read(name), None)
    first = line_of(name, "Received sigquit from a child proces.")
    assert first < d.first_error_line  # type: ignore[operator]
    assert d.secondary == (
        f"log line {first}: Received sigquit from a child proces. It usually means the child failed. "
        "(the server tearing down after the failure)",
    )


def test_negative_profile_warning_is_not_an_error() -> None:
    """Issue 7691: "max_total_tokens=... is larger than the profiled value -561981" is a warning; servers have gone
    on to serve after it, so it is no cause by itself and the exit code decides."""
    text = read("github_none_7691.log")
    assert diagnose(text, None).kind is Kind.NONE
    d = diagnose(text, 1)
    assert d.kind is Kind.UNKNOWN and d.first_error_line is None and "code 1" in d.summary


def test_capture_oom_advice_reads_the_argv_before_it_recommends_a_flag() -> None:
    """Advice never tells a worker to keep a flag its argv already has: with --cuda-graph-backend-prefill=disabled
    given (CI_WORKER_ARGS) it says what else to try, below the argv's own --mem-fraction-static; without the flag it
    says to pass it; with no argv known, what CI_WORKER_ARGS say."""
    log = read("seed_prefill_capture_oom.log")
    ci = ["python", "-m", "sglang.launch_server", "--mem-fraction-static=0.6", "--cuda-graph-backend-prefill",
          "disabled"]
    given = diagnose(log, -9, ci).advice
    assert not given.startswith("keep") and "already has --cuda-graph-backend-prefill=disabled" in given
    assert "lower --mem-fraction-static below its 0.6" in given
    bare = diagnose(log, -9, ["python", "-m", "sglang.launch_server"]).advice
    assert bare.startswith("pass --cuda-graph-backend-prefill=disabled") and "lower --mem-fraction-static (e.g." in bare
    assert diagnose(log, -9).advice.startswith("keep --cuda-graph-backend-prefill=disabled (part of CI_WORKER_ARGS)")


# ---------------------------------------------------------------------------------------- which error is the cause

NCCL_WARN_1 = ("ci-runner-7:4312:4399 [1] transport/p2p.cc:275 NCCL WARN Cuda failure 217 'peer access is not "
               "supported between these two devices'")
NCCL_WARN_2 = "ci-runner-7:4311:4398 [0] transport/p2p.cc:275 NCCL WARN Cuda failure 1 'invalid argument'"
NCCL_ERROR = [
    "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error",
    "ncclUnhandledCudaError: Call to CUDA function failed.",
    "Last error: peer access",
    "Cuda failure 'peer access is not supported between these two devices'",
]


def test_the_first_nccl_warning_before_the_error_leads_its_quote() -> None:
    log = "\n".join(["[2026-12-02 10:00:00] Load weight begin.", NCCL_WARN_1, NCCL_WARN_2, *NCCL_ERROR,
                     NCCL_WARN_1 + " again"]) + "\n"
    d = diagnose(log, -9)
    assert d.kind is Kind.NCCL_ERROR
    assert d.first_error_line == 2
    assert d.first_error.splitlines() == [NCCL_WARN_1, *NCCL_ERROR[:2]]  # the warning, then the error's first lines
    assert d.secondary == ()  # warnings of the error's own kind are not other errors


def test_a_warning_after_the_error_is_not_merged_into_it() -> None:
    log = "\n".join(["[2026-12-02 10:00:00] Load weight begin.", *NCCL_ERROR, NCCL_WARN_1]) + "\n"
    d = diagnose(log, -9)
    assert d.first_error_line == 2 and d.first_error.splitlines()[0] == NCCL_ERROR[0]


@pytest.mark.parametrize(("returncode", "kind", "line"), [
    (None, Kind.NONE, None), (0, Kind.NONE, None), (1, Kind.NCCL_ERROR, 2), (-9, Kind.NCCL_ERROR, 2),
])
def test_warnings_alone_are_the_cause_only_of_a_failed_exit(returncode: int | None, kind: Kind,
                                                             line: int | None) -> None:
    d = diagnose("\n".join(["[2026-12-02 10:00:00] Load weight begin.", NCCL_WARN_1, NCCL_WARN_2, "done"]) + "\n",
                 returncode)
    assert d.kind is kind and d.first_error_line == line


def test_later_errors_are_listed_in_log_order_a_chained_traceback_included() -> None:
    """A traceback's events come out of the scan with the exception it stands for first: the list is sorted."""
    log = "RuntimeError: the first failure\n" + read("unknown_traceback.log")
    d = diagnose(log, 1)
    assert d.first_error_line == 1
    numbers = [int(s.split(":")[0].removeprefix("log line ")) for s in d.secondary]
    assert len(numbers) >= 2 and numbers == sorted(numbers), d.secondary


def test_each_later_error_is_listed_once_past_the_causes_own_warnings() -> None:
    log = "\n".join([*NCCL_ERROR, NCCL_WARN_1, "ValueError: another problem", "[2026-12-02 10:00:02] Retrying.",
                     "ValueError: another problem"]) + "\n"
    d = diagnose(log, 1)
    assert d.first_error_line == 1
    assert d.secondary == ("log line 6: ValueError: another problem (a later error)",)
    assert d.secondary_text == ("ValueError: another problem",)  # what each quotes, for the tail's marks


def test_a_child_that_exited_with_a_positive_code_is_not_a_death_by_signal() -> None:
    log = ("[2026-12-02 10:00:00] Load weight begin. avail mem=78.50 GB\n"
           "[2026-12-02 10:00:09] Subprocess scheduler_0 (pid=4243) crashed with exit code 1. Triggering SIGQUIT for "
           "cleanup...\n")
    d = diagnose(log, 1)
    assert d.kind is Kind.UNKNOWN and d.first_error_line is None


def test_the_port_is_read_from_errors_of_the_causes_kind_only() -> None:
    log = "\n".join([
        "[2026-12-02 10:00:00] Load weight begin.",
        "[2026-12-02 10:00:01] ERROR:    [Errno 98] error while attempting to bind on address: address already in use",
        "[2026-12-02 10:00:02] ValueError: the tokenizer server at port: 9999 refused",
        "[2026-12-02 10:00:03] zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:30001')",
    ]) + "\n"
    d = diagnose(log, 1)
    assert d.kind is Kind.PORT_IN_USE and d.first_error_line == 2
    assert d.summary == "a port the worker needs is already in use (30001)"  # not another error's 9999
