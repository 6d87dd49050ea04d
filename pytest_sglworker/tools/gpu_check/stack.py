"""The checks of the software stack around the GPU (the environment, torch's view, one real sglang launch, and
the leftovers a run must not leave): a part of :class:`check.Check`, apart so that each file stays readable. Part
of the program ``check.py`` (run by path, not a module of the package)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    FAKE_DIR,
    HOLDER,
    MIB,
    PLUGIN_ROOT,
    RUN_ENV,
    TOLERANCE_MIB,
    Row,
    Sampler,
    _newest_log,
    _optional,
    _read_json,
    _startup_phases,
    _text,
    clip,
    first_error,
)


class StackChecks:
    """The stack's checks; :class:`check.Check` provides ``add``, ``run_cmd``, ``session``, ``env`` and the rest."""

    def check_environment(self) -> Row:
        data: dict[str, Any] = {
            "mode": "dry-run" if self.dry else "real", "python": self.python,
            "python_version": platform.python_version(),
            "host": socket.gethostname(), "cpus": os.cpu_count(), "repo": str(PLUGIN_ROOT),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "user": os.getuid(),
        }
        versions: dict[str, str | None] = {}
        for dist in ("pytest", "pytest-xdist", "pytest-timeout", "nvidia-ml-py", "psutil", "httpx", "filelock",
                     "torch", "sglang", "pytest-sglworker"):
            try:
                versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                versions[dist] = None
        data["versions"] = versions
        problems: list[str] = []
        notes: list[str] = []
        missing = [d for d in ("pytest", "pytest-xdist", "psutil", "httpx", "filelock") if versions[d] is None]
        if missing:
            problems.append(f"{self.python} lacks {', '.join(missing)}")
        # the plugin: from this tree, through its entry point when installed, else -p
        probe = ("import importlib.metadata as m, pytest_sglworker as p; "
                 "eps = [e for e in m.entry_points(group='pytest11') if e.value.split(':')[0].strip() == "
                 "'pytest_sglworker.plugin']; print(p.__file__); print(len(eps))")
        rc, text = self.run_cmd([self.python, "-c", probe], 60, env=self.env())
        lines = text.strip().splitlines()
        if rc != 0 or len(lines) < 2:
            problems.append(f"cannot import pytest_sglworker from {PLUGIN_ROOT}: {first_error(text)}")
        else:
            data["plugin_file"] = lines[-2]
            via_entry_point = lines[-1].strip() != "0"
            self.plugin_args = [] if via_entry_point else ["-p", "pytest_sglworker.plugin"]
            data["plugin_loaded_by"] = "entry point (installed)" if via_entry_point else "-p pytest_sglworker.plugin"
            if not Path(lines[-2]).resolve().is_relative_to(PLUGIN_ROOT):
                problems.append(f"pytest_sglworker is imported from {lines[-2]}, not from {PLUGIN_ROOT}, where "
                                "this check is")
        # NVML
        from pytest_sglworker.resources.gpus import resolve_visible_devices

        try:
            if self.dry:
                sys.path.insert(0, str(FAKE_DIR))
                os.environ["GPU_CHECK_FAKE_GPU"] = str(self.fake_state)  # the fake pynvml of this process
                if self.args.fake_fault:
                    os.environ["GPU_CHECK_FAKE_FAULT"] = self.args.fake_fault
            import pynvml  # the fake one in a dry run (FAKE_DIR first on sys.path)

            data["pynvml"] = getattr(pynvml, "__file__", "?")
            pynvml.nvmlInit()
            self.nvml = pynvml
            data["nvml_driver_version"] = _text(pynvml.nvmlSystemGetDriverVersion())
            count = int(pynvml.nvmlDeviceGetCount())
            uuids = [_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
            self.gpus = resolve_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
            data["nvml_count"] = count
            data["gpus_under_test"] = self.gpus
            if not self.gpus:
                problems.append(f"NVML reports {count} GPU(s), none visible "
                                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        except ImportError as exc:
            problems.append(f"cannot import pynvml (nvidia-ml-py): {exc}")
        except Exception as exc:
            problems.append(f"NVML is not available: {exc}")
            self.nvml = None
        if self.nvml is not None and self.gpus:
            self.primary = self.gpus[0]
            self.sampler = Sampler(self.nvml, self.gpus)
            for index in self.gpus:
                free, pids = self.sampler.read(index)
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                self.baseline[index] = {"free_mib": free, "pids": list(pids),
                                        "total_mib": int(self.nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
                                        "name": _text(self.nvml.nvmlDeviceGetName(handle)),
                                        "compute_mode": _optional(self.nvml, "nvmlDeviceGetComputeMode", handle),
                                        "mig_mode": _optional(self.nvml, "nvmlDeviceGetMigMode", handle),
                                        "persistence_mode": _optional(self.nvml, "nvmlDeviceGetPersistenceMode",
                                                                      handle)}
                if self.baseline[index]["compute_mode"] not in (None, 0):
                    notes.append(f"GPU {index} compute mode {self.baseline[index]['compute_mode']} (not Default): "
                                 "one CUDA context at a time")
                if pids:
                    notes.append(f"GPU {index} already runs process(es) {list(pids)}: measurements may be disturbed")
            self.sampler.start()
            data["baseline"] = self.baseline
        # nvidia-smi and the CUDA probe (device enumeration only: no context, no memory)
        smi = [self.python, str(FAKE_DIR / "nvidia_smi.py")] if self.dry else (
            [shutil.which("nvidia-smi")] if shutil.which("nvidia-smi") else None)
        data["nvidia_smi"] = smi
        self.facts["smi"] = smi
        probes: dict[str, Any] = {}
        for label, order in (("pci_bus_id", "PCI_BUS_ID"), ("default", None)):
            env = self.env()
            env.pop("CUDA_VISIBLE_DEVICES", None)
            env.pop("CUDA_DEVICE_ORDER", None)
            if order:
                env["CUDA_DEVICE_ORDER"] = order
            if label != "pci_bus_id" and not probes["pci_bus_id"].get("ok"):
                probes[label] = {"ok": False, "error": "not probed (the PCI_BUS_ID probe failed)"}
                continue
            limit = max(5.0, min(30.0, self.remaining() - 60))
            rc, text = self.run_cmd([self.python, str(HOLDER), "--probe"], limit, env=env)
            try:
                probes[label] = json.loads(text.strip().splitlines()[-1])
            except (ValueError, IndexError):
                hung = rc is None and "ran past" in text
                if hung:
                    self.facts["cuda_hung"] = True
                probes[label] = {"ok": False, "error": (
                    f"the CUDA probe (cuInit, device enumeration) did not finish within {limit:g} s: is the driver "
                    "wedged?" if hung else clip(text) or f"probe exited {rc}")}
        (self.work / "probe.json").write_text(json.dumps(probes["pci_bus_id"]), encoding="utf-8")
        data["cuda_probe"] = probes
        pci = probes["pci_bus_id"]
        if not pci.get("ok"):
            problems.append(f"CUDA driver: {pci.get('error')}")
        else:
            data["cuda_driver_version"] = pci.get("driver_version")
        self.facts["torch"] = versions["torch"]
        self.facts["sglang"] = importlib.util.find_spec("sglang") is not None
        cuda = (f"CUDA {pci.get('driver_version')} via {pci.get('library')}" if pci.get("ok") else "no CUDA")
        gpu_text = ", ".join(f"{i}: {b['name']} {b['total_mib']} MiB ({b['free_mib']} free)"
                             for i, b in self.baseline.items()) or "no GPU"
        detail = (f"{'dry run' if self.dry else 'real'}; python {platform.python_version()} ({self.python}); "
                  f"plugin {data.get('plugin_loaded_by', '?')}; NVML driver {data.get('nvml_driver_version', '-')}; "
                  f"{cuda}; GPUs {gpu_text}; torch {versions['torch'] or 'not installed'}; "
                  f"sglang {versions['sglang'] or 'not installed'}")
        if problems:
            return Row("environment", "fail", "; ".join(problems) + " | " + detail, data=data)
        return Row("environment", "warn" if notes else "info", "; ".join([*notes, detail]), data=data)

    def check_torch(self) -> Row:
        if self.dry:
            return Row("torch_view", "skip", "skipped: dry run (no GPU for torch); torch "
                       + (self.facts.get("torch") or "not installed"))
        if not self.facts.get("torch"):
            return Row("torch_view", "skip", f"skipped: torch is not installed for {self.python}")
        if self.facts.get("cuda_hung"):
            return Row("torch_view", "skip", "skipped: CUDA hung in the probe (see environment); torch would too")
        if self.remaining() < 60:
            return Row("torch_view", "skip", "skipped: out of time")
        code = ("import json, time; t = time.time(); import torch; r = {'torch': torch.__version__, "
                "'cuda': torch.version.cuda, 'available': torch.cuda.is_available(), "
                "'import_s': round(time.time() - t, 2)}\n"
                "if r['available']:\n"
                "    p = torch.cuda.get_device_properties(0); f, tot = torch.cuda.mem_get_info(0)\n"
                "    r.update(count=torch.cuda.device_count(), name=p.name, total_mib=p.total_memory >> 20, "
                "free_mib=f >> 20, uuid=str(getattr(p, 'uuid', '')))\n"
                "print(json.dumps(r))")
        env = self.env(CUDA_VISIBLE_DEVICES=str(self.primary), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        rc, text = self.run_cmd([self.python, "-c", code], min(150, self.remaining() - 30), env=env)
        try:
            data = json.loads(text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return Row("torch_view", "warn", f"torch probe failed (exit {rc}): {first_error(text)}",
                       data={"output": text[-2000:]})
        if not data.get("available"):
            return Row("torch_view", "warn", f"torch {data['torch']} (CUDA {data['cuda']}) sees no GPU", data=data)
        base = self.baseline.get(self.primary, {})
        same = data.get("name") == base.get("name")
        detail = (f"torch {data['torch']} (CUDA {data['cuda']}, import {data['import_s']} s): GPU {self.primary} = "
                  f"{data['name']}, {data['total_mib']} MiB total (NVML {base.get('total_mib')}), "
                  f"{data['free_mib']} MiB "
                  f"free after its context (NVML baseline {base.get('free_mib')})")
        return Row("torch_view", "pass" if same else "warn", detail + ("" if same else "; name differs from NVML's"),
                   data=data)

    def check_sglang(self) -> Row:
        args = self.args
        python = args.sglang_python or self.python
        rc, out = self.run_cmd([python, "-c", "import importlib.util, importlib.metadata as m, sys; "
                                "print(m.version('sglang')) if importlib.util.find_spec('sglang') else sys.exit(3)"],
                               60)
        has = rc == 0
        version = out.strip().splitlines()[-1] if has and out.strip() else "?"
        torch = self.facts.get("torch")
        if not has:
            return Row("sglang_launch", "skip", f"skipped: sglang not installed for {python}"
                       + (f" (torch {torch} is, but torch alone cannot launch sglang)" if torch else ""))
        if self.dry and not args.sglang_cpu:
            return Row("sglang_launch", "skip", "skipped: dry run (sglang is installed; a real launch needs the GPU)")
        if not args.sglang_cpu:
            skip = self.needs_gpu("sglang_launch")
            if skip:
                return skip
        if self.remaining() < 150:
            return Row("sglang_launch", "skip", f"skipped: out of time ({self.remaining():.0f} s left)")
        from pytest_sglworker.engine.cpu_engine import CPU_ENGINE_ARGS, CPU_ENGINE_ENV, TinyModelError, build_tiny_model

        try:
            model = build_tiny_model(python, self.work / "tiny-model", timeout=min(180, self.remaining() - 120))
        except TinyModelError as exc:
            return Row("sglang_launch", "fail", f"cannot build the tiny model: {first_error(str(exc))}")
        extra = {"GPU_CHECK_TINY_MODEL": str(model), "GPU_CHECK_GPUS": str(self.primary)}
        gpus = ["--sgl-gpus", str(self.primary)]
        if args.sglang_cpu:
            extra["GPU_CHECK_TINY_ARGS"] = json.dumps(list(CPU_ENGINE_ARGS))
            extra["GPU_CHECK_TINY_ENV"] = json.dumps(dict(CPU_ENGINE_ENV))
            gpus = ["--sgl-gpus", "sim:1x80"]
        session = self.session("sglang", ["test_sglang.py"], [*gpus, "--sgl-startup-timeout", "240"],
                               timeout=min(300, self.remaining() - 20), env_extra=extra,
                               launcher=[python, "-m", "sglang.launch_server"])
        if isinstance(session, str):
            return Row("sglang_launch", "skip", session)
        result = self.result("sglang") or {}
        log_path = result.get("log_path") or _newest_log(self.logs, "sglang-worker-")
        log_text = Path(log_path).read_text(encoding="utf-8", errors="replace") if log_path else ""
        phases = _startup_phases(log_text)
        from pytest_sglworker.engine.log_lines import parse_memory

        memory = vars(parse_memory(log_text))
        report = _read_json(self.work / "report-sglang.json") or {}
        worker: dict[str, Any] = next(iter(report.get("workers", {}).values()), {})
        data = {"phases": phases, "memory": memory, "report": worker, "result": result, "log": log_path}
        kv = worker.get("kv_tokens", {})
        if not session.passed:
            return Row("sglang_launch", "fail", clip(session.problem(), 600), data=data)
        phase_text = ", ".join(f"{p['phase']} +{p['after_s']:.1f} s" if p.get("after_s") is not None else p["phase"]
                               for p in phases)
        return Row("sglang_launch", "pass",
                   f"tiny model served by sglang {version} in "
                   f"{result.get('startup_seconds') or 0:.1f} s; "
                   f"phases: {phase_text or 'none seen'}; KV #tokens {memory.get('kv_tokens')} "
                   f"(ledger predicted {kv.get('predicted')}), weights {memory.get('weights_gb')} GB", data=data)

    def check_leftovers(self) -> Row:
        import psutil

        problems: list[str] = []
        data: dict[str, Any] = {}
        me = os.getpid()
        deadline = time.monotonic() + 15
        while True:
            marked: list[tuple[int, str]] = []
            found: list[psutil.Process] = []
            for proc in psutil.process_iter(["pid", "cmdline"]):
                try:
                    if proc.pid == me or proc.status() == psutil.STATUS_ZOMBIE:
                        continue
                    if proc.environ().get(RUN_ENV) == self.run_id:
                        marked.append((proc.pid, " ".join(proc.info["cmdline"] or [])[:200]))
                        found.append(proc)
                except (psutil.Error, OSError):
                    continue
            if not marked or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        data["left_running"] = marked
        if marked:
            problems.append(f"{len(marked)} process(es) of this run left running (ended now): {marked[:3]}")
            for proc in found:  # ours: they carry this run's marker; psutil checks the pid still names that process
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        holders = sorted({e["pid"] for e in self.events() if e.get("source") == "holder"})
        data["holders"] = len(holders)
        if self.nvml is not None and self.sampler is not None:
            settle = time.monotonic() + 10
            while True:
                back: dict[int, tuple[int, list[int]]] = {}
                for index in self.gpus:
                    try:
                        free, pids = self.sampler.read(index)
                    except Exception as exc:
                        problems.append(f"NVML failed at the end: {exc}")
                        break
                    back[index] = (free, sorted(set(pids) & set(holders)))
                ok = all(free >= self.baseline[i]["free_mib"] - TOLERANCE_MIB and not stale
                         for i, (free, stale) in back.items())
                if ok or time.monotonic() >= settle:
                    break
                time.sleep(0.1)
            data["nvml_end"] = back
            for index, (free, stale) in back.items():
                if stale:
                    problems.append(f"NVML still lists holder(s) {stale} on GPU {index}")
                if free < self.baseline[index]["free_mib"] - TOLERANCE_MIB:
                    problems.append(f"GPU {index}: {free} MiB free at the end, {self.baseline[index]['free_mib']} at "
                                    "the start")
        held: list[str] = []
        import fcntl

        for lock in sorted(self.locks.glob("gpu-*.lock")):
            try:
                with open(lock, "rb") as fh:
                    try:
                        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
                    except OSError:
                        held.append(lock.name)
            except OSError:
                continue
        records = [p.name for p in self.locks.glob("gpu-*.json")]
        data.update({"locks_held": held, "holder_records": records})
        if held:
            problems.append(f"GPU lock(s) still held: {held}")
        if records:
            problems.append(f"lease holder record(s) left: {records}")
        if self.sampler is not None and self.sampler.error:
            problems.append(self.sampler.error)
        if problems:
            return Row("leftovers", "fail", clip("; ".join(problems), 600), data=data)
        polls = self.sampler.polls if self.sampler else 0
        return Row("leftovers", "pass", f"nothing left: no process of the run, {len(holders)} holder(s) all gone, "
                   f"memory back to the baseline, no lock held ({polls} NVML polls)", data=data)

    # -- output

