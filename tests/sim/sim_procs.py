"""What the simulated engine's tests share: starting sims as real subprocesses (output to files, never pipes),
waiting on them with deadlines, and killing them (and any child they let escape) by PID afterwards."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

MODEL = "Qwen/Qwen3-0.6B"
#: The tiny Llama's config and tokenizer (no weights): the model of the real-engine tier.
TINY = str(Path(__file__).resolve().parents[1] / "data" / "sim" / "tiny-llama")
CI_ARGS = ("--mem-fraction-static=0.6", "--cuda-graph-backend-prefill=disabled")
T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class SimProc:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, out: Path, err: Path) -> None:
        self.proc = proc
        self.port = port
        self.out = out
        self.err = err
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)

    def log(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def escaped_pids(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"spawned scheduler pid=(\d+)", self.log())]

    def _dead_msg(self) -> str:
        return f"sim exited with {self.proc.returncode}; log:\n{self.log()[-3000:]}\nstderr:\n{self.stderr()[-2000:]}"

    def wait_log(self, text: str, timeout: float = 10.0) -> str:
        def seen() -> bool:
            if text in self.log():
                return True
            assert self.proc.poll() is None, f"waiting for {text!r}: {self._dead_msg()}"
            return False

        wait_for(seen, timeout, f"{text!r} in the log")
        return self.log()

    def status(self, path: str) -> int | None:
        try:
            return self.client.get(path, timeout=2.0).status_code
        except httpx.TransportError:
            return None

    def wait_status(self, path: str, code: int, timeout: float = 10.0) -> None:
        def ok() -> bool:
            assert self.proc.poll() is None, f"waiting for {path} -> {code}: {self._dead_msg()}"
            return self.status(path) == code

        wait_for(ok, timeout, f"GET {path} -> {code}")

    def wait_ready(self, timeout: float = 10.0) -> None:
        self.wait_status("/health", 200, timeout)

    def wait_exit(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"sim did not exit within {timeout} s; log:\n{self.log()[-3000:]}") from None


class Launcher:
    """Starts sims and, on cleanup, kills them and any escaped child by PID, then checks none is left."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sims: list[SimProc] = []

    def __call__(
        self, *args: str, env: dict[str, str] | None = None, port: int | None = None, startup: str = "0.1",
        model: str = MODEL,
    ) -> SimProc:
        port = port or free_port()
        out = self.directory / f"sim-{port}-{len(self.sims)}.out"
        err = self.directory / f"sim-{port}-{len(self.sims)}.err"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLSIM_")}
        full_env.pop("CUDA_VISIBLE_DEVICES", None)
        full_env["SGLSIM_STARTUP_SECONDS"] = startup
        # no Hugging Face cache: a hub id's tokens are the sim's fallback's, whatever this machine has cached
        full_env["HF_HUB_CACHE"] = str(self.directory / "no-hf-cache")
        full_env.update(env or {})
        argv = [sys.executable, "-m", "pytest_sglworker.sim", "--model-path", model, "--port", str(port), *args]
        with open(out, "wb") as fout, open(err, "wb") as ferr:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fout, stderr=ferr, env=full_env, start_new_session=True
            )
        sim = SimProc(proc, port, out, err)
        self.sims.append(sim)
        return sim

    def cleanup(self) -> None:
        pids: list[int] = []
        for sim in self.sims:
            sim.client.close()
            escaped = sim.escaped_pids()
            if sim.proc.poll() is None:
                sim.proc.kill()
            sim.proc.wait(10)
            pids.append(sim.proc.pid)
            for pid in escaped:
                pids.append(pid)
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
        wait_for(lambda: not any(alive(pid) for pid in pids), 10.0, "every sim process to be gone")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLSIM_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest_sglworker.sim", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=full_env,
        stdin=subprocess.DEVNULL,
    )


def sse(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of a server-sent-event stream (``[DONE]`` kept as a string)."""
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def positions_in_order(log: str, needles: list[str]) -> None:
    at = -1
    for needle in needles:
        found = log.find(needle, at + 1)
        assert found > at, f"{needle!r} missing or out of order in:\n{log[-4000:]}"
        at = found


def tiny_sim(tmp_path_factory: Any, name: str) -> Iterator[SimProc]:
    """A running sim over the tiny Llama's config and tokenizer (its own tokens when ``tokenizers`` is importable),
    for a module's fixture (``yield from tiny_sim(tmp_path_factory, "name")``); ended after the module."""
    launcher = Launcher(tmp_path_factory.mktemp(name))
    try:
        sim = launcher(*CI_ARGS, "--skip-server-warmup", "--max-total-tokens", "1024", model=TINY)
        sim.wait_ready()
        yield sim
    finally:
        launcher.cleanup()
