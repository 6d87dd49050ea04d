"""The real engine and the simulated one side by side, for the differential tests of this folder
(``test_sim_differential.py``: a corpus of requests; ``test_sim_fidelity.py``: every request field of sglang's
protocol): the servers (one real sglang 0.5.23 on the CPU with the tiny random-weight model and one sim over the
same model directory, for a generation model and an embedding one), one exchange with a server, and what is
compared of two answers (status, content type, the JSON shape of every object and stream chunk, chosen values,
error messages). ``conftest.py`` starts the servers once for the session."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pytest_sglworker.engine.cpu_engine import CPU_ENGINE_ARGS, CPU_ENGINE_ENV, build_tiny_model
from pytest_sglworker.engine.specs import CI_WORKER_ARGS
from pytest_sglworker.resources.processes import OWNER_ENV, owner_tag
from pytest_sglworker.resources.reaper import Watchdog

STARTUP_TIMEOUT = 240.0
#: Keys whose presence depends on timing in the real engine (see the module docstring).
VOLATILE = frozenset({"response_sent_to_client_ts"})
#: A value that may be null in one engine and set in the other (a prefix-cache hit is not deterministic).
NULLABLE = frozenset({"cached_tokens_details"})
#: Objects keyed by token text (OpenAI completions' ``top_logprobs``): compared as maps.
MAPS = frozenset({"top_logprobs"})


# ------------------------------------------------------------------------------------------------ shapes


def shape(value: Any, key: str = "") -> Any:
    """The JSON shape of ``value``: objects keep their keys with the shapes of their values, lists become
    the sorted set of their items' shapes, scalars their type name."""
    if key in NULLABLE:
        return "nullable"
    if isinstance(value, dict) and key in MAPS:
        return {"<token>": sorted({json.dumps(shape(v), sort_keys=True) for v in value.values()})}
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        items = {json.dumps(shape(v, key if key in MAPS else ""), sort_keys=True) for v in value}
        return sorted(items)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return type(value).__name__


def diff_shapes(real: Any, sim: Any, where: str = "$") -> list[str]:
    """Human-readable differences between two shapes."""
    if isinstance(real, dict) and isinstance(sim, dict):
        out = [f"{where}: key {k!r} only in the real answer" for k in sorted(set(real) - set(sim))]
        out += [f"{where}: key {k!r} only in the sim's answer" for k in sorted(set(sim) - set(real))]
        for k in sorted(set(real) & set(sim)):
            out += diff_shapes(real[k], sim[k], f"{where}.{k}")
        return out
    if real != sim:
        return [f"{where}: real {json.dumps(real)[:300]} vs sim {json.dumps(sim)[:300]}"]
    return []


# ------------------------------------------------------------------------------------------------ corpus


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: Any = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    #: compare the error message text too (the sim claims sglang's exact wording)
    message: bool = False
    #: compare these values (dotted paths into the JSON answer) exactly
    values: tuple[str, ...] = ()
    embedding: bool = False




# ------------------------------------------------------------------------------------------------ servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(self.port)], env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.url} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.url} not ready in time:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def terminate(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:  # sglang's scheduler and detokenizer share the session: end whatever is left of it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@dataclass
class Pair:
    real: Server
    sim: Server




# ------------------------------------------------------------------------------------------------ exchange


@dataclass
class Answer:
    status: int
    content_type: str
    body: Any  # parsed JSON, a list of stream events, or text

    @property
    def is_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")


def send(url: str, case: Case) -> Answer:
    kwargs: dict[str, Any] = {"headers": dict(case.headers)}
    if case.raw is not None:
        kwargs["content"] = case.raw
    elif case.body is not None:
        kwargs["json"] = case.body
    with httpx.Client(base_url=url, timeout=60.0, trust_env=False) as client:
        client.post("/flush_cache")
        with client.stream(case.method, case.path, **kwargs) as r:
            raw = r.read().decode("utf-8", "replace")
            content_type = r.headers.get("content-type", "")
    body: Any = raw
    if content_type.startswith("text/event-stream"):
        events = []
        for line in raw.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        body = events
    elif content_type.startswith("application/json"):
        body = json.loads(raw)
    return Answer(r.status_code, content_type, body)


def dig(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def stream_shapes(events: list[Any], *, with_first: bool) -> dict[str, Any]:
    """What is compared of a stream: how it ends, its last data chunk and the set of distinct shapes of the
    others; ``with_first``: also the first chunk (only when both streams have more than one: how many
    tokens the real engine puts in one chunk depends on timing)."""
    data = [e for e in events if e != "[DONE]"]
    out = {"done": bool(events) and events[-1] == "[DONE]", "last": shape(data[-1]) if data else None}
    if with_first:
        out["first"] = shape(data[0])
        out["others"] = sorted({json.dumps(shape(e), sort_keys=True) for e in data[:-1]})
    return out


def _chunks(events: list[Any]) -> int:
    """How many chunks carry generated output: a usage-only chunk (``choices: []``, sent for
    ``stream_options.include_usage``) does not count, so two tokens coalesced into one chunk by the real
    engine, then its usage chunk, is one chunk, not two."""
    return sum(1 for e in events if e != "[DONE]" and not (isinstance(e, dict) and e.get("choices") == []))


def compare(case: Case, real: Answer, sim: Answer) -> list[str]:
    problems = []
    if real.status != sim.status:
        problems.append(f"status: real {real.status} vs sim {sim.status} (real body {str(real.body)[:300]})")
    if real.content_type.split(";")[0] != sim.content_type.split(";")[0]:
        problems.append(f"content type: real {real.content_type!r} vs sim {sim.content_type!r}")
    if problems:
        return problems
    if real.is_stream:
        both = _chunks(real.body) > 1 and _chunks(sim.body) > 1
        problems += diff_shapes(stream_shapes(real.body, with_first=both), stream_shapes(sim.body, with_first=both),
                                "stream")
    elif isinstance(real.body, (dict, list)):
        problems += diff_shapes(shape(real.body), shape(sim.body))
        for path in case.values:
            if dig(real.body, path) != dig(sim.body, path):
                problems.append(f"{path}: real {dig(real.body, path)!r} vs sim {dig(sim.body, path)!r}")
        if case.message and isinstance(real.body, dict):
            problems += [f"message: real {a!r} vs sim {b!r}" for a, b in [(_message(real.body), _message(sim.body))]
                         if a != b]
        if (isinstance(real.body, dict) and real.body.get("object") == "error"
                and real.body.get("type") != sim.body.get("type")):
            problems.append(f"error type: real {real.body.get('type')!r} vs sim {sim.body.get('type')!r}")
    elif real.body != sim.body and real.status == 200:
        problems.append(f"text: real {real.body[:200]!r} vs sim {sim.body[:200]!r}")
    return problems


def _message(body: dict[str, Any]) -> Any:
    """An error's message; a validation error's up to where FastAPI's text names the server's own source file
    (the sim names only the endpoint)."""
    if isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    else:
        message = body.get("message", body.get("detail", body.get("error")))
    return message.split("\n\n", 1)[0] if isinstance(message, str) else message



@contextmanager
def started_pairs(python: Path, root: Path) -> Iterator[dict[str, Pair]]:
    """The real engine (``python``'s sglang) and the sim, each for a generation model and an embedding one, all
    four started at once over one tiny model built in ``root``, ready, and ended after."""
    model = build_tiny_model(python, root / "tiny-model")
    common = [*CI_WORKER_ARGS, *CPU_ENGINE_ARGS, "--model-path", str(model)]
    # Tagged, with a watchdog of their own: when this test process is killed (xdist ends a worker that does not
    # stop in time), the servers go too; their teardown below does not run then
    session = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLSIM_")}
    env[OWNER_ENV] = owner_tag(session)
    real_env = {**env, **CPU_ENGINE_ENV}
    sim_env = {**env, "SGLSIM_STARTUP_SECONDS": "0"}
    started: list[Server] = []
    watchdog = Watchdog(session)
    try:
        pairs = {}
        for kind, extra in (("generation", []), ("embedding", ["--is-embedding"])):
            real = Server([str(python), "-m", "sglang.launch_server", *common, *extra], real_env,
                          root / f"real-{kind}.log")
            started.append(real)
            sim = Server([sys.executable, "-m", "pytest_sglworker.sim", *common, *extra], sim_env,
                         root / f"sim-{kind}.log")
            started.append(sim)
            pairs[kind] = Pair(real, sim)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for server in started:
            server.wait_ready(deadline)
        yield pairs
    finally:
        for server in started:  # all of them asked to end first: their shutdowns overlap
            server.terminate()
        for server in started:
            server.stop()
        watchdog.close()
