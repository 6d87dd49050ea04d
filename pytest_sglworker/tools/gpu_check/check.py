"""``sglworker gpu-check``: the first GPU run of pytest-sglworker, as one command. Its documentation: the
repository's docs/GPU_CHECK.md (``--help`` gives its address).

A program shipped in the package and run by path (``sglworker gpu-check`` runs it with its own Python), not a
module of it: its pieces (the holder, the inner sessions, the fake ``pynvml``) are scripts and folders that
other processes run or put on their ``PYTHONPATH``.

Runs real pytest sessions of the plugin it belongs to (the folder that holds this ``pytest_sglworker`` first
on ``PYTHONPATH``; ``-p pytest_sglworker.plugin`` only when the entry point is not installed) whose engine is
the GPU memory holder (``holder.py``: real ``cuMemAlloc`` through libcuda, no torch), samples NVML every 20 ms
meanwhile, and judges what it saw: the NVML inventory, that a worker sees exactly the GPU it leased, lease
exclusivity under ``-n 4`` on one GPU, the memory-release wait, a SIGKILLed holder, the ledger's free-memory
input, torch's view and (when sglang is installed) one real launch of a tiny model. It prints one table and writes
``$OUT/gpu-check.json`` (``--out``, else ``$OUT``, else ``./gpu-check-out``).

``--dry-run``: the same sessions against a fake NVML (``fake_nvml/pynvml.py`` first on ``PYTHONPATH``) and
a fake CUDA driver, sharing one fake-GPU state (``fakegpu.py``) in which the holders' allocations show up;
no libcuda, no GPU. CI runs it (tests/acceptance/test_gpu_check.py).

Every wait has a deadline: each inner session runs under a timeout (then SIGINT, then SIGKILL of its own
process group), the whole run under ``--budget`` seconds. Nothing is left running: the last check looks for
every process carrying this run's marker and ends (by pid) and reports any it finds. Exit code 0 when no
check failed, 1 when one did, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import (
    CHECKS,
    FAKE_DIR,
    HERE,
    HOLDER,
    INNER,
    MAX_VISIBILITY_GPUS,
    PLUGIN_ROOT,
    RUN_ENV,
    SAMPLE_INTERVAL_S,
    SCHEMA,
    TOLERANCE_MIB,
    Row,
    Sampler,
    Session,
    _card_for,
    _holder_intervals,
    _lease_intervals,
    _max_overlap,
    _read_json,
    _signed,
    clip,
    first_error,
    first_holder_error,
    parse_junit,
)
from stack import StackChecks

sys.path.insert(0, str(HERE))
# The plugin this check belongs to (it need not be installed): the driver imports it from there too.
sys.path.insert(1, str(PLUGIN_ROOT))

# ------------------------------------------------------------------------------------------------ the run


class Check(StackChecks):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = bool(args.dry_run)
        self.started = time.time()
        self.deadline: float = time.monotonic() + float(args.budget)
        self.run_id = uuid.uuid4().hex[:12]
        self.out = Path(args.out or os.environ.get("OUT") or "gpu-check-out").resolve()
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.rows: list[Row] = []
        self.python = sys.executable
        self.locks = self.work / "locks"
        self.logs = self.work / "logs"
        self.results = self.work / "results"
        self.events_path = self.work / "events.jsonl"
        self.fake_state = self.work / "fake-gpu"
        self.sessions: list[Session] = []
        self.nvml: Any = None
        self.sampler: Sampler | None = None
        self.gpus: list[int] = []  # NVML indices the plugin may use (CUDA_VISIBLE_DEVICES of this process)
        self.primary = 0
        self.baseline: dict[int, dict[str, Any]] = {}
        self.facts: dict[str, Any] = {}
        self.plugin_args: list[str] = []
        self.only = {c.strip() for c in (args.only or "").split(",") if c.strip()}

    # -- helpers

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wanted(self, check: str) -> bool:
        return not self.only or check in self.only or check in ("environment", "leftovers")

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        mark = {"pass": "ok", "fail": "FAIL", "warn": "warn", "skip": "skip", "info": "info"}[row.status]
        print(f"  [{mark:>4}] {row.check}: {row.detail}", flush=True)
        return row

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not ((k.startswith("SGLWORKER_") and k != "SGLWORKER_TEST_MARK") or k.startswith("PYTEST_")
                       or k.startswith("GPU_CHECK_"))}
        paths = ([str(FAKE_DIR)] if self.dry else []) + [str(PLUGIN_ROOT)]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env[RUN_ENV] = self.run_id
        env["GPU_CHECK_EVENTS"] = str(self.events_path)
        env["GPU_CHECK_RESULTS"] = str(self.results)
        env["GPU_CHECK_LOCK_DIR"] = str(self.locks)
        env["GPU_CHECK_MAX_LIFETIME_S"] = str(max(60, int(self.args.budget) + 60))
        if self.dry:
            env["GPU_CHECK_FAKE_GPU"] = str(self.fake_state)
            if self.args.fake_fault:
                env["GPU_CHECK_FAKE_FAULT"] = self.args.fake_fault
        env.update(extra)
        return env

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        out = []
        for line in self.events_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def result(self, name: str) -> dict[str, Any] | None:
        path = self.results / f"{name}.json"
        try:
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
            return data
        except (OSError, ValueError):
            return None

    def run_cmd(self, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env,
                                  stdin=subprocess.DEVNULL, errors="replace")
        except subprocess.TimeoutExpired:
            return None, f"{argv[0]} ran past {timeout:g} s"
        except OSError as exc:
            return None, f"cannot run {argv[0]}: {exc}"
        return done.returncode, done.stdout + done.stderr

    def session(self, name: str, tests: Sequence[str], options: Sequence[str] = (), *, timeout: float,
                env_extra: dict[str, str] | None = None, launcher: Sequence[str] | None = None) -> Session | str:
        """One inner pytest session; a string when there is no time left for it."""
        limit = min(timeout, self.remaining() - 20)
        if limit < 15:
            return f"skipped: out of time (budget {self.args.budget:g} s)"
        junit = self.work / f"junit-{name}.xml"
        output_path = self.logs.parent / f"session-{name}.txt"
        launch = list(launcher) if launcher is not None else [self.python, str(HOLDER)]
        cmd = [self.python, "-m", "pytest", "-c", str(INNER / "pytest.ini"), "--rootdir", str(INNER),
               *self.plugin_args, "-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-rA",
               f"--junitxml={junit}", "--sgl-engine", "real", "--sgl-launcher", shlex.join(launch),
               "--sgl-lock-dir", str(self.locks), "--sgl-log-dir", str(self.logs), "--sgl-keep-logs",
               "--sgl-startup-timeout", str(int(min(60, max(10, limit - 30)))),
               "--sgl-lease-timeout", str(int(max(30, limit - 15))),
               "--sgl-reorder", "off", "--sgl-report", str(self.work / f"report-{name}.json")]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd += ["--timeout", str(int(max(30, limit - 10)))]
        cmd += [*options, *[str(INNER / t) for t in tests]]
        env = self.env(**(env_extra or {}))
        started = time.time()
        t0 = time.monotonic()
        timed_out = False
        with open(output_path, "wb") as out:
            out.write(("$ " + shlex.join(cmd) + "\n").encode())
            out.flush()
            proc = subprocess.Popen(cmd, cwd=str(INNER), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                self._stop_group(proc)
            except BaseException:  # the check itself interrupted: its session must not outlive it
                self._stop_group(proc)
                raise
        text = output_path.read_text(encoding="utf-8", errors="replace")
        result = Session(name, proc.returncode, timed_out, time.monotonic() - t0, parse_junit(junit), text,
                         started, time.time())
        self.sessions.append(result)
        return result

    @staticmethod
    def _stop_group(proc: subprocess.Popen[bytes]) -> None:
        """The session's own process group (it leads it): SIGINT, so that pytest tears its workers down;
        then SIGKILL."""
        for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def step(self, check: str, fn: Callable[[], Row | None]) -> None:
        if not self.wanted(check):
            return
        t0 = time.monotonic()
        try:
            row = fn()
        except Exception as exc:  # one broken check must not hide the others
            import traceback

            row = Row(check, "fail", f"internal error of the check: {exc!r}",
                      data={"traceback": traceback.format_exc()[-4000:]})
        if row is not None:
            row.seconds = round(time.monotonic() - t0, 2)
            self.add(row)

    def needs_gpu(self, check: str, *, cuda: bool = True) -> Row | None:
        if self.nvml is None or not self.gpus:
            return Row(check, "skip", "skipped: no NVML GPU to check (see environment)")
        if cuda and self.facts.get("cuda_hung"):
            return Row(check, "skip", "skipped: CUDA hung in the probe (see environment); a holder would too")
        return None

    # -- steps

    def run(self) -> int:
        print(f"gpu-check ({'dry run: fake NVML, fake CUDA' if self.dry else 'real GPU'}), run {self.run_id}, "
              f"budget {self.args.budget:g} s, results in {self.out}", flush=True)
        for d in (self.locks, self.logs, self.results):
            d.mkdir(parents=True, exist_ok=True)
        if self.dry:
            import fakegpu

            fakegpu.write_state(self.fake_state, count=self.args.fake_gpus)
        try:
            self.step("environment", self.check_environment)
            self.step("nvml_inventory", self.check_inventory)
            self.step("lease_visibility", self.check_visibility)
            self.step("nvml_process_ids", self.check_process_ids)
            self.step("ledger_input", self.check_ledger)
            self.step("lease_exclusivity", self.check_exclusivity)
            self.step("release_wait", self.check_release)
            self.step("sigkill_teardown", self.check_sigkill)
            self.step("torch_view", self.check_torch)
            self.step("sglang_launch", self.check_sglang)
        except KeyboardInterrupt:
            self.add(Row("interrupted", "fail", "the check was interrupted; the rows above are what it saw"))
            raise
        finally:
            self.step("leftovers", self.check_leftovers)
            if self.sampler is not None:
                self.sampler.stop()
            if self.nvml is not None:
                with contextlib.suppress(Exception):
                    self.nvml.nvmlShutdown()
            self.write_outputs()
        return 1 if any(r.status == "fail" for r in self.rows) else 0

    def check_inventory(self) -> Row | None:
        skip = self.needs_gpu("nvml_inventory", cuda=False)
        if skip:
            return skip
        tests = ["test_inventory.py"]
        if self.wanted("lease_visibility") and not self.facts.get("cuda_hung"):
            tests.append("test_visibility.py")
        session = self.session(f"gpu{self.primary}", tests, ["--sgl-gpus", str(self.primary)], timeout=120,
                               env_extra={"GPU_CHECK_GPUS": str(self.primary),
                                          "GPU_CHECK_PROBE": str(self.work / "probe.json"),
                                          "GPU_CHECK_SMI": json.dumps(self.facts.get("smi"))})
        self.facts["first_session"] = session
        if isinstance(session, str):
            return Row("nvml_inventory", "skip", session)
        data = self.result("inventory") or {}
        outcome = session.outcomes.get("test_inventory", ("missing", ""))
        if outcome[0] != "passed":
            detail = "; ".join(data.get("problems", [])) or session.problem() or f"test_inventory {outcome[0]}"
            return Row("nvml_inventory", "fail", clip(detail, 600), data=data)
        gpus = data.get("plugin_inventory", [])
        smi = ("matches nvidia-smi" if data.get("nvidia_smi")
               else f"no nvidia-smi comparison ({data.get('nvidia_smi_note')})")
        listing = "; ".join(f"{g['index']}: {g['name']}, {g['total_mib']} MiB total, {g['free_mib']} free, {g['uuid']}"
                            for g in gpus)
        return Row("nvml_inventory", "pass",
                   f"{listing}; NVML index order = PCI bus order = CUDA order under CUDA_DEVICE_ORDER=PCI_BUS_ID; "
                   f"{smi}",
                   data=data)

    def check_visibility(self) -> Row | None:
        skip = self.needs_gpu("lease_visibility")
        if skip:
            return skip
        details, problems, data = [], [], {}
        for index in self.gpus[:MAX_VISIBILITY_GPUS]:
            if index == self.primary and self.wanted("nvml_inventory") and "first_session" in self.facts:
                session = self.facts.get("first_session")
            else:
                session = self.session(f"gpu{index}", ["test_visibility.py"], ["--sgl-gpus", str(index)],
                                       timeout=90, env_extra={"GPU_CHECK_GPUS": str(index)})
            if isinstance(session, str) or session is None:
                problems.append(f"GPU {index}: {session or 'not run'}")
                continue
            result = self.result(f"visibility-{index}")
            data[str(index)] = result
            outcome = session.outcomes.get("test_visibility", ("missing", ""))
            if outcome[0] != "passed" or result is None:
                why = "; ".join((result or {}).get("problems", [])) or session.problem() or outcome[0]
                problems.append(f"GPU {index}: {why}")
                continue
            dev = result["holder"]["device"]
            details.append(f"GPU {index} -> worker's CUDA device 0 = PCI {dev['pci_bus_id']} {dev['uuid']} (1 device, "
                           f"{result['holder']['context_method']}; used {result['free_drop_mib'][str(index)]} MiB for "
                           f"{result['holder']['allocated_mib']} MiB held)")
        self.facts["visibility"] = data
        if len(self.gpus) > MAX_VISIBILITY_GPUS:
            details.append(f"first {MAX_VISIBILITY_GPUS} of {len(self.gpus)} GPUs checked")
        if problems and not details and all("skipped: out of time" in p for p in problems):
            return Row("lease_visibility", "skip", clip("; ".join(problems), 600), data=data)
        if problems:
            return Row("lease_visibility", "fail", clip("; ".join(problems), 600), data=data)
        return Row("lease_visibility", "pass", "; ".join(details), data=data)

    def check_process_ids(self) -> Row | None:
        skip = self.needs_gpu("nvml_process_ids")
        if skip:
            return skip
        results = {k: v for k, v in (self.facts.get("visibility") or {}).items() if v}
        if not results:
            return Row("nvml_process_ids", "skip", "skipped: no worker ran (see lease_visibility)")
        bad, notes = [], []
        for index, r in results.items():
            listed = r.get("nvml_pids", {})
            if not r.get("nvml_processes_supported"):
                bad.append(f"GPU {index}: NVML cannot list compute processes here")
            elif r.get("holder_listed_on") != [int(index)]:
                others = listed.get(str(index), [])
                bad.append(f"GPU {index}: NVML lists {others or 'no process'} there, not the worker's pid "
                           f"{r['worker_pid']} (listed on {r.get('holder_listed_on') or 'no GPU'}; another PID "
                           "namespace?)")
            else:
                used = r.get("nvml_used_by_holder_mib")
                notes.append(f"GPU {index}: worker pid {r['worker_pid']} listed there only"
                             + (f", using {used} MiB for {r['holder']['allocated_mib']} MiB held" if used else ""))
        if bad:
            return Row("nvml_process_ids", "warn",
                       clip("; ".join(bad), 500) + ": Lease.release cannot see a worker still on the GPU, only its "
                       "memory", data=results)
        return Row("nvml_process_ids", "pass", "; ".join(notes), data=results)

    def check_ledger(self) -> Row | None:
        skip = self.needs_gpu("ledger_input", cuda=False)
        if skip:
            return skip
        # -vv: the full ledger (the inner sessions run with -q, and --sgl-list-models shows it from -v up)
        session = self.session("list-models", [], ["--sgl-list-models", "-vv", "--sgl-gpus", str(self.primary)],
                               timeout=60)
        if isinstance(session, str):
            return Row("ledger_input", "skip", session)
        at = time.time()
        header = re.search(r"memory ledger for: GPU (\d+) (.*?) \((\d+) MiB, (\d+) free\)", session.output)
        qwen = re.search(r"  qwen3-0\.6b\n(?:.*\n)*?\s+ledger:\s+.* on (\d+) MiB GPU \(free (\d+)\)", session.output)
        data: dict[str, Any] = {"output_tail": session.output[-3000:]}
        if session.rc != 0 or header is None:
            return Row("ledger_input", "fail", "--sgl-list-models did not show the ledger for an NVML GPU: "
                       + (first_error(session.output) or clip(session.output[-300:])), data=data)
        base = self.baseline[self.primary]
        state = self.sampler.state_at(self.primary, at) if self.sampler else None
        nvml_free = state[0] if state else base["free_mib"]
        total, free = int(header.group(3)), int(header.group(4))
        data.update({"ledger_total_mib": total, "ledger_free_mib": free, "nvml_total_mib": base["total_mib"],
                     "nvml_free_mib": nvml_free, "name": header.group(2)})
        problems, notes = [], []
        if total != base["total_mib"]:
            problems.append(f"ledger total {total} MiB != NVML total {base['total_mib']} MiB")
        if abs(free - nvml_free) > TOLERANCE_MIB:
            problems.append(f"ledger free {free} MiB != NVML free {nvml_free} MiB")
        if qwen is None:
            problems.append("no ledger line for qwen3-0.6b")
        elif (int(qwen.group(1)), int(qwen.group(2))) != (total, free):
            problems.append(f"qwen3-0.6b's ledger used {qwen.group(1)} MiB / free {qwen.group(2)}, the header "
                            f"{total} / {free}")
        from pytest_sglworker.engine.ledger import GPU_CARDS, ledger_for_spec
        from pytest_sglworker.engine.specs import BUILTIN_SPECS

        card = _card_for(header.group(2), total, GPU_CARDS)
        data["card"] = card
        if card is None:
            notes.append(f"no card table entry for {header.group(2)!r}")
        elif GPU_CARDS[card] != total:
            notes.append(f"card table says {card} = {GPU_CARDS[card]} MiB, NVML reports {total} MiB: update GPU_CARDS")
        else:
            notes.append(f"card table {card} = {GPU_CARDS[card]} MiB = NVML total")
        vis = (self.facts.get("visibility") or {}).get(str(self.primary)) or {}
        engine_free = vis.get("engine_view_free_mib")
        spec = next(s for s in BUILTIN_SPECS if s.name == "qwen3-0.6b")
        with_nvml = ledger_for_spec(spec, total, gpu_free_mib=free)
        line = f"ledger input: NVML free {free} of {total} MiB"
        if with_nvml is not None:
            line += f" (qwen3-0.6b KV pool {with_nvml.kv_tokens:,} tokens)"
        if engine_free is not None:
            with_engine = ledger_for_spec(spec, total, gpu_free_mib=int(engine_free))
            data["engine_view_free_mib"] = engine_free
            data["context_overhead_mib"] = vis.get("nvml_free_before_mib", free) - int(engine_free)
            line += (f"; an engine's own view after its CUDA context: {engine_free} MiB "
                     f"({int(engine_free) - vis.get('nvml_free_before_mib', free):+d} MiB)")
            if with_nvml is not None and with_engine is not None:
                data["kv_tokens"] = {"nvml_free": with_nvml.kv_tokens, "engine_free": with_engine.kv_tokens}
                line += f", {with_engine.kv_tokens - with_nvml.kv_tokens:+,} KV tokens"
        if problems:
            return Row("ledger_input", "fail", "; ".join(problems) + " | " + line, data=data)
        status = "warn" if card is not None and GPU_CARDS[card] != total else "pass"
        return Row("ledger_input", status, "; ".join([line, *notes]), data=data)

    def check_exclusivity(self) -> Row | None:
        skip = self.needs_gpu("lease_exclusivity")
        if skip:
            return skip
        if importlib.util.find_spec("xdist") is None:
            return Row("lease_exclusivity", "skip", "skipped: pytest-xdist is not installed")
        base = self.baseline[self.primary]
        need = 30 * 1024
        if base["free_mib"] < need:
            return Row("lease_exclusivity", "skip",
                       f"skipped: GPU {self.primary} has {base['free_mib']} MiB free, less than one 30 GiB spec")
        hold = "0.4" if self.dry else "1.0"
        session = self.session("exclusivity", ["test_exclusivity.py"],
                               ["-n", "4", "--dist", "load", "--sgl-gpus", str(self.primary)], timeout=180,
                               env_extra={"GPU_CHECK_GPUS": str(self.primary), "GPU_CHECK_HOLD_S": hold})
        if isinstance(session, str):
            return Row("lease_exclusivity", "skip", session)
        events = [e for e in self.events() if session.started <= e["t"] <= session.ended + 1]
        observer = [e["error"] for e in events if e.get("event") == "observer_error"]
        leases = _lease_intervals(events, self.primary)
        holders = _holder_intervals(events)
        overlap = _max_overlap([(a, b) for a, b, _ in leases])
        held = _max_overlap([(a, b) for a, b in holders.values()])
        short = [(e["free_mib"][0], e["memory_mib"]) for e in events if e.get("event") == "lease_acquired"
                 and e["free_mib"][0] < e["memory_mib"]]
        errors = [e["error"] for e in events if e.get("source") == "holder" and e.get("event") == "error"]
        window = self.sampler.window(self.primary, session.started, session.ended) if self.sampler else []
        min_free = min((f for _, f, _ in window), default=None)
        max_pids = max((len(set(p) & set(holders)) for _, _, p in window), default=0)
        ctx = (self.facts.get("visibility") or {}).get(str(self.primary), {}) or {}
        footprint = need + max(0, int(ctx.get("context_overhead_mib") or 512))
        fits = (base["free_mib"] - need) // footprint + 1
        report = _read_json(self.work / "report-exclusivity.json") or {}
        waits = sum(w.get("lease_wait_seconds", 0) for w in report.get("workers", {}).values())
        acq_free = [e["free_mib"][0] for e in events if e.get("event") == "lease_acquired"]
        data = {"leases": len(leases), "holders": len(holders), "max_concurrent_leases": overlap,
                "max_concurrent_holders": held, "max_holders_listed_by_nvml": max_pids, "min_nvml_free_mib": min_free,
                "memory_would_fit": fits, "lease_wait_seconds_total": round(waits, 2),
                "acquisition_free_mib_min": min(acq_free, default=None), "short_acquisitions": short,
                "holder_errors": errors, "observer_errors": observer, "outcomes": session.outcomes}
        problems = []
        if observer:
            problems.append(f"leases not observed: {observer[0]}")
        if not session.passed:
            problems.append(session.problem())
        if short:
            problems.append(f"a lease was granted with {short[0][0]} MiB free for a {short[0][1]} MiB spec")
        if errors:
            problems.append(f"holder error: {errors[0]}")
        if held > fits or (min_free is not None and min_free < 0):
            problems.append(f"{held} holders at once, but only {fits} fit in {base['free_mib']} MiB")
        if len(holders) < 6:
            problems.append(f"only {len(holders)} of 6 holders allocated")
        how = ("a lease is exclusive per GPU" if overlap == 1 else f"{overlap} leases shared the GPU by memory")
        detail = (f"6 holders of 30 GiB under -n 4 on GPU {self.primary}: {held} at once ({how}; memory would fit "
                  f"{fits}); lease waits {waits:.1f} s in all; every grant saw >= {min(acq_free, default=0)} MiB free; "
                  f"min NVML free {min_free} MiB; no over-commit")
        if problems:
            return Row("lease_exclusivity", "fail", clip("; ".join(p for p in problems if p), 600), data=data)
        return Row("lease_exclusivity", "pass", detail, data=data)

    def _teardown_session(self) -> Session | str:
        if "teardown" not in self.facts:
            base = self.baseline[self.primary]
            big = max(1, min(100, int(base["free_mib"] * 0.7 / 1024)))
            self.facts["big_gb"] = big
            self.facts["teardown"] = self.session(
                "teardown", ["test_teardown.py"], ["--sgl-gpus", str(self.primary)], timeout=200,
                env_extra={"GPU_CHECK_GPUS": str(self.primary), "GPU_CHECK_BIG_GB": str(big),
                           "GPU_CHECK_HOLD_S": "0.3" if self.dry else "0.5"})
        session: Session | str = self.facts["teardown"]
        return session

    def _release_of(self, pid: int, exit_t: float | None, events: list[dict[str, Any]]) -> dict[str, Any]:
        """The measured release of one holder: exit (or kill) -> NVML free -> lease given back."""
        released = next((e for e in events if e.get("event") == "lease_released" and pid in e.get("worker_pids", [])),
                        None)
        allocated = next((e for e in events if e.get("event") == "allocated" and e.get("pid") == pid), None)
        out: dict[str, Any] = {"pid": pid, "exit_t": exit_t}
        if released is None or allocated is None or exit_t is None:
            out["problem"] = ("no lease release recorded" if released is None else
                              "no allocation recorded" if allocated is None else "no exit recorded")
            return out
        acquired = next((e for e in events if e.get("event") == "lease_acquired" and e["lease"] == released["lease"]),
                        None)
        free_before = acquired["free_mib"][0] if acquired else None
        out.update({"lease_waited_s": round(released["waited_s"], 3), "memory_back": released["memory_back"],
                    "lease_back_after_exit_s": round(released["t"] - exit_t, 3),
                    "release_started_after_exit_s": round(released["started"] - exit_t, 3),
                    "free_before_mib": free_before, "report": released["message"],
                    "lingering_pids": released["lingering_pids"]})
        if self.sampler is None or free_before is None:
            out["problem"] = "no NVML samples" if self.sampler is None else "lease acquisition not recorded"
            return out
        found = self.sampler.freed_after(
            self.primary, allocated["t"], released["t"] + 5,
            lambda free, pids: pid not in pids and free >= free_before - TOLERANCE_MIB)
        if found is None:
            out["problem"] = ("NVML never showed the holder's memory in use and then back (sampled every "
                              f"{SAMPLE_INTERVAL_S:g} s)")
            return out
        seen, last_busy = found
        out.update({"nvml_free_after_exit_s": round(seen - exit_t, 3),
                    "nvml_last_busy_after_exit_s": round(last_busy - exit_t, 3),
                    "sample_interval_s": SAMPLE_INTERVAL_S})
        if not released["memory_back"]:
            out["problem"] = f"the lease was given back without the memory: {released['message']}"
        elif released["t"] < last_busy:
            out["problem"] = (f"the lease was given back {last_busy - released['t']:.3f} s before NVML showed the "
                              "memory free")
        return out

    def check_release(self) -> Row | None:
        skip = self.needs_gpu("release_wait")
        if skip:
            return skip
        session = self._teardown_session()
        if isinstance(session, str):
            return Row("release_wait", "skip", session)
        events = self.events()
        measured, problems, parts = [], [], []
        for spec, mode in (("hold-30g", "free"), ("hold-30g", "exit"), ("hold-big", "exit")):
            label = f"{spec}-{mode}"
            name = {"hold-30g-free": "test_release[30g-free]", "hold-30g-exit": "test_release[30g-exit]",
                    "hold-big-exit": "test_release[big-exit]"}[label]
            result = self.result(f"release-{label}")
            outcome = session.outcomes.get(name, ("missing", ""))
            if result is None or outcome[0] != "passed":
                problems.append(f"{name}: {first_holder_error(outcome[1]) or first_error(outcome[1]) or outcome[0]}")
                continue
            pid = int(result["worker_pid"])
            exit_event = next((e for e in events if e.get("event") == "exit" and e.get("pid") == pid), None)
            m = self._release_of(pid, exit_event["t"] if exit_event else None, events)
            m["case"] = label
            m["held_mib"] = result["holder"]["allocated_mib"]
            measured.append(m)
            if "problem" in m:
                problems.append(f"{label}: {m['problem']}")
                continue
            gib = m["held_mib"] / 1024
            how = "freed by cuMemFree before exit" if mode == "free" else "held until exit"
            parts.append(f"{gib:g} GiB {how}: NVML free {_signed(m['nvml_free_after_exit_s'])} s after exit, lease "
                         f"back after {m['lease_back_after_exit_s']:.2f} s (Lease.release waited "
                         f"{m['lease_waited_s']:.2f} s)")
        data = {"cases": measured, "big_gb": self.facts.get("big_gb")}
        if problems:
            return Row("release_wait", "fail", clip("; ".join(problems), 600), data=data)
        return Row("release_wait", "pass", "; ".join(parts) + "; never given back before the memory", data=data)

    def check_sigkill(self) -> Row | None:
        skip = self.needs_gpu("sigkill_teardown")
        if skip:
            return skip
        session = self._teardown_session()
        if isinstance(session, str):
            return Row("sigkill_teardown", "skip", session)
        events = self.events()
        kill = self.result("sigkill")
        after = self.result("after-sigkill")
        problems = []
        for name in ("test_sigkill", "test_after_sigkill"):
            outcome = session.outcomes.get(name, ("missing", ""))
            if outcome[0] != "passed":
                problems.append(f"{name} {outcome[0]}: {first_holder_error(outcome[1]) or first_error(outcome[1])}")
        data: dict[str, Any] = {"sigkill": kill, "after": after}
        if kill is None:
            return Row("sigkill_teardown", "fail", clip("; ".join(problems) or "test_sigkill recorded nothing"),
                       data=data)
        pid = int(kill["worker_pid"])
        sent = next((e for e in events if e.get("event") == "kill_sent" and e.get("target") == pid), None)
        m = self._release_of(pid, sent["t"] if sent else None, events)
        data["release"] = m
        if "problem" in m:
            problems.append(m["problem"])
        if problems:
            return Row("sigkill_teardown", "fail", clip("; ".join(problems), 600), data=data)
        return Row("sigkill_teardown", "pass",
                   f"30 GiB holder SIGKILLed mid-test: died with {kill['returncode']} "
                   f"('{clip(kill['died_message'], 90)}'); "
                   f"NVML free {_signed(m['nvml_free_after_exit_s'])} s after the kill, lease back after "
                   f"{m['lease_back_after_exit_s']:.2f} s (waited {m['lease_waited_s']:.2f} s), then a lease of "
                   f"{after['need_mib'] if after else '?'} MiB granted at once; the holder is gone", data=data)

    def table(self) -> str:
        width = max(len(c) for c in CHECKS)
        lines = [f"{'check':<{width}}  {'status':<6}  {'secs':>6}  detail", "-" * (width + 100)]
        for r in self.rows:
            lines.append(f"{r.check:<{width}}  {r.status.upper():<6}  {r.seconds:>6.1f}  {r.detail}")
        return "\n".join(lines)

    def write_outputs(self) -> None:
        duration = time.time() - self.started
        failed = [r.check for r in self.rows if r.status == "fail"]
        summary = (f"gpu-check {'dry run' if self.dry else 'real run'}: {len(self.rows)} checks, "
                   f"{len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, {duration:.1f} s")
        text = self.table() + "\n" + summary
        print("\n" + text, flush=True)
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "schema": SCHEMA, "mode": "dry-run" if self.dry else "real", "run": self.run_id,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "duration_s": round(duration, 2), "budget_s": self.args.budget, "ok": not failed, "failed": failed,
            "checks": [{"check": r.check, "status": r.status, "detail": r.detail, "seconds": r.seconds, "data": r.data}
                       for r in self.rows],
            "sessions": [{"name": s.name, "rc": s.rc, "timed_out": s.timed_out, "seconds": round(s.seconds, 2),
                          "outcomes": {k: v[0] for k, v in s.outcomes.items()}} for s in self.sessions],
            "nvml_timeline": {str(i): [(round(t, 3), free, list(pids)) for t, _, free, pids in self.sampler.history(i)]
                              for i in self.gpus} if self.sampler else {},
        }
        (self.out / "gpu-check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        (self.out / "gpu-check.txt").write_text(text + "\n", encoding="utf-8")
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)
        for path in [*self.work.glob("session-*.txt"), self.events_path, *self.logs.glob("*.log")]:
            with contextlib.suppress(OSError):
                if path.is_file():
                    data = path.read_bytes()
                    (logs / path.name).write_bytes(data[-512 * 1024:])  # small enough to bring back
        if not self.args.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    from pytest_sglworker.errors import docs_url

    parser = argparse.ArgumentParser(prog="sglworker gpu-check", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="sglworker gpu-check: the first GPU run of pytest-sglworker, as "
                                                 f"one command.\nSee {docs_url('GPU_CHECK.md')}")
    parser.add_argument("--dry-run", action="store_true", help="fake NVML and fake CUDA: no GPU, no libcuda (CI)")
    parser.add_argument("--out", help="results folder (default: $OUT, else ./gpu-check-out)")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for the whole run (default 270)")
    parser.add_argument("--only", help="comma-separated checks to run (environment and leftovers always): "
                        + ", ".join(CHECKS))
    parser.add_argument("--keep-work", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--fake-gpus", type=int, default=2, help="dry run: number of fake H200s (default 2)")
    parser.add_argument("--fake-fault", default="", help="dry run: faults of the fakes (see fakegpu.py), for tests")
    parser.add_argument("--sglang-python", help="python with sglang for sglang_launch (default: this one)")
    parser.add_argument("--sglang-cpu", action="store_true",
                        help="run sglang_launch with the CPU recipe on a declared GPU (tests that path without a GPU)")
    args = parser.parse_args(argv)
    if args.sglang_python:  # the inner sessions run in inner/: a relative path would point elsewhere there
        found = shutil.which(args.sglang_python) if os.sep not in args.sglang_python else args.sglang_python
        if not found or not os.access(found, os.X_OK):
            parser.error(f"--sglang-python {args.sglang_python!r} is not an executable")
        args.sglang_python = os.path.abspath(found)
    if args.budget < 30:
        parser.error("--budget must be at least 30 seconds")
    if (args.fake_fault or args.fake_gpus != 2) and not args.dry_run:
        parser.error("--fake-gpus and --fake-fault need --dry-run")
    unknown = {c.strip() for c in (args.only or "").split(",") if c.strip()} - set(CHECKS)
    if unknown:
        parser.error(f"unknown check(s) in --only: {', '.join(sorted(unknown))}; known: {', '.join(CHECKS)}")
    if not 1 <= args.fake_gpus <= 8:
        parser.error("--fake-gpus must be between 1 and 8")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"gpu-check: {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: stop the running session, write what was seen
    check = Check(args)
    try:
        return check.run()
    except KeyboardInterrupt as exc:
        print(f"gpu-check: interrupted ({exc or 'SIGINT'}); partial results in {check.out}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

