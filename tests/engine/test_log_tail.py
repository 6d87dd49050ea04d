"""The tail of a log as failure reports quote it (:func:`pytest_sglworker.engine.log_tail.condense`): each kind of
noise folded, what was folded said, the first error's neighbourhood kept, the bound held."""

from __future__ import annotations

from pytest_sglworker.engine.log_tail import MAX_LINE_CHARS, condense

STAMP = "[2026-12-04 05:51:36] "


def probe(path: str = "/ready", status: int = 503, port: int = 40000) -> str:
    return f'{STAMP}INFO:     127.0.0.1:{port} - "GET {path} HTTP/1.1" {status} Service Unavailable'


def test_probes_collapse_per_path_and_status_and_are_counted() -> None:
    lines = ["Uvicorn running", *(probe(port=40000 + i) for i in range(38)), "hung",
             probe(status=200), probe(path="/health", status=200), probe(path="/health", status=200)]
    tail = condense(lines, 20)
    assert tail.lines == ("Uvicorn running", "… 38 x GET /ready 503 (health probes)", "hung",
                          "… 1 x GET /ready 200 (health probes)", "… 2 x GET /health 200 (health probes)")
    assert tail.notes == ("41 health probe lines collapsed",)


def test_a_request_of_the_test_is_not_a_probe() -> None:
    post = f'{STAMP}INFO:     127.0.0.1:40000 - "POST /generate HTTP/1.1" 200 OK'
    assert condense([post, post], 5).lines == (f"{post}  (x 2)",)


def test_progress_bars_and_repeats_keep_the_last_with_a_count() -> None:
    bars = [f"Capturing batches (bs={b} avail_mem=31.6 GB):  {p}%|██  | {n}/36 [00:01<00:00]"
            for b, p, n in ((1, 10, 4), (2, 50, 18), (4, 100, 36))]
    lines = [*bars, f"{STAMP}same", "[2026-12-04 05:51:37] same"]
    tail = condense(lines, 10)
    assert tail.lines == (f"{bars[-1]}  (… 3 progress lines, the last shown)", "[2026-12-04 05:51:37] same  (x 2)")
    assert tail.notes == ("2 progress-bar lines collapsed", "1 repeated lines collapsed")


def test_a_carriage_return_progress_line_shows_what_a_terminal_shows() -> None:
    assert condense(["10%|█ | 1/10 [\r50%|█████ | 5/10 [\r100%|██████████| 10/10 ["], 3).lines == (
        "100%|██████████| 10/10 [",)


def test_a_long_line_is_cut_and_its_length_said() -> None:
    long = "cuda_graph_bs=[" + "x" * 15_000 + "]"
    tail = condense([long], 3)
    assert tail.lines[0].startswith(long[:MAX_LINE_CHARS]) and tail.lines[0].endswith("(15,016 characters, cut)")
    assert tail.notes == ("1 long line cut",)


def test_lines_that_are_never_a_cause_fold_into_one_setup_line() -> None:
    """sglang's dump of its arguments (15 KB) and the simulated engine's note on its token counts say nothing about
    a failure: one line counts them."""
    lines = [f"{STAMP}server_args=ServerArgs(model_path='Qwen/Qwen3-0.6B', " + "x" * 15_000 + ")",
             f"{STAMP}(sim) counting tokens without the model's tokenizer: no tokenizer.json for Qwen/Qwen3-0.6B",
             f"{STAMP}Init parallel begin.", f"{STAMP}(sim) request faults set: {{\"die_after\": 1}}"]
    tail = condense(lines, 10)
    assert tail.lines == ("… 2 setup lines (the engine's arguments and notes) …", lines[2], lines[3])
    assert tail.notes == ("2 setup lines folded",)


def test_lines_the_text_quotes_above_are_marked_where_they_stand() -> None:
    """What the failure text quotes above the tail (its first error, what is not the cause) is not repeated: each
    run of such lines becomes one mark, at its place, with its time stamp; a quote cut with '...' marks every line
    it begins; a rank prefix does not hide a quoted line."""
    error = ["torch.AcceleratorError: CUDA error: out of memory",
             "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"]
    cleanup = "RuntimeError: num_active_captures_ > 0 INTERNAL ASSERT FAILED " + "y" * 500
    lines = [f"{STAMP}Capture begin", f"{STAMP}{cleanup}", "  File \"x.py\", line 1, in f", *error, "",
             f"[TP0] {cleanup}", f"{STAMP}kill_process_tree called", f"{STAMP}Received sigquit"]
    quoted = {error[0]: "the first error", error[1]: "the first error", cleanup[:397] + "...": "not the cause",
              "Received sigquit": "not the cause"}
    tail = condense(lines, 20, quoted=quoted)
    assert tail.lines == (f"{STAMP}Capture begin", f"{STAMP}… not the cause, quoted above …", lines[2],
                          "… the first error (2 lines), quoted above …", "", "… not the cause, quoted above …",
                          lines[7], f"{STAMP}… not the cause, quoted above …")
    assert tail.notes == ("5 lines quoted above marked",)
    assert condense(lines, 20).lines[3] == error[0]  # nothing quoted: nothing marked


def test_a_long_traceback_keeps_its_first_and_last_frames() -> None:
    frames = []
    for i in range(10):
        frames += [f'  File "/sglang/m{i}.py", line {i}, in f{i}', f"    call_{i}()"]
    lines = ["Traceback (most recent call last):", *frames, "RuntimeError: boom"]
    text = condense(lines, 20).text
    assert 'File "/sglang/m0.py"' in text and 'File "/sglang/m9.py"' in text and 'File "/sglang/m8.py"' in text
    assert 'File "/sglang/m5.py"' not in text and "RuntimeError: boom" in text
    assert "frames" in text  # the frames between are counted


def test_the_first_error_far_above_the_end_is_kept_with_its_neighbourhood() -> None:
    lines = [f"line {i}" for i in range(200)]
    lines[20] = "RuntimeError: the cause"
    tail = condense(lines, 12, first_error_line=21)
    assert tail.lines[:7] == ("line 18", "line 19", "RuntimeError: the cause", "line 21", "line 22", "line 23",
                              "line 24")
    assert tail.lines[7] == "… 171 lines …" and tail.lines[-1] == "line 199"
    assert len(tail.lines) == 12


def test_line_offset_places_the_first_error_of_a_partial_read() -> None:
    lines = [f"line {i}" for i in range(1000, 1100)]
    lines[5] = "ValueError: here"
    tail = condense(lines, 10, first_error_line=1006, line_offset=1000)
    assert "ValueError: here" in tail.lines
    assert condense(lines, 10, first_error_line=10, line_offset=1000).lines[-1] == "line 1099"  # above the read


def test_the_bound_holds_and_nothing_is_kept_for_no_room() -> None:
    lines = [f"distinct {i}" for i in range(100)]
    assert len(condense(lines, 7).lines) == 7
    assert condense(lines, 0).lines == ()
    assert condense([], 5).lines == ()
