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

__all__ = ["SglReporter", "render_registry"]


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
        # Nothing is imported for a run that launched no worker: the figures come only from a started source
        # or from xdist workers that launched some.
        if self.session.source_if_started is None and not self.session.worker_stats:
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
            stops += f", {st.resets} set back after runtime faults" if st.resets else ""
            stops += f", {st.not_reset} not reused (runtime faults not set back)" if st.not_reset else ""
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
