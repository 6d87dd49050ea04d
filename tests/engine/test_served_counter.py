"""Counting what a worker served from its own access log (``ModelInstance.requests_served``)."""

from __future__ import annotations

from pathlib import Path

from pytest_sglworker.engine.log_lines import READY_LINE, ServedCounter

WARMUP = '[2026-12-04 07:00:00] INFO:     127.0.0.1:40000 - "POST /generate HTTP/1.1" 200 OK\n'


def _access(path: str, status: str = "200 OK") -> str:
    return f'[2026-12-04 07:00:01] INFO:     127.0.0.1:40001 - "POST {path} HTTP/1.1" {status}\n'


def test_from_the_ready_line_the_warmup_is_not_counted(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(WARMUP + f"[2026-12-04 07:00:00] {READY_LINE}\n" + _access("/generate"))
    counter = ServedCounter(log)
    assert counter.update() == 1
    with log.open("a") as fh:
        fh.write(_access("/v1/chat/completions") + _access("/v1/completions", "503 Service Unavailable")
                 + '[2026-12-04 07:00:02] INFO:     127.0.0.1:40002 - "GET /health HTTP/1.1" 200 OK\n')
    assert counter.update() == 2  # a refusal and a health probe are not served requests
    assert counter.refused == {"/v1/completions": 1}


def test_from_the_offset_at_readiness_a_request_logged_before_the_ready_line_counts(tmp_path: Path) -> None:
    # the engine answers ready a moment before it logs its ready line: the test's first request may come first
    log = tmp_path / "w.log"
    log.write_text(WARMUP)
    ready_offset = log.stat().st_size
    with log.open("a") as fh:
        fh.write(_access("/generate") + f"[2026-12-04 07:00:01] {READY_LINE}\n" + _access("/generate"))
    assert ServedCounter(log).update() == 1  # the ready line alone misses the first one
    assert ServedCounter(log, ready_offset).update() == 2


def test_a_line_still_being_written_is_counted_once_complete(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(WARMUP)
    counter = ServedCounter(log, log.stat().st_size)
    line = _access("/generate")
    with log.open("a") as fh:
        fh.write(line[:30])
    assert counter.update() == 0
    with log.open("a") as fh:
        fh.write(line[30:])
    assert counter.update() == 1
