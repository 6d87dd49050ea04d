"""What the plugin shows a person (a pytest-facing module, split from ``plugin.py``): the report header, live
status and message lines, the failure sections of tests that used workers, the terminal summary and the
``--sgl-list-models`` registry. Registered as a plugin object of its own, beside the session object.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..engine import budget
from ..errors import SglWorkerError
from .session import is_xdist_worker, xdist_worker_id

if TYPE_CHECKING:
    from ..engine.specs import SpecRegistry
    from ..workers.launcher import ModelInstance
    from .options import Settings
    from .session import SglSession

#: A worker that is healthy sooner than this shows no status line at all.
STATUS_AFTER_SECONDS = 2.0
#: Off a terminal (and for xdist workers' progress) a status line is repeated at most this often.
PLAIN_INTERVAL_SECONDS = 30.0
_last_plain_line: dict[str, float] = {}
_status_shown: list[bool] = [False]
_lock = threading.Lock()


def _uncaptured(config: pytest.Config) -> contextlib.AbstractContextManager[object]:
    """Write to the real terminal even while a test's output is captured (as live logging does)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()


def message(session: SglSession, text: str, *, always: bool = False) -> None:
    """A ``[sglworker] ...`` line, kept for the session's record too. ``always``: a ``sglworker: ...`` line
    that shows whatever the verbosity (the report's path)."""
    session.messages.append(text)
    config = session.config
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or (config.get_verbosity() < 0 and not always):
        return
    with _lock, _uncaptured(config):
        _clear(tr)
        tr.ensure_newline()
        tr.write_line(f"sglworker: {text}" if always else f"[sglworker] {text}", red=text.startswith("ERROR"))


def status_text(instance: ModelInstance, elapsed: float) -> str:
    """``[sglworker] 12 s loading weights: worker qwen3-0.6b on 127.0.0.1:20004 (pid 42, GPUs 0)``: the phase
    and the time first, where a narrow terminal still shows them."""
    from ..engine.diagnosis import startup_phase_from_file

    phase = startup_phase_from_file(instance.log_path) or "starting"
    return f"[sglworker] {elapsed:.0f} s {phase}: {instance.describe()}"


def progress(session: SglSession, instance: ModelInstance, elapsed: float) -> None:
    """The live status line of a worker that takes a while to start: in place on a terminal, a line now and
    then elsewhere, and, from an xdist worker, through the controller. It never fails a launch."""
    if elapsed < STATUS_AFTER_SECONDS:
        return
    try:
        text = status_text(instance, elapsed)
        relay = _relay_path(session.config)
        if relay is not None:
            worker = xdist_worker_id(session.config) or "?"
            _append(relay, {"worker": worker, "key": str(instance.port), "text": text})
            return
        _show(session.config, str(instance.port), text)
    except Exception as exc:  # a status line must never fail a launch
        session.messages.append(f"status line failed: {exc!r}")


def progress_end(session: SglSession) -> None:
    """The wait is over: clear the status line before pytest writes the test's outcome."""
    try:
        relay = _relay_path(session.config)
        if relay is not None:
            worker = xdist_worker_id(session.config) or "?"
            _append(relay, {"worker": worker, "done": True})
            return
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            with _lock, _uncaptured(session.config):
                _clear(tr)
    except Exception as exc:
        session.messages.append(f"status line failed: {exc!r}")


def _width(tr: Any) -> int:
    return max(20, int(getattr(getattr(tr, "_tw", None), "fullwidth", 80)) - 1)


def _clear(tr: Any) -> None:
    if _status_shown[0]:
        tr.write("\r" + " " * _width(tr) + "\r")
        _status_shown[0] = False


def _show(config: pytest.Config, key: str, text: str) -> None:
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or config.get_verbosity() < 0:
        return
    with _lock, _uncaptured(config):
        if getattr(tr, "isatty", False):
            width = _width(tr)
            tr.write("\r" + (text if len(text) <= width else text[: width - 1] + "…").ljust(width))
            _status_shown[0] = True
        elif time.monotonic() - _last_plain_line.get(key, 0.0) >= PLAIN_INTERVAL_SECONDS:
            _last_plain_line[key] = time.monotonic()
            tr.ensure_newline()
            tr.write_line(text)


# -- xdist: the workers' status lines, shown by the controller -------------------------------------------

def _relay_path(config: pytest.Config) -> Path | None:
    workerinput = getattr(config, "workerinput", None)
    path = workerinput.get("sglworker_progress") if isinstance(workerinput, dict) else None
    return Path(path) if path else None


def _append(path: Path, entry: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


class ProgressRelay:
    """On the xdist controller: follows the file the workers append their status lines to, and shows each
    worker's latest (``[gw1] ...``) every few seconds while it waits, as the controller's own lines."""

    def __init__(self, session: SglSession, path: Path) -> None:
        self.session = session
        self.path = path
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sglworker-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        offset = 0
        while not self.stop.wait(0.5):
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            offset += end
            for line in data[:end].splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("done") or "text" not in entry:
                    continue
                key = f"{entry.get('worker')}:{entry.get('key')}"
                text = entry["text"].replace("[sglworker] ", f"[sglworker] [{entry.get('worker')}] ", 1)
                config = self.session.config
                tr = config.pluginmanager.get_plugin("terminalreporter")
                if tr is None or config.get_verbosity() < 0:
                    continue
                with _lock:
                    if time.monotonic() - _last_plain_line.get(key, 0.0) >= PLAIN_INTERVAL_SECONDS / 6:
                        _last_plain_line[key] = time.monotonic()
                        tr.ensure_newline()
                        tr.write_line(text)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        with contextlib.suppress(OSError):
            self.path.unlink()


def worker_section(instance: ModelInstance, tail: int) -> tuple[str, str]:
    """The report section a failed test gets for each worker it used: its log path and tail, or, for a
    worker that died during the test, the full failure (diagnosis included)."""
    role = "" if instance.role == "worker" else f" {instance.role}"
    title = f"sglang worker {instance.spec.name}{role} {instance.host}:{instance.port}"
    if getattr(instance, "attached", False):
        state = "answers its health check" if instance.responds() else "does NOT answer its health check"
        return f"{title} (attached)", f"{instance.describe()} {state} now\n{instance.log_tail(tail)}"
    if instance.is_alive() or instance.stopped:
        return title, f"log: {instance.log_path}\nlast {tail} lines:\n{instance.log_tail(tail)}"
    from ..resources.processes import signal_name

    return (f"{title} exited with {signal_name(instance.returncode)} during the test",
            instance.failure_message("exited during the test", lines=tail))


class SglReporter:
    """The plugin's terminal output as hooks: header and summary."""

    def __init__(self, session: SglSession) -> None:
        self.session = session

    def pytest_report_header(self, config: pytest.Config) -> list[str] | None:
        s = self.session.settings
        if not s.models and all(src == "default" for src in s.sources.values() if not src.startswith("ini sgl_models")):
            return None  # a run that does not use the plugin prints nothing
        models = ", ".join(s.models or tuple(s.worker_urls)) or "none selected"
        launcher = " ".join(s.launcher) if s.launcher else ("simulated engine" if s.engine == "sim" else
                                                             f"{sys.executable} -m sglang.launch_server")
        lines = [f"sglworker: models: {models}; engine: {s.engine} ({launcher}); gpus: "
                 + (f"leased by the {s.cluster.describe()}" if s.cluster is not None else s.gpus or "auto (NVML)"),
                 f"sglworker: worker flags {self.session.flag_check}"]
        if s.worker_urls:
            attached = ", ".join(str(url) for urls in s.worker_urls.values() for url in urls)
            lines.append(f"sglworker: attached workers (never launched, leased or stopped): {attached}")
        if s.shard is not None:
            basis = f"balanced by {s.sources.get('shard-report')}" if s.shard_report else "balanced by test count"
            lines.append(f"sglworker: shard {s.shard} ({basis}; each worker configuration's tests on one shard)")
        return lines

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if is_xdist_worker(config):
            return
        # Nothing is imported for a run that launched no worker: the figures come only from a started pool
        # or from xdist workers that launched some.
        if self.session.pool_if_started is None and not self.session.worker_stats:
            return
        stats = self.session.collected_stats()
        if not stats or config.get_verbosity() < -1:
            return
        import statistics

        terminalreporter.write_sep("-", "sglang workers")
        for st in stats.values():
            times = st.startup_seconds
            span = "-" if not times else f"{min(times):.1f}/{statistics.median(times):.1f}/{max(times):.1f} s"
            kv = ""
            if st.kv_tokens_actual is not None:
                kv = f", KV #tokens {st.kv_tokens_actual}"
                if st.kv_tokens_predicted == st.kv_tokens_actual:
                    kv += " (as predicted)"
                elif st.kv_tokens_predicted is not None:
                    # The ledger and the engine disagree about this card: a finding, not noise.
                    off = (st.kv_tokens_actual - st.kv_tokens_predicted) / max(st.kv_tokens_predicted, 1)
                    kv += f" (MISMATCH: the ledger predicted {st.kv_tokens_predicted}, {off:+.1%})"
            stops = f", {st.stops} stopped" if st.stops else ""
            stops += f", {st.failed_tests} failed test(s)" if st.failed_tests else ""
            terminalreporter.write_line(
                f"{st.label}: {st.launches} launched, {st.reuses} reused, startup min/median/max {span}, "
                f"lease wait {st.lease_wait_seconds:.1f} s, GPU-seconds {st.gpu_seconds:.1f}, "
                f"{st.failures} failed to start, {st.deaths} died{stops}{kv}"
            )
            for log in st.failed_logs:
                terminalreporter.write_line(f"    log kept: {log}")
            if self.session.settings.keep_logs:
                for log in st.kept_logs:
                    terminalreporter.write_line(f"    log kept (--sgl-keep-logs): {log}")
        if any(st.failed_logs or st.kept_logs for st in stats.values()):
            terminalreporter.write_line(f"sglworker: worker logs of this run in {self.session.log_dir} "
                                        f"(retention policy {self.session.settings.log_policy})")


# --------------------------------------------------------------------------------------------------------
# --sgl-list-models
# --------------------------------------------------------------------------------------------------------


def _ledger_gpu(settings: Settings) -> tuple[str, int, int | None]:
    """The GPU the ledger of --sgl-list-models is computed for: a named card, a declared inventory, the
    first visible NVML GPU, or an H100 80 GB by default. Returns (label, total MiB, free MiB or None)."""
    from ..engine.ledger import gpu_card_mib

    if settings.card:
        return settings.card, gpu_card_mib(settings.card), None
    try:
        from ..resources.gpus import load_inventory, parse_gpus_option

        selection = parse_gpus_option(settings.gpus or "")
        if selection.kind == "sim":
            total = selection.sim_total_mib
            return f"declared {settings.gpus} ({total} MiB)", total, None
        inventory = load_inventory(selection, os.environ)
        try:
            gpus = inventory.snapshot()
        finally:
            inventory.close()
        if gpus:
            gpu = gpus[0]
            return f"GPU {gpu.index} {gpu.name} ({gpu.total_mib} MiB, {gpu.free_mib} free)", gpu.total_mib, gpu.free_mib
    except (SglWorkerError, ValueError):
        pass
    return "H100-80G (no GPU visible; choose another with --sgl-card)", gpu_card_mib("H100-80G"), None


def render_registry(registry: SpecRegistry, settings: Settings, *, verbose: bool = False) -> str:
    """``--sgl-list-models``: a compact table (name, model, GPUs x memory, features, budget, the ledger's verdict
    on the chosen card), then, with ``-v``, every spec in full with its memory ledger."""
    from ..engine.ledger import ledger_for_spec

    label, total, free = _ledger_gpu(settings)
    rows = [("name", "model", "GPUs x memory", "features", "budget", "ledger verdict")]
    ledgers = {}
    for spec in registry:
        problems = budget.check_spec(spec)
        ledger = ledger_for_spec(spec, total, gpu_free_mib=free)
        ledgers[spec.name] = ledger
        verdict = "unknown model dims" if ledger is None else f"{ledger.verdict.value} (KV {ledger.kv_tokens:,} tokens)"
        rows.append((spec.name, spec.model, f"{spec.tp} x {spec.memory_gb:g} GB",
                     ", ".join(sorted(spec.features)) or "-", "ok" if not problems else "VIOLATED", verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"pytest-sglworker model registry (memory ledger for: {label}):"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if not verbose:
        lines.append("(-v: every spec in full, with its memory ledger)")
        return "\n".join(lines)
    lines += ["", "memory ledger for: " + label]
    for spec in registry:
        problems = budget.check_spec(spec)
        local = spec.resolve_model_path()
        lines.append(f"  {spec.name}")
        lines.append(f"    model:       {spec.model}" + (f" -> {local} (local copy)" if local != spec.model else ""))
        lines.append(f"    memory:      {spec.memory_gb:g} GB   tp: {spec.tp}")
        lines.append(f"    features:    {', '.join(sorted(spec.features)) or '-'}")
        lines.append(f"    worker_args: {' '.join(spec.worker_args)}")
        lines.append("    budget:      " + ("ok" if not problems else "VIOLATED: " + "; ".join(map(str, problems))))
        if spec.description:
            lines.append(f"    about:       {spec.description}")
        ledger = ledgers[spec.name]
        if ledger is None:
            lines.append("    ledger:      unknown model dimensions (no local config.json)")
        else:
            lines.append("    ledger:      " + ledger.render().replace("\n", "\n                 "))
    return "\n".join(lines)
