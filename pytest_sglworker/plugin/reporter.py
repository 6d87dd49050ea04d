"""What the plugin shows a person around the run: the report header, the terminal summary of the workers, and the
``--sgl-list-models`` registry. Registered as a plugin object of its own, beside the session object; the lines
written during the run are :mod:`.terminal`'s, the failure sections of a test :mod:`.run_hooks`'.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import pytest

from ..engine import budget
from ..errors import SglWorkerError
from .keys import is_xdist_worker

if TYPE_CHECKING:
    from ..engine.specs import SpecRegistry
    from .options import Settings
    from .session import SglSession

__all__ = ["SglReporter", "duration", "render_registry", "render_warm", "warm_lines"]


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
        if s.keep_warm is not None:
            lines.append(f"sglworker: keep warm ({s.sources.get('keep-warm')}): the workers still healthy at the end "
                         f"stay running for {duration(s.keep_warm)} after their last use (pytest --sgl-warm list|stop)")
        elif s.keep_warm_note:
            lines.append(f"sglworker: {s.keep_warm_note}")
        return lines

    def pytest_report_collectionfinish(self, config: pytest.Config, items: list[pytest.Item]) -> str | None:
        """After collection, what the header could not know: how many workers sglang's unittest files will launch
        through the drop-in (``pytest_sglworker.compat``: a server per test class with a setUpClass, in the files
        that import its ``popen_launch_server``)."""
        if is_xdist_worker(config) or "pytest_sglworker.compat" not in sys.modules:
            return None  # no test module imported the drop-in (a name in sys.modules: no import of it here)
        classes = {(item.path, getattr(item, "cls", None)) for item in items
                   if _sets_up_class(getattr(item, "cls", None)) and _compat_module(getattr(item, "module", None))}
        if not classes:
            return None
        files = len({path for path, _ in classes})
        n = len(classes)
        return (f"sglworker: pytest_sglworker.compat starts the servers of {n} test class{'es' if n > 1 else ''} in "
                f"{files} file{'s' if files > 1 else ''} (popen_launch_server in setUpClass): about {n} "
                f"worker{'s' if n > 1 else ''}, each one's flags checked by sglang's parser as it launches")

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if is_xdist_worker(config):
            return
        # Nothing is imported for a run that launched no worker: the figures come only from a started source
        # or from xdist workers that launched some.
        if self.session.source_if_started is None and not self.session.worker_stats:
            return
        stats = self.session.collected_stats()
        keep_logs = self.session.settings.keep_logs
        kept = ""
        if any(st.failed_logs or (keep_logs and st.kept_logs) for st in stats.values()):
            kept = f" ({_kept_for(self.session.logs_kept_until())})"
        if not stats or config.get_verbosity() < -1:
            return
        import statistics

        terminalreporter.write_sep("-", "sglang workers")
        adoptions: dict[str, int] = {}
        taken: dict[str, int] = {}  # groups another xdist worker of this run started ahead
        for event in self.session.collected_warm().get("adopted", []):
            if not event.get("run"):
                adoptions[event["config"]] = adoptions.get(event["config"], 0) + 1
            elif event.get("adopter_pid") != event["kept_by_pid"]:
                taken[event["config"]] = taken.get(event["config"], 0) + 1
        for key, st in stats.items():
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
            adopted = adoptions.get(key, 0)
            stops = f", {adopted} adopted warm" if adopted else ""
            stops += f", {taken[key]} taken over from another xdist worker" if taken.get(key) else ""
            stops += f", {st.interrupted} interrupted while starting" if st.interrupted else ""
            stops += f", {st.stops} stopped" if st.stops else ""
            stops += f", {st.resets} set back after runtime faults" if st.resets else ""
            stops += f", {st.not_reset} not reused (runtime faults not set back)" if st.not_reset else ""
            stops += f", {st.failed_tests} failed test(s)" if st.failed_tests else ""
            terminalreporter.write_line(
                f"{st.label}: {st.launches} launched, {st.reuses} reused, startup min/median/max {span}, "
                f"lease wait {st.lease_wait_seconds:.1f} s, GPU-seconds {st.gpu_seconds:.1f}, "
                f"{st.failures} failed to start, {st.deaths} died{stops}{kv}"
            )
            for log in st.failed_logs:
                terminalreporter.write_line(f"    log kept: {log}{kept}")
            if keep_logs:
                for log in st.kept_logs:
                    terminalreporter.write_line(f"    log kept (--sgl-keep-logs): {log}{kept}")
        if any(st.failed_logs or st.kept_logs for st in stats.values()):
            terminalreporter.write_line(f"sglworker: worker logs of this run in {self.session.log_dir} "
                                        f"(retention policy {self.session.settings.log_policy})")
        for line in warm_lines(self.session.collected_warm()):
            terminalreporter.write_line(line)


def _kept_for(until: float) -> str:
    """How long a kept log stays: ``kept 7 days, until 2026-12-13 05:30 UTC``."""
    import time

    from ..resources.retention import KEEP_DAYS

    return f"kept {KEEP_DAYS} days, until {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(until))}"


def _compat_module(module: Any) -> bool:
    """Whether a test module starts its servers with the drop-in's ``popen_launch_server`` (told by the function
    it imported, not by importing the drop-in: it sits above this layer)."""
    launch = getattr(module, "popen_launch_server", None)
    return getattr(launch, "__module__", "").startswith("pytest_sglworker.compat")


def _sets_up_class(cls: Any) -> bool:
    """Whether a test class has a ``setUpClass`` of its own (or of a base of the suite's): where sglang's unittest
    files start their servers."""
    import unittest

    own = getattr(getattr(cls, "setUpClass", None), "__func__", None)
    return own is not None and own is not unittest.TestCase.setUpClass.__func__  # type: ignore[attr-defined]


def duration(seconds: float) -> str:
    """``15m``, ``90s``, ``1h30m``: a TTL as a person writes it."""
    whole = round(seconds)
    if whole < 60 or whole % 60:
        return f"{seconds:g}s" if whole < 60 else f"{whole // 60}m{whole % 60:02d}s"
    minutes = whole // 60
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 and minutes % 60 else (
        f"{minutes // 60}h" if minutes >= 60 else f"{minutes}m")


def _clock(stamp: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(stamp))


def warm_lines(events: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The summary's lines about warm workers: adopted (with where their log is), refused (and why), kept warm
    (until when, and how to end them), and, under ``--sgl-keep-warm``, each configuration not kept and why."""
    lines = []
    for e in events.get("adopted", []):
        if e.get("run"):  # handed over within this run: worth a line only when another xdist worker had started it
            if e.get("adopter_pid") != e["kept_by_pid"]:
                lines.append(f"sglworker: adopted {e['label']} (pid {', '.join(map(str, e['pids']))}, port "
                             f"{', '.join(map(str, e['ports']))}), started ahead in this run by pytest pid "
                             f"{e['kept_by_pid']}; its log continues in {', '.join(e['logs'])}")
            continue
        lines.append(f"sglworker: adopted warm {e['label']} (pid {', '.join(map(str, e['pids']))}, port "
                     f"{', '.join(map(str, e['ports']))}; kept warm since {_clock(e['kept_since'])} by pytest pid "
                     f"{e['kept_by_pid']}); its log continues in {', '.join(e['logs'])}")
    for e in events.get("refused", []):
        what = "ended it" if e.get("ended") else "left it to that session"
        lines.append(f"sglworker: warm {e['label']} (pid {', '.join(map(str, e['pids']))}) not adopted: {e['why']}; "
                     f"{what}")
    kept = events.get("kept", [])
    for e in kept:
        gpus = f", GPU {','.join(map(str, e['gpus']))}" if e["gpus"] else ""
        lines.append(f"sglworker: kept warm until {_clock(e['until'])} ({duration(e['ttl'])} after its last use): "
                     f"{e['label']} (pid {', '.join(map(str, e['pids']))}, port {', '.join(map(str, e['ports']))}"
                     f"{gpus}; keeper pid {e['keeper_pid']}); log {', '.join(e['logs'])}")
    if kept:
        lines.append("sglworker: the next run of an unchanged configuration adopts them; pytest --sgl-warm list shows "
                     "them, pytest --sgl-warm stop ends them")
    for e in events.get("not_kept", []):
        lines.append(f"sglworker: not kept warm: {e['label']}: {e['why']}")
    from ..resources.shown import shown

    return [shown(line) for line in lines]  # labels, reasons and log paths read from warm records


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


# --------------------------------------------------------------------------------------------------------
# --sgl-warm list|stop
# --------------------------------------------------------------------------------------------------------


def render_warm(lock_dir: Any, action: str) -> tuple[str, int]:
    """``--sgl-warm list``: every warm group of the lock directory, its state, its processes, its expiry and its
    log; ``--sgl-warm stop``: end every one no session uses right now. Returns the text and the exit status (1
    when a group could not be stopped because a session uses it)."""
    import time

    from ..resources.warm import stop_warm
    from ..resources.warm_records import keeper_alive, warm_records

    lines = [f"pytest-sglworker warm workers in {lock_dir}:"]
    if action == "stop":
        done = stop_warm(lock_dir)
        lines += ([f"  ended {text}" for text in done.ended] + [f"  removed {text}" for text in done.removed]
                  + [f"  left {text}" for text in done.left] + [f"  {text}" for text in done.others])
        if done.interrupted is not None:
            import signal

            lines.append(f"  interrupted ({signal.Signals(done.interrupted).name}) after the group it was ending had "
                         "ended; the rest are left as they were (run it again to end them)")
            return _shown_lines(lines), int(pytest.ExitCode.INTERRUPTED)
        if not (done.ended or done.removed or done.left or done.others):
            lines.append("  none")
        return _shown_lines(lines), 1 if done.left else 0
    now = time.time()
    entries = warm_records(lock_dir)
    for entry in entries:
        record = entry.record
        if entry.owner is not None and not entry.ours:
            lines.append(f"  {entry.path.name}: belongs to uid {entry.owner} (another user); its GPUs and ports are "
                         "busy while its keeper holds them, nothing else")
            continue
        if record is None:
            lines.append(f"  {entry.path.name}: untrusted ({entry.problem}); ignored (pytest --sgl-warm stop removes "
                         "it if it is yours)")
            continue
        if record.state == "adopted" and record.adopter is not None:
            state = f"in use by pytest pid {record.adopter.pid} ({record.adopter.holder})"
        elif record.state == "warm":
            remaining = max(record.expires_at - now, 0.0)
            state = (f"warm, ends at {_clock(record.expires_at)} (in {remaining:.0f} s, {duration(record.ttl)} "
                     f"after its last use at {_clock(record.last_used)})")
        else:
            state = {"handover": "being handed over", "stop": "ending"}.get(record.state, record.state)
        keeper = record.keeper
        alive = "" if keeper is None or keeper_alive(record) else " (gone: the next session's janitor ends it)"
        lines.append(f"  {record.label}: {state}; adopted {record.uses} time(s)")
        lines.append(f"      keeper pid {keeper.pid if keeper else '-'}{alive}; GPU(s) "
                     f"{','.join(map(str, record.gpus)) or '-'} ({record.namespace})")
        for m in record.members:
            role = "" if m.role == "worker" else f"{m.role} {m.index}: "
            lines.append(f"      {role}pid {m.pid}, port {m.port}, log {m.log}")
    if not entries:
        lines.append("  none")
    else:
        lines.append("(pytest --sgl-warm stop ends those no session uses)")
    return _shown_lines(lines), 0


def _shown_lines(lines: list[str]) -> str:
    """The lines, each one line whatever the names and fields read from the lock directory hold (escaped, see
    :func:`~pytest_sglworker.resources.shown.shown`: another user's file name cannot clear the screen or forge a
    line)."""
    from ..resources.shown import shown

    return "\n".join(shown(line) for line in lines)
