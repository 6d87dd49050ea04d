"""``sglworker gpu-check``: the first GPU run of pytest-sglworker, as one command. See docs/GPU_CHECK.md.

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
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The folder that holds the ``pytest_sglworker`` this check belongs to: a checkout, or site-packages.
PLUGIN_ROOT = HERE.parents[2]
INNER = HERE / "inner"
FAKE_DIR = HERE / "fake_nvml"
HOLDER = HERE / "holder.py"
SCHEMA = "pytest-sglworker/gpu-check/v1"
MIB = 1024 * 1024
#: As the lease code's release tolerance (LeaseManager.release_tolerance_mib).
TOLERANCE_MIB = 256
SAMPLE_INTERVAL_S = 0.02
CHECKS = (
    "environment", "nvml_inventory", "lease_visibility", "nvml_process_ids", "ledger_input", "lease_exclusivity",
    "release_wait", "sigkill_teardown", "torch_view", "sglang_launch", "leftovers",
)
MAX_VISIBILITY_GPUS = 8
RUN_ENV = "GPU_CHECK_RUN"

sys.path.insert(0, str(HERE))
# The plugin this check belongs to (it need not be installed): the driver imports it from there too.
sys.path.insert(1, str(PLUGIN_ROOT))


@dataclass
class Row:
    check: str
    status: str  # pass | fail | warn | skip | info
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Session:
    name: str
    rc: int | None
    timed_out: bool
    seconds: float
    outcomes: dict[str, tuple[str, str]]
    output: str
    started: float
    ended: float

    @property
    def passed(self) -> bool:
        return self.rc == 0 and not self.timed_out and all(o == "passed" for o, _ in self.outcomes.values())

    def problem(self) -> str:
        """One line: the first clear error of the session."""
        if self.timed_out:
            return f"session {self.name} ran past its deadline ({self.seconds:.0f} s) and was stopped; " + \
                (first_error(self.output) or "no error line")
        bad = [(n, o, m) for n, (o, m) in self.outcomes.items() if o not in ("passed", "skipped")]
        holder = first_holder_error(self.output + "\n".join(m for _, _, m in bad))
        if bad:
            name, outcome, message = bad[0]
            return f"{name} {outcome}: " + (holder or first_error(message) or first_error(self.output) or "?")
        if self.rc not in (0, None):
            return f"session {self.name} exited {self.rc}: " + (holder or first_error(self.output) or "no error line")
        if not self.outcomes:
            return f"session {self.name} ran no test: " + (first_error(self.output) or "no error line")
        return ""


def clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_holder_error(text: str) -> str:
    for line in text.splitlines():
        if "[gpu-check holder] ERROR:" in line:
            return clip("holder: " + line.split("[gpu-check holder] ERROR: ", 1)[1])
    return ""


def first_error(text: str) -> str:
    if not text:
        return ""
    lines = text.splitlines()
    for line in lines:
        s = line.strip()
        if s.startswith("E ") and len(s) > 2:
            return clip(s[1:].strip())
    for line in lines:
        s = line.strip()
        if re.match(r"^(ERROR|Failed|AssertionError|[A-Za-z_.]*Error\b)", s):
            return clip(s)
    for line in lines:
        if line.strip() and not line.startswith(("=", "-", "_")):
            return clip(line)
    return ""


def parse_junit(path: Path) -> dict[str, tuple[str, str]]:
    """``{test name: (outcome, message)}``; the worst outcome of a test's phases wins."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    result: dict[str, tuple[str, str]] = {}
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        outcome, message = "passed", ""
        for child in case:
            tag = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if tag is None:
                continue
            text = (child.get("message") or "") + "\n" + (child.text or "")
            if rank[tag] > rank[outcome]:
                outcome, message = tag, text
        previous = result.get(name)
        if previous is None or rank[outcome] > rank[previous[0]]:
            result[name] = (outcome, message)
    return result


# ------------------------------------------------------------------------------------------------ NVML sampling


class Sampler(threading.Thread):
    """Polls NVML every ``interval`` s. Keeps, per GPU, only the readings that differ from the one before,
    each with the time of the poll before it: ``(t_seen, t_previous_poll, free_mib, pids)``."""

    def __init__(self, nvml: Any, indices: Sequence[int], interval: float = SAMPLE_INTERVAL_S) -> None:
        super().__init__(name="gpu-check-nvml-sampler", daemon=True)
        self.nvml = nvml
        self.indices = list(indices)
        self.interval = interval
        self.changes: dict[int, list[tuple[float, float, int, tuple[int, ...]]]] = {i: [] for i in self.indices}
        self.polls = 0
        self.error: str | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._last_poll: dict[int, float] = {}

    def read(self, index: int) -> tuple[int, tuple[int, ...]]:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        free = int(nvml.nvmlDeviceGetMemoryInfo(handle).free) // MIB
        try:
            pids = tuple(sorted(int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)))
        except nvml.NVMLError:
            pids = ()
        return free, pids

    def run(self) -> None:
        while not self._stop_event.is_set():
            for index in self.indices:
                try:
                    free, pids = self.read(index)
                except Exception as exc:
                    self.error = f"NVML failed while sampling GPU {index}: {exc}"
                    return
                now = time.time()
                with self._lock:
                    history = self.changes[index]
                    if not history or history[-1][2:] != (free, pids):
                        history.append((now, self._last_poll.get(index, now), free, pids))
                    self._last_poll[index] = now
            self.polls += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def history(self, index: int) -> list[tuple[float, float, int, tuple[int, ...]]]:
        with self._lock:
            return list(self.changes.get(index, []))

    def state_at(self, index: int, t: float) -> tuple[int, tuple[int, ...]] | None:
        state = None
        for seen, _, free, pids in self.history(index):
            if seen > t:
                break
            state = (free, pids)
        return state

    def freed_after(self, index: int, since: float, until: float,
                    free: Callable[[int, tuple[int, ...]], bool]) -> tuple[float, float] | None:
        """When the readings, busy at or after ``since`` (``free`` false), first turned free again:
        ``(t_first_seen_free, t_last_poll_seen_busy)``; None if that is not seen up to ``until``."""
        history = self.history(index)
        busy_seen = False
        start = 0
        for i, record in enumerate(history):  # the reading in effect at ``since`` counts
            if record[0] <= since:
                start = i
        for record in history[start:]:
            if record[0] > until:
                return None
            if not free(record[2], record[3]):
                busy_seen = True
            elif busy_seen:
                return record[0], record[1]
        return None

    def window(self, index: int, start: float, end: float) -> list[tuple[float, int, tuple[int, ...]]]:
        """States in effect during ``[start, end]`` (the one at ``start`` included)."""
        out: list[tuple[float, int, tuple[int, ...]]] = []
        for seen, _, free, pids in self.history(index):
            if seen <= start:
                out = [(seen, free, pids)]
            elif seen <= end:
                out.append((seen, free, pids))
        return out


# ------------------------------------------------------------------------------------------------ the run


class Check:
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
            for proc in psutil.process_iter(["pid", "cmdline"]):
                try:
                    if proc.pid == me or proc.status() == psutil.STATUS_ZOMBIE:
                        continue
                    if proc.environ().get(RUN_ENV) == self.run_id:
                        marked.append((proc.pid, " ".join(proc.info["cmdline"] or [])[:200]))
                except (psutil.Error, OSError):
                    continue
            if not marked or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        data["left_running"] = marked
        if marked:
            problems.append(f"{len(marked)} process(es) of this run left running (ended now): {marked[:3]}")
            for pid, _ in marked:  # ours: they carry this run's marker
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
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


# ------------------------------------------------------------------------------------------------ analysis helpers


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _optional(nvml: Any, name: str, *args: Any) -> Any:
    """An NVML reading that may be missing (old nvidia-ml-py, the fake) or unsupported: None then."""
    fn = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        value = fn(*args)
    except Exception:
        return None
    return list(value) if isinstance(value, (list, tuple)) else value


def _signed(value: float) -> str:
    return f"{value:+.2f}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data
    except (OSError, ValueError):
        return None


def _card_for(name: str, total: int, cards: Mapping[str, int]) -> str | None:
    """The card table entry for an NVML name (``NVIDIA H200`` -> ``H200``), the closest in size among those
    whose model matches."""
    norm = "".join(c for c in name.lower() if c.isalnum())
    candidates = [c for c in cards if "".join(ch for ch in c.lower().split("-")[0] if ch.isalnum()) in norm]
    if not candidates:
        return None
    return min(candidates, key=lambda c: abs(cards[c] - total))


def _lease_intervals(events: Iterable[dict[str, Any]], index: int) -> list[tuple[float, float, str]]:
    acquired = {e["lease"]: e for e in events if e.get("event") == "lease_acquired" and index in e.get("indices", [])}
    out = []
    for e in events:
        if e.get("event") == "lease_released" and e.get("lease") in acquired:
            out.append((acquired[e["lease"]]["t"], e["t"], e["lease"]))
    return out


def _holder_intervals(events: Iterable[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for e in events:
        if e.get("source") != "holder":
            continue
        if e.get("event") == "allocated":
            start[e["pid"]] = e["t"]
        elif e.get("event") == "exit":
            end[e["pid"]] = e["t"]
    return {pid: (t, end.get(pid, float("inf"))) for pid, t in start.items()}


def _max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda p: (p[0], p[1]))
    best = current = 0
    for _, delta in points:
        current += delta
        best = max(best, current)
    return best


_PHASE_MARKERS = (
    ("server args", "server_args="), ("load weights", "Load weight begin"), ("weights loaded", "Load weight end"),
    ("KV pool", "KV Cache is allocated"), ("graph capture", "Capture cuda graph begin"),
    ("graphs captured", "Capture cuda graph end"), ("max_total_num_tokens", "max_total_num_tokens="),
    ("HTTP up", "Uvicorn running on"), ("ready", "The server is fired up and ready to roll!"),
)
_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def _startup_phases(log_text: str) -> list[dict[str, Any]]:
    """First line of each startup phase in an sglang log, with seconds since the first timestamped line."""
    first_stamp: float | None = None
    found: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, line in enumerate(log_text.splitlines(), 1):
        stamp = _STAMP.search(line)
        at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) if stamp else None
        if at is not None and first_stamp is None:
            first_stamp = at
        for phase, marker in _PHASE_MARKERS:
            if phase not in seen and marker in line:
                seen.add(phase)
                found.append({"phase": phase, "line": number,
                              "after_s": None if at is None or first_stamp is None else at - first_stamp})
    return found


def _newest_log(folder: Path, prefix: str) -> str | None:
    logs = sorted(folder.glob(f"{prefix}*.log"), key=lambda p: p.stat().st_mtime)
    return str(logs[-1]) if logs else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglworker gpu-check", description=__doc__.split("\n\n")[0])
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
