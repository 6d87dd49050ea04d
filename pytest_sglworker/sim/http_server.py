"""The simulated engine's HTTP server: sglang 0.5.23's endpoints, request checks and response shapes.

Part of :mod:`pytest_sglworker.sim`; stdlib only. Shapes and error envelopes follow the real server (checked
by ``tests/sim/test_sim_differential.py`` against the real engine on the CPU): ``/generate`` errors are
``{"error": {"message": ...}}``, the OpenAI endpoints' are ``{"object": "error", "message", "type":
"BadRequestError", "param": null, "code": 400}``, a body that fails FastAPI's validation (bad JSON, a
missing field, a wrong content type) is the same envelope with ``"type": "Bad Request"`` and a pydantic-like
message, and an abort with another status (a PD handshake timeout) has ``"type": "<status>"``.

Why one module of this size: it is the HTTP surface of sglang's ``srt/entrypoints/http_server.py`` and its OpenAI
adapters, one handler per endpoint, all sharing the same request checks, error envelopes and the ``Sim`` state;
split by endpoint, every file would import every other's checks. The startup is in :mod:`.startup`, PD in :mod:`sim_pd`,
tokens in :mod:`sim_tokens`, faults in :mod:`sim_faults`, gRPC in :mod:`sim_grpc`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn, TypeGuard

from . import pd as sim_pd
from .core import CONTROL_PATH, ENV_FAULT, WORKER_HEADER, Log, Recorder
from .faults import INFERENCE_PATHS, FaultError, Faults, FaultState, known_faults
from .plan import Plan
from .tokens import (
    Generation,
    Vocab,
    embedding,
    embedding_base64,
    generate,
    label_scores,
    logprobs,
    message_text,
    openai_chat_logprob,
    openai_completion_logprobs,
    render_chat,
)

VERSION = "0.5.23-sim"
SITE = "/usr/local/lib/python3.12/dist-packages"
_PHRASES = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Request Entity Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
#: A body the sim reads and drops before answering 413 (a larger one: the connection is closed instead).
_DISCARD_LIMIT = 64 << 20

#: ``/model_info``'s ``embedding`` object (sglang 0.5.23 on the tiny Llama, without and with --is-embedding).
_EMBEDDING_OFF = {
    "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
    "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
    "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
    "enabled": False, "matryoshka_dimensions": [],
}
_EMBEDDING_ON = {
    **_EMBEDDING_OFF, "family": "explicit_decoder_embedding", "task": "embed", "execution": "decoder_pooling",
    "attention": "causal", "normalize": True, "postprocessor": "model_defined", "requires_embedding_flag": True,
    "bcg_eligibility": "standard", "enabled": True,
}
#: ``/server_info`` fields of sglang 0.5.23 that are not flags of its parser.
_SERVER_INFO_FIELDS: dict[str, Any] = {
    "_radix_eviction_policy_explicitly_set": False, "_speculative_draft_quantization_explicitly_set": False,
    "_swa_full_tokens_ratio_explicitly_set": False, "aux_hidden_state_capture": None,
    "custom_sigquit_handler": None, "enable_cp_tp_group_sharing": False, "grpc_worker_threads": 4,
    "kv_events": None, "speculative_boundary_reduction": "rs+rsv", "stat_loggers": None,
    "uses_mamba_radix_cache": False, "watermark_context_window": 4, "watermark_default_enabled": False,
    "watermark_enforce_all": False, "watermark_key": "<redacted>", "watermark_key_b": "<redacted>",
    "watermark_max_probability": 1.0, "watermark_mixing_probability": 0.5,
}
_NOT_IN_SERVER_INFO = ("config",)


class BadRequest(Exception):
    """A request the real server refuses with 400; ``validation``: FastAPI's validation (type "Bad Request")."""

    def __init__(self, message: str, *, validation: bool = False) -> None:
        super().__init__(message)
        self.validation = validation


class Abort(Exception):
    """A request aborted with another status (sglang's HTTPException shape)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------- state


class Sim:
    """The state of one simulated server, shared by the main thread and the HTTP threads."""

    def __init__(self, plan: Plan, faults: Faults, state: FaultState, log: Log, recorder: Recorder,
                 token_seconds: float, pd_wait: float = 15.0) -> None:
        self.plan = plan
        self.faults = faults
        self.state = state
        self.log = log
        self.recorder = recorder
        self.token_seconds = token_seconds
        self.pd_wait = pd_wait
        self.vocab: Vocab = plan.model.vocab
        self.lock = threading.Lock()
        self.ready = False
        self.shutting_down = False
        self.bound = False
        self.running = 0
        self.inference_served = 0
        self.num_requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.cache: deque[tuple[int, ...]] = deque(maxlen=256)
        self.startup_time = time.time()
        self.startup_timings: dict[str, Any] = {}
        self.server: SimHTTPServer | None = None
        self.worker_id = f"{plan.args['port']}/{os.getpid()}"
        self.bootstrap: sim_pd.BootstrapState | None = None
        self.prefill_infos = sim_pd.PrefillInfoCache()
        #: the gRPC server and its HTTP sidecar in ``--grpc-mode`` (a ``sim_grpc.GrpcSim``)
        self.grpc: Any = None

    @property
    def mode(self) -> str:
        return self.plan.mode

    def new_id(self) -> str:
        return uuid.uuid4().hex

    def generate(self, prompt_ids: list[int], source_ids: list[int] | None, max_new_tokens: int | None,
                 stop: list[str], ignore_eos: bool, stop_token_ids: list[int] | None = None) -> Generation:
        gen = generate(self.vocab, prompt_ids, prompt_ids if source_ids is None else source_ids, max_new_tokens,
                       stop, ignore_eos, stop_token_ids or ())
        key = tuple(prompt_ids)
        with self.lock:
            best = 0
            for seen in self.cache:
                n = 0
                for a, b in zip(seen, key, strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            cached = min(best, max(len(key) - 1, 0)) // self.plan.page_size * self.plan.page_size
            self.cache.append(key + tuple(gen.output_ids))
            self.num_requests_total += 1
            self.prompt_tokens_total += len(key)
            self.generation_tokens_total += gen.completion_tokens
            self.cached_tokens_total += cached
            running = self.running
        gen.cached_tokens = cached
        self.log.rank0(
            f"Prefill batch, #new-seq: 1, #new-token: {len(key) - cached}, #cached-token: {cached}, "
            f"token usage: 0.00, #running-req: {max(running - 1, 0)}, #queue-req: 0, #pending-token: 0, "
            f"cuda graph: {self.plan.decode_backend != 'disabled'}, input throughput (token/s): 0.00"
        )
        return gen

    def flush_cache(self) -> None:
        with self.lock:
            self.cache.clear()
        self.log.info("Cache flushed successfully!")

    def metrics(self) -> str:
        labels = f'engine_type="unified",model_name="{self.plan.served_model_name}",pp_rank="0",tp_rank="0"'
        with self.lock:
            prompt = self.prompt_tokens_total
            hit = self.cached_tokens_total / prompt if prompt else 0.0
            gauges = [
                ("num_running_reqs", "The number of running requests.", self.running),
                ("num_queue_reqs", "The number of requests in the waiting queue.", 0),
                ("num_used_tokens", "The number of used tokens.", 0),
                ("token_usage", "The token usage.", 0.0),
                ("cache_hit_rate", "The prefix cache hit rate.", hit),
                ("gen_throughput", "The generation throughput (token/s).", 0.0),
                ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                 self.plan.max_total_tokens),
            ]
            counters = [
                ("prompt_tokens", "Number of prefill tokens processed.", prompt),
                ("generation_tokens", "Number of generation tokens processed.", self.generation_tokens_total),
                ("cached_tokens", "Number of cached prompt tokens.", self.cached_tokens_total),
                ("num_requests", "Number of requests processed.", self.num_requests_total),
            ]
        lines: list[str] = []
        for name, doc, value in gauges:
            lines += [f"# HELP sglang:{name} {doc}", f"# TYPE sglang:{name} gauge",
                      f"sglang:{name}{{{labels}}} {float(value)}"]
        for name, doc, value in counters:
            lines += [f"# HELP sglang:{name}_total {doc}", f"# TYPE sglang:{name}_total counter",
                      f"sglang:{name}_total{{{labels}}} {float(value)}"]
        return "\n".join(lines) + "\n"

    def count_inference(self) -> bool:
        """Count a served inference request; True when ``die_after`` says this one was the last."""
        die_after = self.state.snapshot().die_after
        with self.lock:
            self.inference_served += 1
            return die_after is not None and self.inference_served >= die_after

    def die(self) -> NoReturn:
        n = self.state.snapshot().die_after
        self.log.error(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            f'  File "{SITE}/sglang/srt/managers/scheduler.py", line 6368, in run_scheduler_process\n'
            "    scheduler.run_event_loop()\n"
            f'  File "{SITE}/sglang/srt/managers/scheduler.py", line 2109, in event_loop_overlap\n'
            "    batch_result = self.run_batch(batch)\n"
            f"RuntimeError: simulated death after {n} requests ({ENV_FAULT}=die_after={n})\n",
        )
        self.log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        kill_self()


def kill_self() -> NoReturn:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - SIGKILL is not deliverable late
        time.sleep(1)


# ---------------------------------------------------------------------------------------------- HTTP plumbing


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # an idle keep-alive connection must not hold up the shutdown
    request_queue_size = 2048

    def __init__(self, address: tuple[str, int], sim: Sim) -> None:
        self.sim = sim
        super().__init__(address, Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(host), a reverse DNS lookup: skip it.
        import socketserver

        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class SimHTTPServer6(SimHTTPServer):
    address_family = socket.AF_INET6


class _Trickle:
    """A write-through file that, while ``delay`` > 0, writes one byte every ``delay`` seconds."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.delay = 0.0

    def write(self, data: bytes) -> int:
        if self.delay <= 0:
            return int(self.raw.write(data))
        for i in range(len(data)):
            self.raw.write(data[i:i + 1])
            self.raw.flush()
            time.sleep(self.delay)
        return len(data)

    def flush(self) -> None:
        self.raw.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _num(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_stop_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise BadRequest("1 validation error:\n  stop: Input should be a valid string or a list of strings",
                     validation=True)


def _int_field(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"1 validation error:\n  {name}: Input should be a valid integer, got {value!r}",
                         validation=True)
    return value


def verify_sampling(params: dict[str, Any], vocab_size: int, *, as_float: bool) -> None:
    """sglang's ``SamplingParams.verify`` (same order, same messages); ``as_float``: the OpenAI endpoints,
    whose pydantic models hold floats (``got -1.0.``), where ``/generate`` keeps the JSON value (``got -1.``)."""

    def shown(value: Any) -> Any:
        return float(value) if as_float and _num(value) else value

    temperature = params.get("temperature", 1.0)
    if temperature is not None and (not _num(temperature) or temperature != temperature
                                    or abs(temperature) == float("inf") or temperature < 0):
        raise BadRequest(f"temperature must be a non-negative finite number, got {shown(temperature)}.")
    top_p = params.get("top_p", 1.0)
    if top_p is not None and _num(top_p) and not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {shown(top_p)}.")
    min_p = params.get("min_p", 0.0)
    if min_p is not None and _num(min_p) and not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {shown(min_p)}.")
    top_k = params.get("top_k", -1)
    if top_k is not None and _num(top_k) and top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = params.get(name, 0.0)
        if value is not None and _num(value) and not -2.0 <= value <= 2.0:
            raise BadRequest(f"{name} must be in [-2, 2], got {shown(value)}.")
    repetition = params.get("repetition_penalty", 1.0)
    if repetition is not None and _num(repetition) and not 0.0 < repetition <= 2.0:
        raise BadRequest(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {shown(repetition)}.")
    min_new = params.get("min_new_tokens", 0) or 0
    if _num(min_new) and min_new < 0:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    max_new = params.get("max_new_tokens")
    if _num(max_new):
        if max_new < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
        if _num(min_new) and min_new > max_new:
            raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for token_id in bias:
            try:
                token = int(token_id)
            except (TypeError, ValueError):
                raise BadRequest(f"invalid literal for int() with base 10: {token_id!r}") from None
            if not 0 <= token < vocab_size:
                raise BadRequest(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")


# ---------------------------------------------------------------------------------------------- handler


class Handler(BaseHTTPRequestHandler):
    # Headers and body go out as separate writes: without TCP_NODELAY each response with a body stalls
    # ~40 ms on loopback (Nagle + delayed ACK), as uvicorn does not.
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    wfile: Any
    raw_requestline: bytes

    # ------------------------------------------------------------------ plumbing

    @property
    def sim(self) -> Sim:
        server = self.server
        assert isinstance(server, SimHTTPServer)
        return server.sim

    def setup(self) -> None:
        super().setup()
        self._trickle = _Trickle(self.wfile)
        self.wfile = self._trickle

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = int(code) if str(code).isdigit() else 0
        phrase = _PHRASES.get(status) or self.responses.get(status, ("",))[0]
        host, port = self.client_address[:2]
        line = self.requestline.replace("PRI * ", "PRI %2A ")
        self.sim.log.uvicorn("INFO", f'{host}:{port} - "{line}" {code} {phrase}')

    def end_headers(self) -> None:
        self.send_header(WORKER_HEADER, self.sim.worker_id)
        super().end_headers()

    def parse_request(self) -> bool:
        # The router's HTTP/2 probe, "PRI * HTTP/2.0" then "SM": uvicorn answers the first line as a request
        # for the path "*" (404) and the "SM" line as an invalid request (400, connection closed).
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        if line == "PRI * HTTP/2.0":
            self.command, self.path, self.request_version = "PRI", "*", "HTTP/1.1"
            self.requestline = line
            self.close_connection = False
            self.headers = self.MessageClass()
            while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
            self._json(404, {"detail": "Not Found"})
            rest = self.rfile.readline(65537)
            if rest.strip() == b"SM":
                self.rfile.readline(65537)
                self.sim.log.uvicorn("WARNING", "Invalid HTTP request received.")
                body = b"Invalid HTTP request received."
                self.wfile.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
            self.wfile.flush()
            self.close_connection = True
            return False
        return super().parse_request()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size_line = self.rfile.readline(65537)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, body: bytes, content_type: str | None = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _openai_error(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        self._json(status, {"object": "error", "message": message, "type": kind, "param": None, "code": status})

    def _bad(self, exc: BadRequest, *, openai: bool) -> None:
        if exc.validation:
            self._openai_error(400, str(exc), "Bad Request")
        elif openai:
            self._openai_error(400, str(exc))
        else:
            self._json(400, {"error": {"message": str(exc)}})
        self.sim.log.error(f"[http_server] Error: {exc}")

    def _abort(self, exc: Abort) -> None:
        self._openai_error(exc.status, str(exc), str(exc.status))

    def _stream(self, events: Iterator[Any]) -> None:
        """Server-sent events, chunked: ``data: {json}\\n\\n`` per event, then ``data: [DONE]\\n\\n``."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        for event in events:
            chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _authorized(self, path: str) -> bool:
        key = self.sim.state.api_key()
        if not key or self.command == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics", "/_sim/")):
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and token == key

    # ------------------------------------------------------------------ dispatch

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def _routes(self) -> dict[str, tuple[tuple[str, ...], Callable[[bytes], None]]]:
        routes: dict[str, tuple[tuple[str, ...], Callable[[bytes], None]]] = {
            "/health": (("GET",), self._health),
            "/health_generate": (("GET",), self._health),
            "/ready": (("GET",), self._ready),
            "/ping": (("GET",), self._ping),
            "/model_info": (("GET",), self._model_info),
            "/get_model_info": (("GET",), self._model_info),
            "/server_info": (("GET",), self._server_info),
            "/get_server_info": (("GET",), self._server_info),
            "/v1/models": (("GET",), self._models),
            "/generate": (("POST", "PUT"), self._generate),
            "/v1/chat/completions": (("POST",), self._chat),
            "/v1/completions": (("POST",), self._completions),
            "/v1/responses": (("POST",), self._responses),
            "/v1/embeddings": (("POST",), self._embeddings),
            "/encode": (("POST", "PUT"), self._encode),
            "/v1/score": (("POST",), self._score),
            "/tokenize": (("POST",), self._tokenize),
            "/detokenize": (("POST",), self._detokenize),
            "/flush_cache": (("GET", "POST"), self._flush_cache),
            CONTROL_PATH: (("GET", "POST"), self._control),
        }
        if self.sim.plan.args["enable_metrics"]:
            routes["/metrics"] = (("GET",), self._metrics)
        return routes

    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0]
        sim = self.sim
        control = path.startswith("/_sim/")
        faults = sim.state.snapshot()
        self._trickle.delay = 0.0 if control else faults.trickle
        if not self._authorized(path):
            self._drain()
            self._json(401, {"error": "Unauthorized"})
            return
        if faults.max_payload is not None and not control:
            length = int(self.headers.get("Content-Length") or 0)
            if length > faults.max_payload:
                if length <= _DISCARD_LIMIT:
                    self._drain()
                self.close_connection = True
                self._openai_error(413, f"Request body of {length} bytes exceeds the limit of {faults.max_payload} "
                                        f"bytes ({ENV_FAULT} max_payload={faults.max_payload})", "413")
                return
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            self._json(400, {"detail": "Invalid request body"})
            return
        if faults.max_payload is not None and not control and len(body) > faults.max_payload:
            self._openai_error(413, f"Request body of {len(body)} bytes exceeds the limit of {faults.max_payload} "
                                    f"bytes ({ENV_FAULT} max_payload={faults.max_payload})", "413")
            return
        routes = self._routes()
        route = routes.get(path)
        if route is None and path.startswith("/v1/models/") and self.command == "GET":
            route = (("GET",), self._model_card)
        if route is None:
            self._json(404, {"detail": "Not Found"})
            return
        methods, handler = route
        if self.command not in methods:
            self._json(405, {"detail": "Method Not Allowed"})
            return
        inference = path in INFERENCE_PATHS
        if inference:
            with sim.lock:
                sim.running += 1
        try:
            if inference and not self._request_faults(faults):
                return
            handler(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        finally:
            if inference:
                with sim.lock:
                    sim.running -= 1
        if inference and sim.count_inference():
            sim.die()

    def _drain(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if 0 < length <= _DISCARD_LIMIT:
                self.rfile.read(length)
        except (ValueError, OSError):
            self.close_connection = True

    def _request_faults(self, faults: Any) -> bool:
        """Latency, hangs and failures of an inference request; False when it was answered (or never is)."""
        sim = self.sim
        if faults.latency:
            time.sleep(faults.latency)
        k, verdict, status = sim.state.next_request()
        if verdict == "hang":
            sim.log.info(f"(sim) request {k} hangs ({ENV_FAULT})")
            while not sim.shutting_down:
                time.sleep(0.05)
            self.close_connection = True
            return False
        if verdict == "fail":
            self._openai_error(status, f"simulated failure of request {k} ({ENV_FAULT}: {self._fault_text(faults)})",
                               str(status))
            return False
        return True

    @staticmethod
    def _fault_text(faults: Any) -> str:
        parts = []
        if faults.fail_first:
            parts.append(f"fail_first={faults.fail_first}")
        if faults.fail_rate:
            parts.append(f"fail_rate={faults.fail_rate}")
        if faults.status is not None:
            parts.append(f"status={faults.status}")
        return ",".join(parts)

    # ------------------------------------------------------------------ control

    def _control(self, body: bytes) -> None:
        sim = self.sim
        if self.command == "POST":
            try:
                sim.state.update(json.loads(body or b"{}"))
            except ValueError as exc:  # FaultError is a ValueError, and so is bad JSON
                message = str(exc) if isinstance(exc, FaultError) else f"POST {CONTROL_PATH}: invalid JSON: {exc}"
                self._json(400, {"error": message, "known": known_faults()})
                return
            sim.log.info(f"(sim) request faults set: {json.dumps(sim.state.snapshot().as_dict())}")
        self._json(200, {"worker": sim.worker_id, **sim.state.describe(), "served": sim.inference_served,
                         "known": known_faults()})

    # ------------------------------------------------------------------ health and info

    def _health(self, body: bytes) -> None:
        sim = self.sim
        faults = sim.state.snapshot()
        if faults.slow_health:
            time.sleep(faults.slow_health)
        if sim.shutting_down:
            sim.log.info("Health check request received during shutdown. Returning 503.")
        ok = sim.ready and not sim.shutting_down and not sim.state.health_failing()
        self._send(200 if ok else 503, b"", None)

    def _ready(self, body: bytes) -> None:
        # The health faults (slow_health, health_fail*) apply to every health endpoint, /ready included.
        sim = self.sim
        faults = sim.state.snapshot()
        if faults.slow_health:
            time.sleep(faults.slow_health)
        ok = sim.ready and not sim.shutting_down and not sim.state.health_failing()
        self._send(200 if ok else 503, b"", None)

    def _ping(self, body: bytes) -> None:
        self._send(200, b"", None)

    def _deprecated(self, old: str, new: str) -> None:
        self.sim.log.warning(
            f"Endpoint '{old}' is deprecated and will be removed in a future version. Please use '{new}' instead."
        )

    def _model_info(self, body: bytes) -> None:
        if self.path.startswith("/get_"):
            self._deprecated("/get_model_info", "/model_info")
        plan = self.sim.plan
        self._json(200, {
            "model_path": plan.args["model_path"],
            "served_model_name": plan.served_model_name,
            "tokenizer_path": plan.args["tokenizer_path"],
            "is_generation": not plan.is_embedding,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": plan.args.get("reasoning_parser"),
            "tool_call_parser": plan.args.get("tool_call_parser"),
            "disaggregation_mode": plan.mode,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": plan.model.model_type or plan.facts.model_type,
            "architectures": [plan.model.architecture or plan.facts.architecture],
            "embedding": {**(_EMBEDDING_ON if plan.is_embedding else _EMBEDDING_OFF), "bcg": {
                "prefill_backend": plan.prefill_backend, "enabled": plan.prefill_backend != "disabled",
                "capture_token_budget": plan.prefill_buckets[-1] if plan.prefill_buckets else 0,
                "capture_batch_sizes": list(plan.prefill_buckets)},
                "cache": {"kv_cache_disabled": False,
                          "radix_cache_disabled": bool(plan.args.get("disable_radix_cache")),
                          "chunked_prefill_disabled": plan.chunked_prefill_size <= 0}},
        })

    def server_info(self) -> dict[str, Any]:
        sim = self.sim
        plan = sim.plan
        args = {k: v for k, v in plan.args.items() if k not in _NOT_IN_SERVER_INFO}
        info = {**args, **_SERVER_INFO_FIELDS}
        mem = {"weight": round(plan.weights, 3), "kvcache": round(plan.max_total_tokens * plan.kv_bytes_per_token
                                                                  / 2**30, 3),
               "startup_available": round(plan.avail_before, 3), "token_capacity": plan.max_total_tokens,
               "token_capacity_swa": None,
               "graph": {"prefill": 0.0, "decode": 0.0, "target_verify": 0.0, "draft_prefill": 0.0,
                         "draft_decode": 0.0, "draft_extend": 0.0}}
        internal = {**{k: v for k, v in info.items() if k not in ("custom_sigquit_handler", "kv_events")},
                    "startup_time": dict(sim.startup_timings), "decode_cuda_graph_bs": [],
                    "decode_cuda_graph_memory_gb": 0.0,
                    "effective_max_running_requests_per_dp": plan.max_running_requests, "last_gen_throughput": 0.0,
                    "memory_usage": mem, "world_size": plan.args["tp_size"]}
        info.update(
            internal_states=[internal],
            max_total_num_tokens=plan.max_total_tokens,
            max_req_input_len=plan.max_req_input_len,
            startup_time=dict(sim.startup_timings),
            launch_command=" ".join(plan.args.get("_argv") or []),
            hicache_object_layout={"enabled": False, "backend": None, "page_size": plan.page_size,
                                   "hicache_object_layout": {"pools": []},
                                   "reason": "Hierarchical cache is disabled"},
            status="ready" if sim.ready else "starting",
            version=VERSION,
            frontend="python",
        )
        info.pop("_argv", None)
        internal.pop("_argv", None)
        return info

    def _server_info(self, body: bytes) -> None:
        if self.path.startswith("/get_"):
            self._deprecated("/get_server_info", "/server_info")
        self._json(200, self.server_info())

    def _model_card(self, body: bytes) -> None:
        name = self.path.split("?", 1)[0][len("/v1/models/"):]
        if name != self.sim.plan.served_model_name:
            self._json(404, {"error": {"message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                                       "param": "model", "code": "model_not_found"}})
            return
        self._json(200, self._card())

    def _card(self) -> dict[str, Any]:
        plan = self.sim.plan
        return {"id": plan.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": plan.served_model_name, "parent": None, "max_model_len": plan.context_len}

    def _models(self, body: bytes) -> None:
        self._json(200, {"object": "list", "data": [self._card()]})

    def _flush_cache(self, body: bytes) -> None:
        self.sim.flush_cache()
        self._send(200, b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        b"waiting requests, the operation will not be performed.)\n", None)

    def _metrics(self, body: bytes) -> None:
        self._send(200, self.sim.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ request parsing

    def _parse_json(self, body: bytes, *, require_json_type: bool, endpoint: str) -> dict[str, Any]:
        if require_json_type:
            media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                detail = "Unsupported Media Type: Only 'application/json' is allowed"
                raise BadRequest(f"1 validation error:\n  {{'loc': ['header', 'content-type'], 'msg': \"{detail}\", "
                                 f"'type': 'value_error'}} [{{'loc': ['header', 'content-type'], 'msg': \"{detail}\", "
                                 "'type': 'value_error'}]", validation=True)
        try:
            obj = json.loads(body or b"null")
        except ValueError as exc:
            pos, msg = getattr(exc, "pos", 0), getattr(exc, "msg", str(exc))
            raise BadRequest(f"1 validation error:\n  {{'type': 'json_invalid', 'loc': ('body', {pos}), 'msg': "
                             f"'JSON decode error', 'input': {{}}, 'ctx': {{'error': {msg!r}}}}}\n\n"
                             f"    POST {endpoint}", validation=True) from None
        if not isinstance(obj, dict) and not (endpoint == "/generate" and obj is None):
            raise BadRequest(f"1 validation error:\n  {{'type': 'model_attributes_type', 'loc': ('body',), 'msg': "
                             f"'Input should be a valid dictionary or object to extract fields from'}}\n\n"
                             f"    POST {endpoint}", validation=True)
        return obj if isinstance(obj, dict) else {}

    @staticmethod
    def _missing(field: str, endpoint: str, req: dict[str, Any]) -> BadRequest:
        return BadRequest(f"1 validation error:\n  {{'type': 'missing', 'loc': ('body', {field!r}), 'msg': "
                          f"'Field required', 'input': {req!r}}}\n\n    POST {endpoint}", validation=True)

    def _check_length(self, ids: list[int], max_new_tokens: Any) -> None:
        """sglang's input-length checks: the tokenizer manager's (context length, then input + max new tokens),
        then the scheduler's (``max_req_input_len``)."""
        plan = self.sim.plan
        n, context = len(ids), plan.context_len
        if n >= context:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({context} tokens).")
        if _num(max_new_tokens) and max_new_tokens + n > context:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {max_new_tokens + n} tokens: {n} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.")
        if n >= plan.max_req_input_len:
            raise BadRequest(f"Input length ({n} tokens) exceeds the maximum allowed length ({plan.max_req_input_len} "
                             "tokens). Use a shorter input or enable --allow-auto-truncate.")

    def _not_generation(self) -> None:
        if self.sim.plan.is_embedding:
            raise BadRequest("This model is served with --is-embedding and does not generate; use /encode or "
                             "/v1/embeddings (sglang 0.5.23 itself crashes its scheduler on this request)")

    def _pd(self, req: dict[str, Any], rid: str, gen: Generation | None = None) -> None:
        """The PD checks and handshake of one request (nothing in a plain server); raises BadRequest/Abort."""
        sim = self.sim
        mode = sim.mode
        if mode == "null":
            return
        room = req.get("bootstrap_room")
        host = req.get("bootstrap_host")
        fake = sim.plan.args.get("disaggregation_transfer_backend") == "fake" or host == sim_pd.FAKE_BOOTSTRAP_HOST
        if isinstance(room, list):
            room = room[0] if room else None
        if isinstance(host, list):
            host = host[0] if host else None
        if room is None and not fake:
            message = f"Invalid request: Disaggregated request received without bootstrap room id. req.rid={rid!r}"
            sim.log.rank0(message, level=40)
            raise BadRequest(message)
        if fake or room is None:
            return
        if not isinstance(room, int) or isinstance(room, bool):
            raise BadRequest(f"1 validation error:\n  bootstrap_room: Input should be a valid integer, got {room!r}",
                             validation=True)
        port = req.get("bootstrap_port")
        if isinstance(port, list):
            port = port[0] if port else None
        try:
            if mode == "decode":
                sim_pd.decode_handshake(sim.prefill_infos, str(host), int(port or 8998), room, rid, sim.pd_wait,
                                        sim.log)
            elif sim.bootstrap is not None:
                info = {"prompt_tokens": gen.prompt_tokens if gen else 0,
                        "first_token": gen.output_ids[0] if gen and gen.output_ids else None}
                sim_pd.prefill_handshake(sim.bootstrap, room, rid, info, sim.pd_wait)
        except sim_pd.PDError as exc:
            sim.log.rank0(str(exc), level=40)
            raise Abort(str(exc), exc.status) from None

    def _pace(self, tokens: int) -> None:
        if self.sim.token_seconds and tokens:
            time.sleep(self.sim.token_seconds * tokens)

    # ------------------------------------------------------------------ /generate

    def _generate(self, body: bytes) -> None:
        sim = self.sim
        rid = sim.new_id()
        try:
            req = self._parse_json(body, require_json_type=False, endpoint="/generate")
            self._not_generation()
            prompts, batch = self._generate_prompts(req)
            params = req.get("sampling_params") or {}
            if isinstance(params, list):
                params = params[0] if params and isinstance(params[0], dict) else {}
            if not isinstance(params, dict):
                raise BadRequest("1 validation error:\n  sampling_params: Input should be a valid dictionary",
                                 validation=True)
            for ids in prompts:
                self._check_length(ids, params.get("max_new_tokens"))
            verify_sampling(params, sim.vocab.vocab_size, as_float=False)
            max_new = _int_field(params.get("max_new_tokens", 128), "max_new_tokens")
            stop = _as_stop_list(params.get("stop"))
            ignore_eos = bool(params.get("ignore_eos", False))
            stop_ids = params.get("stop_token_ids") if isinstance(params.get("stop_token_ids"), list) else None
            n = params.get("n", 1) if _num(params.get("n", 1)) else 1
            if n > 1 and not batch:
                prompts, batch = prompts * int(n), True
            return_logprob = bool(req.get("return_logprob", False))
            top_n = int(req.get("top_logprobs_num") or 0)
            start_len = req.get("logprob_start_len")
            start_len = -1 if start_len is None else int(start_len)
            with_text = bool(req.get("return_text_in_logprobs", False))
            gens = [sim.generate(ids, None, max_new, stop, ignore_eos, stop_ids) for ids in prompts]
            self._pd(req, rid, gens[0])
        except BadRequest as exc:
            self._bad(exc, openai=False)
            return
        except Abort as exc:
            self._abort(exc)
            return
        started = time.perf_counter()
        lp = (return_logprob, top_n, start_len, with_text)
        if sim.mode == "prefill":  # the prefill side stops after its first token (sglang: FINISH_LENGTH(0))
            for gen in gens:
                gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
                gen.finish = {"type": "length", "length": 0}
        if req.get("stream"):
            self._stream(self._generate_events(gens, batch, started, lp, rid))
            return
        outs = []
        for gen in gens:
            self._pace(gen.completion_tokens)
            outs.append(self._generate_out(gen, gen.completion_tokens, started, lp, rid if len(gens) == 1 else None,
                                           final=True))
        self._json(200, outs if batch else outs[0])

    def _generate_prompts(self, req: dict[str, Any]) -> tuple[list[list[int]], bool]:
        """The prompts as token ids, and whether the request is a batch."""
        vocab = self.sim.vocab
        text, ids = req.get("text"), req.get("input_ids")
        if text is not None:
            if isinstance(text, str):
                return [vocab.encode(text)], False
            if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                return [vocab.encode(t) for t in text], True
            raise BadRequest("1 validation error:\n  text: Input should be a valid string or a list of strings",
                             validation=True)
        if ids is not None:
            if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                return [list(ids)], False
            if (isinstance(ids, list) and ids
                    and all(isinstance(row, list) and all(isinstance(i, int) for i in row) for row in ids)):
                return [list(row) for row in ids], True
            raise BadRequest("1 validation error:\n  input_ids: Input should be a list of token ids or a list of such "
                             "lists", validation=True)
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")

    def _generate_out(self, gen: Generation, k: int, started: float, lp: tuple[bool, int, int, bool],
                      rid: str | None, *, final: bool) -> dict[str, Any]:
        sim = self.sim
        return_logprob, top_n, start_len, with_text = lp
        meta: dict[str, Any] = {
            "id": rid or sim.new_id(),
            "finish_reason": gen.finish if final else None,
            "prompt_tokens": gen.prompt_tokens,
            "weight_version": "default",
            "num_retractions": 0,
        }
        if return_logprob:
            probs = logprobs(sim.vocab, gen, start_len=start_len, top_n=top_n, with_text=with_text,
                             input_side=sim.mode != "decode")
            meta["input_token_logprobs"] = probs.input_token
            meta["output_token_logprobs"] = probs.output_token[:k]
            meta["output_token_logprobs_length"] = k
            if top_n > 0:
                meta["input_top_logprobs"] = probs.input_top
                meta["output_top_logprobs"] = probs.output_top[:k]
        meta.update(reasoning_tokens=0, completion_tokens=k, cached_tokens=gen.cached_tokens)
        if final:
            meta["weight_versions"] = [{"version": "default", "start": 0, "end": k}]
        meta["cached_tokens_details"] = {"device": gen.cached_tokens, "host": 0} if gen.cached_tokens else None
        meta["dp_rank"] = None
        if final:
            meta["e2e_latency"] = time.perf_counter() - started
        else:
            meta["response_sent_to_client_ts"] = time.time()
        return {"text": gen.texts[k - 1] if k else "", "output_ids": gen.output_ids[:k], "meta_info": meta}

    def _generate_events(self, gens: list[Generation], batch: bool, started: float,
                         lp: tuple[bool, int, int, bool], rid: str) -> Iterator[dict[str, Any]]:
        for index, gen in enumerate(gens):
            request_id = rid if len(gens) == 1 else self.sim.new_id()
            n = gen.completion_tokens
            for k in range(1, max(n, 1) + 1):
                self._pace(1)
                out = self._generate_out(gen, min(k, n), started, lp, request_id, final=k >= n)
                if batch:
                    out["index"] = index
                yield out

    # ------------------------------------------------------------------ OpenAI

    @staticmethod
    def _usage(prompt: int, completion: int, *, details: bool = True) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion}
        if details:
            usage["prompt_tokens_details"] = None
        usage["reasoning_tokens"] = 0
        if details:
            usage["completion_tokens_details"] = None
        return usage

    def _openai_params(self, req: dict[str, Any]) -> tuple[int | None, list[str], bool, int]:
        max_tokens = _int_field(req.get("max_completion_tokens"), "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int_field(req.get("max_tokens"), "max_tokens")
        n = req.get("n", 1)
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequest(f"1 validation error:\n  n: Input should be greater than or equal to 1, got {n!r}",
                             validation=True)
        return max_tokens, _as_stop_list(req.get("stop")), bool(req.get("ignore_eos", False)), n

    def _openai_sampling(self, req: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
        params = {k: req[k] for k in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                                      "presence_penalty", "repetition_penalty", "logit_bias") if req.get(k) is not None}
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        return params

    def _chat(self, body: bytes) -> None:
        sim = self.sim
        rid = sim.new_id()
        try:
            req = self._parse_json(body, require_json_type=True, endpoint="/v1/chat/completions")
            if "messages" not in req:
                raise self._missing("messages", "/v1/chat/completions", req)
            messages = req["messages"]
            if not isinstance(messages, list):
                raise BadRequest("1 validation error:\n  messages: Input should be a valid list", validation=True)
            if not messages:
                raise BadRequest("Messages cannot be empty.")
            if not all(isinstance(m, dict) and "role" in m for m in messages):
                raise BadRequest("1 validation error:\n  messages: each message must be an object with a role",
                                 validation=True)
            self._not_generation()
            max_tokens, stop, ignore_eos, n = self._openai_params(req)
            if sim.vocab.real:
                prompt = sim.vocab.encode(render_chat(messages, sim.plan.model.chat_template), add_special_tokens=False)
                source = sim.vocab.encode(" ".join(message_text(m) for m in messages), add_special_tokens=False)
            else:
                prompt = sim.vocab.encode(" ".join(message_text(m) for m in messages))
                source = prompt
            self._check_length(prompt, max_tokens)
            verify_sampling(self._openai_sampling(req, max_tokens), sim.vocab.vocab_size, as_float=True)
            want_logprobs = bool(req.get("logprobs"))
            top_n = int(req.get("top_logprobs") or 0)
            gens = [sim.generate(prompt, source, max_tokens, stop, ignore_eos) for _ in range(n)]
            self._pd(req, rid, gens[0])
        except BadRequest as exc:
            self._bad(exc, openai=True)
            return
        except Abort as exc:
            self._abort(exc)
            return
        if sim.mode == "prefill":
            for gen in gens:
                gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
        model = req.get("model") or sim.plan.served_model_name
        created = int(time.time())
        usage = self._usage(gens[0].prompt_tokens, sum(g.completion_tokens for g in gens))
        if req.get("stream"):
            options = req.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            self._stream(self._chat_events(gens, rid, created, model, usage if include_usage else None,
                                           want_logprobs, top_n))
            return
        self._pace(max(g.completion_tokens for g in gens))
        choices = []
        for index, gen in enumerate(gens):
            reason, matched = gen.openai_finish()
            probs = None
            if want_logprobs:
                probs = {"content": [openai_chat_logprob(sim.vocab, gen, k, top_n) for k in range(gen.completion_tokens)
                                     if gen.output_ids[k] != sim.vocab.eos_token_id or gen.finish["type"] != "stop"]}
            choices.append({"index": index, "message": {"role": "assistant", "content": gen.text,
                                                        "reasoning_content": None},
                            "logprobs": probs, "finish_reason": reason, "matched_stop": matched})
        self._json(200, {"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": usage,
                         "metadata": {"weight_version": "default", "weight_versions": [
                             {"version": "default", "start": 0, "end": gens[0].completion_tokens}]}})

    def _chat_events(self, gens: list[Generation], rid: str, created: int, model: str, usage: dict[str, Any] | None,
                     want_logprobs: bool, top_n: int) -> Iterator[dict[str, Any]]:
        def chunk(index: int, delta: dict[str, Any], probs: Any = None, reason: str | None = None,
                  matched: Any = None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": probs, "finish_reason": reason,
                                 "matched_stop": matched}]}

        vocab = self.sim.vocab
        for index, gen in enumerate(gens):
            yield chunk(index, {"reasoning_content": None, "role": "assistant", "content": ""})
            for k, text in enumerate(gen.deltas()):
                if gen.finish["type"] == "stop" and k == gen.completion_tokens - 1 \
                        and gen.output_ids[k] == vocab.eos_token_id:
                    continue
                self._pace(1)
                probs = {"content": [openai_chat_logprob(vocab, gen, k, top_n)]} if want_logprobs else None
                yield chunk(index, {"reasoning_content": None, "content": text}, probs)
            reason, matched = gen.openai_finish()
            yield chunk(index, {"reasoning_content": None}, None, reason, matched)
        if usage is not None:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                   "usage": usage}

    def _completion_prompts(self, raw: Any, req: dict[str, Any]) -> list[tuple[str, list[int]]]:
        vocab = self.sim.vocab
        if isinstance(raw, str):
            return [(raw, vocab.encode(raw))]
        if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
            return [(p, vocab.encode(p)) for p in raw]
        if isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
            return [(vocab.decode(raw, skip_special_tokens=False), list(raw))]
        if isinstance(raw, list) and raw and all(isinstance(r, list) and all(isinstance(i, int) for i in r)
                                                 for r in raw):
            return [(vocab.decode(r, skip_special_tokens=False), list(r)) for r in raw]
        raise BadRequest("1 validation error:\n  prompt: Input should be a string, a list of strings, or token ids",
                         validation=True)

    def _completions(self, body: bytes) -> None:
        sim = self.sim
        rid = sim.new_id()
        try:
            req = self._parse_json(body, require_json_type=True, endpoint="/v1/completions")
            if "prompt" not in req:
                raise self._missing("prompt", "/v1/completions", req)
            self._not_generation()
            prompts = self._completion_prompts(req["prompt"], req)
            max_tokens, stop, ignore_eos, n = self._openai_params(req)
            if max_tokens is None:
                max_tokens = 16  # the OpenAI completions default
            for _, ids in prompts:
                self._check_length(ids, max_tokens)
            verify_sampling(self._openai_sampling(req, max_tokens), sim.vocab.vocab_size, as_float=True)
            echo = bool(req.get("echo", False))
            top = req.get("logprobs")
            want_logprobs = top is not None and top is not False
            top_n = int(top) if _num(top) else 0
            gens: list[tuple[str, Generation]] = []
            for text, ids in prompts:
                for _ in range(n):
                    gens.append((text, sim.generate(ids, None, max_tokens, stop, ignore_eos)))
            self._pd(req, rid, gens[0][1])
        except BadRequest as exc:
            self._bad(exc, openai=True)
            return
        except Abort as exc:
            self._abort(exc)
            return
        if sim.mode == "prefill":
            for _, gen in gens:
                gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
        model = req.get("model") or sim.plan.served_model_name
        created = int(time.time())
        usage = self._usage(sum(g.prompt_tokens for _, g in gens[::n]), sum(g.completion_tokens for _, g in gens))
        if req.get("stream"):
            options = req.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            stream_usage = self._usage(usage["prompt_tokens"], usage["completion_tokens"], details=False)
            self._stream(self._completion_events(gens, echo, rid, created, model,
                                                 stream_usage if include_usage else None, want_logprobs, top_n))
            return
        self._pace(max(g.completion_tokens for _, g in gens))
        choices = []
        for index, (text, gen) in enumerate(gens):
            reason, matched = gen.openai_finish()
            out = text + gen.text if echo else gen.text
            probs = openai_completion_logprobs(sim.vocab, gen, top_n, echo=echo) if want_logprobs else None
            choices.append({"index": index, "text": out, "logprobs": probs, "finish_reason": reason,
                            "matched_stop": matched})
        self._json(200, {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage,
                         "metadata": {"weight_version": "default", "weight_versions": [
                             {"version": "default", "start": 0, "end": gens[0][1].completion_tokens}]}})

    def _completion_events(self, gens: list[tuple[str, Generation]], echo: bool, rid: str, created: int, model: str,
                           usage: dict[str, Any] | None, want_logprobs: bool,
                           top_n: int) -> Iterator[dict[str, Any]]:
        def chunk(index: int, text: str, probs: Any, reason: str | None = None, matched: Any = None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": probs, "finish_reason": reason,
                                 "matched_stop": matched}], "usage": None}

        vocab = self.sim.vocab
        for index, (text, gen) in enumerate(gens):
            deltas = gen.deltas() or [""]
            reason, matched = gen.openai_finish()
            for k, delta in enumerate(deltas):
                self._pace(1)
                last = k == len(deltas) - 1
                if echo and k == 0:
                    delta = text + delta
                probs = (openai_completion_logprobs(vocab, gen, top_n, echo=False, indices=[k])
                         if want_logprobs and gen.output_ids else None)
                yield chunk(index, delta, probs, reason if last else None, matched if last else None)
        if usage is not None:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage}

    def _responses(self, body: bytes) -> None:
        sim = self.sim
        try:
            req = self._parse_json(body, require_json_type=True, endpoint="/v1/responses")
            if "input" not in req:
                raise self._missing("input", "/v1/responses", req)
            self._not_generation()
            raw = req["input"]
            if isinstance(raw, str):
                messages = [{"role": "user", "content": raw}]
            elif isinstance(raw, list):
                messages = [m for m in raw if isinstance(m, dict)]
            else:
                raise BadRequest("1 validation error:\n  input: Input should be a string or a list", validation=True)
            if req.get("instructions"):
                messages = [{"role": "system", "content": str(req["instructions"])}, *messages]
            max_tokens = _int_field(req.get("max_output_tokens"), "max_output_tokens")
            if sim.vocab.real:
                prompt = sim.vocab.encode(render_chat(messages, sim.plan.model.chat_template), add_special_tokens=False)
                source = sim.vocab.encode(" ".join(message_text(m) for m in messages), add_special_tokens=False)
            else:
                prompt = source = sim.vocab.encode(" ".join(message_text(m) for m in messages))
            self._check_length(prompt, max_tokens)
            verify_sampling(self._openai_sampling(req, max_tokens), sim.vocab.vocab_size, as_float=True)
            gen = sim.generate(prompt, source, max_tokens, [], False)
        except BadRequest as exc:
            if exc.validation:
                self._json(400, {"error": {"message": str(exc), "type": "Bad Request", "param": None, "code": 400}})
            else:
                self._openai_error(400, str(exc))
            return
        self._pace(gen.completion_tokens)
        status = "completed" if gen.finish["type"] == "stop" else "incomplete"
        self._json(200, {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": req.get("model") or sim.plan.served_model_name,
            "output": [{"id": f"msg_{uuid.uuid4().hex}", "content": [
                {"annotations": [], "text": gen.text, "type": "output_text", "logprobs": None}],
                "role": "assistant", "status": "completed", "type": "message"}],
            "status": status,
            "usage": {"input_tokens": gen.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": gen.prompt_tokens + gen.completion_tokens},
            "parallel_tool_calls": True, "tool_choice": req.get("tool_choice", "auto"), "tools": [],
            "error": None, "incomplete_details": None, "instructions": req.get("instructions"),
            "max_output_tokens": max_tokens, "previous_response_id": req.get("previous_response_id"),
            "reasoning": None, "store": req.get("store", True), "temperature": req.get("temperature"),
            "text": {"format": {"type": "text"}}, "top_p": req.get("top_p"), "truncation": req.get("truncation"),
            "user": req.get("user"), "metadata": req.get("metadata"),
        })

    # ------------------------------------------------------------------ embeddings, score, tokens

    _NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. Please add `--is-embedding` "
                      "when launching the server or try another model.")

    def _embed_inputs(self, raw: Any) -> list[list[int]]:
        vocab = self.sim.vocab
        if isinstance(raw, str):
            if not raw:
                raise BadRequest("Input cannot be empty")
            return [vocab.encode(raw)]
        if isinstance(raw, list) and raw and all(isinstance(t, str) for t in raw):
            if not all(raw):
                raise BadRequest("Input cannot be empty")
            return [vocab.encode(t) for t in raw]
        if isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
            return [list(raw)]
        if isinstance(raw, list) and raw and all(isinstance(r, list) for r in raw):
            return [list(r) for r in raw]
        raise BadRequest("Input cannot be empty")

    def _embeddings(self, body: bytes) -> None:
        sim = self.sim
        plan = sim.plan
        try:
            req = self._parse_json(body, require_json_type=True, endpoint="/v1/embeddings")
            if "input" not in req:
                raise self._missing("input", "/v1/embeddings", req)
            if not plan.is_embedding:
                raise BadRequest(self._NOT_EMBEDDING)
            if req.get("dimensions") is not None:
                raise BadRequest(f"Model '{plan.served_model_name}' does not support matryoshka representation, "
                                 "changing output dimensions will lead to poor results.")
            inputs = self._embed_inputs(req["input"])
            for ids in inputs:
                self._check_length(ids, None)
        except BadRequest as exc:
            self._bad(exc, openai=True)
            return
        b64 = req.get("encoding_format") == "base64"
        data = []
        for index, ids in enumerate(inputs):
            vector = embedding(ids, plan.hidden_size)
            data.append({"embedding": embedding_base64(vector) if b64 else vector, "index": index,
                         "object": "embedding"})
        prompt = sum(len(ids) for ids in inputs)
        self._json(200, {"data": data, "model": plan.served_model_name, "object": "list",
                         "usage": self._usage(prompt, 0)})

    def _encode(self, body: bytes) -> None:
        sim = self.sim
        plan = sim.plan
        started = time.perf_counter()
        try:
            req = self._parse_json(body, require_json_type=False, endpoint="/encode")
            prompts, batch = self._generate_prompts(req)
            if not plan.is_embedding:
                raise BadRequest(self._NOT_EMBEDDING)
            for ids in prompts:
                self._check_length(ids, None)
        except BadRequest as exc:
            self._bad(exc, openai=False)
            return
        outs = []
        for ids in prompts:
            outs.append({"embedding": embedding(ids, plan.hidden_size), "meta_info": {
                "id": sim.new_id(), "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                "weight_version": "default", "num_retractions": 0,
                "e2e_latency": time.perf_counter() - started, "response_sent_to_client_ts": time.time()}})
        self._json(200, outs if batch else outs[0])

    def _score(self, body: bytes) -> None:
        sim = self.sim
        try:
            req = self._parse_json(body, require_json_type=True, endpoint="/v1/score")
            self._not_generation()
            query, items = req.get("query"), req.get("items")
            labels = req.get("label_token_ids") or []
            if query is None or items is None:
                raise BadRequest("query and items are required")
            if isinstance(items, str):
                items = [items]
            if not isinstance(labels, list) or not all(isinstance(t, int) for t in labels):
                raise BadRequest("label_token_ids must be a list of token ids")
            for t in labels:
                if not 0 <= t < sim.vocab.vocab_size:
                    raise BadRequest(f"Token ID {t} is out of vocabulary (vocab size: {sim.vocab.vocab_size})")
            item_first = bool(req.get("item_first", False))
            pairs = []
            for item in items:
                q = query if isinstance(query, list) else sim.vocab.encode(str(query))
                it = item if isinstance(item, list) else sim.vocab.encode(str(item))
                pairs.append(list(it) + list(q) if item_first else list(q) + list(it))
        except BadRequest as exc:
            self._bad(exc, openai=True)
            return
        from .tokens import prompt_seed

        softmax = bool(req.get("apply_softmax", False))
        scores = [label_scores(prompt_seed(ids), labels, softmax) for ids in pairs]
        prompt = sum(len(ids) for ids in pairs)
        self._json(200, {"scores": scores, "pooled_hidden_states": None, "token_logprobs": None,
                         "model": req.get("model") or "default", "usage": self._usage(prompt, 0), "object": "scoring"})

    def _tokenize(self, body: bytes) -> None:
        sim = self.sim
        try:
            req = self._parse_json(body, require_json_type=True, endpoint="/tokenize")
            if "prompt" not in req:
                raise self._missing("prompt", "/tokenize", req)
            prompt = req["prompt"]
            add = bool(req.get("add_special_tokens", True))
            if isinstance(prompt, str):
                tokens: Any = sim.vocab.encode(prompt, add_special_tokens=add)
                count: Any = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [sim.vocab.encode(p, add_special_tokens=add) for p in prompt]
                count = [len(t) for t in tokens]
            else:
                raise BadRequest("1 validation error:\n  prompt: Input should be a valid string", validation=True)
        except BadRequest as exc:
            self._bad(exc, openai=True)
            return
        self._json(200, {"tokens": tokens, "count": count, "max_model_len": sim.plan.context_len})

    def _detokenize(self, body: bytes) -> None:
        sim = self.sim
        try:
            req = self._parse_json(body, require_json_type=True, endpoint="/detokenize")
            if "tokens" not in req:
                raise self._missing("tokens", "/detokenize", req)
            tokens = req["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise BadRequest("1 validation error:\n  tokens: Input should be a valid list of integers",
                                 validation=True)
        except BadRequest as exc:
            self._bad(exc, openai=True)
            return
        skip = bool(req.get("skip_special_tokens", True))
        self._json(200, {"text": sim.vocab.decode(tokens, skip_special_tokens=skip)})
