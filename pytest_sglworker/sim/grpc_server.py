"""The simulated engine's gRPC server: sglang 0.5.23's ``--grpc-mode`` (the ``smg-grpc-servicer`` package).

Part of :mod:`pytest_sglworker.sim`, imported only in ``--grpc-mode``: it needs ``grpcio``,
``grpcio-health-checking`` and ``smg-grpc-proto`` (the servicer's own generated stubs), which ``pip install
'pytest-sglworker[grpc]'`` installs; :func:`missing_reason` says what is missing, and the sim then exits with
that one line.

What it serves, as the real servicer does (smg-grpc-servicer 0.14.1 beside sglang 0.5.23 on the CPU):

- on ``--port``: ``sglang.grpc.scheduler.SglangScheduler`` (``Generate`` streamed or not, ``Embed``,
  ``HealthCheck``, ``Abort``, ``GetModelInfo``, ``GetServerInfo``, ``GetLoads``, ``FlushCache``; the rest
  UNIMPLEMENTED) and the standard ``grpc.health.v1.Health`` (``""`` and the scheduler service:
  ``NOT_SERVING`` until the warmup is over, ``SERVING`` after, ``NOT_FOUND`` for another service);
- ``Generate`` under the request's constraint (the proto's ``regex`` / ``json_schema`` / ``ebnf_grammar`` oneof,
  handed to sglang's sampling params as they are): the output :mod:`.constrained` allows, as over HTTP; a grammar
  that does not compile is the scheduler's 400 abort, which the servicer ends the stream with as
  ``INVALID_ARGUMENT`` and sglang's ``Failed to compile ... grammar`` message; the penalties act as over HTTP
  (:class:`.tokens.Sampling`);
- ``Embed`` answers smg-grpc-proto's flat ``EmbedResponse`` (``embedding_dim`` 4, ``embedding`` 5,
  ``prompt_tokens`` 6), as the real servicer 0.14.1 does. sglang-router 0.3.2 was built against the older layout
  (``oneof {complete = 2, error = 3}``) and finds no answer in it: its 500 ``Embedding execution returned no
  response``, with the real engine as with the sim (checked live);
- on ``--smg-http-sidecar-port`` (default ``--port + 1``), the HTTP sidecar: ``POST /start_profile``, ``POST
  /stop_profile``, ``GET /metrics`` with ``--enable-metrics``, 404 ``404: Not Found`` for the rest (no
  ``/health``), plus the sim's own control endpoint ``/_sim/faults`` (the request faults apply to
  ``Generate`` and ``Embed``; ``slow_health``, ``health_fail*`` to both health services);
- the startup log: ``HTTP sidecar server started on ...``, ``Standard gRPC health service initialized``,
  ``gRPC scheduler servicer initialized``, ``gRPC server listening on HOST:PORT``, the warmup (``Sending
  warmup request to gRPC server...``; skipped with ``--skip-server-warmup``), ``Health service status set to
  SERVING``, then the ready line. The real warmup request is the token ids 123 ... 890: a model whose vocab
  is smaller (the tiny test Llama's 512) crashes the real scheduler with ``IndexError: index out of range in
  self``, and so does the sim (run such a model with ``--skip-server-warmup``);
- a port already in use: grpc's bind error, ``gRPC startup failed``, exit 1.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent import futures
from typing import Any, NoReturn

from ..engine.grpc_facts import INSTALL_HINT, SCHEDULER_SERVICE, grpc_missing_reason
from .constrained import ConstraintError, constrained_text
from .core import ENV_FAULT, wait_forever
from .routes import admin
from .routes.common import Request, Route
from .server import Handler, SimHTTPServer
from .state import SITE, VERSION, Sim, kill_self
from .tokens import Generation, Sampling, embedding, logprobs, prompt_seed

__all__ = ["CONSTRAINT_KINDS", "INSTALL_HINT", "SCHEDULER_SERVICE", "WARMUP_INPUT_IDS", "GrpcSim", "grammar_of_params",
           "missing_reason", "sampling_of", "serve"]

#: The servicer's warmup request (``smg_grpc_servicer/sglang/server.py``): "random-looking but safe" ids.
WARMUP_INPUT_IDS = (123, 456, 789, 234, 567, 890, 345)
#: sglang's HTTP status of an abort -> the gRPC status the servicer ends the stream with.
_STATUS_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
                 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


#: The proto's ``SamplingParams.constraint`` oneof -> the grammar kind of :mod:`.constrained` (the servicer hands
#: ``regex``, ``json_schema``, ``ebnf_grammar`` and ``structural_tag`` to sglang's sampling params as they are).
CONSTRAINT_KINDS = {"regex": "regex", "json_schema": "json", "ebnf_grammar": "ebnf", "structural_tag": "structural_tag"}


def grammar_of_params(sampling_params: Any) -> tuple[str, str] | None:
    """The request's one grammar from the proto's ``constraint`` oneof (at most one is set, by the wire format),
    as :func:`.constrained.grammar_of` gives it for a JSON request; None without one (an empty string is unset, as
    sglang's ``if self.regex`` reads it)."""
    field = sampling_params.WhichOneof("constraint")
    value = getattr(sampling_params, field) if field else ""
    return (CONSTRAINT_KINDS[field], value) if field and value else None


def sampling_of(sampling_params: Any) -> Sampling:
    """The knobs of the proto's ``SamplingParams`` that change the sim's tokens (:class:`.tokens.Sampling`), read as
    the servicer reads them: proto3 has no unset scalar, and a ``repetition_penalty`` of 0 is the neutral 1.0. The
    proto carries no seed, so a temperature alone leaves the echo as it is (as over HTTP without a seed)."""
    return Sampling(temperature=sampling_params.temperature, frequency_penalty=sampling_params.frequency_penalty,
                    presence_penalty=sampling_params.presence_penalty,
                    repetition_penalty=sampling_params.repetition_penalty or 1.0)


def missing_reason() -> str:
    """One line naming the packages ``--grpc-mode`` needs and this Python lacks, or ""."""
    return grpc_missing_reason("--grpc-mode")


def _m(name: str) -> Any:
    return importlib.import_module(name)


def _pb() -> Any:
    return _m("smg_grpc_proto").sglang_scheduler_pb2


# ---------------------------------------------------------------------------------------------- sidecar


class SidecarHandler(Handler):
    """The real sidecar's routes (aiohttp there), on the sim's HTTP plumbing, plus the sim's control endpoint."""

    def _authorized(self, path: str) -> bool:
        return True  # the sidecar has no API key check

    def _dispatch(self) -> None:
        if self.path.split("?", 1)[0] not in self._server.routes:
            self._drain()
            Request(self, self.sim).send(404, b"404: Not Found", "text/plain; charset=utf-8")
            return
        super()._dispatch()


def _sidecar(ctx: Request) -> SidecarServer:
    server = ctx.server
    assert isinstance(server, SidecarServer)
    return server


def _start_profile(ctx: Request) -> None:
    _sidecar(ctx).profiling = True
    ctx.send(200, b"Start profiling.\n", "text/plain; charset=utf-8")


def _stop_profile(ctx: Request) -> None:
    server = _sidecar(ctx)
    if not server.profiling:
        ctx.send(500, b"Stop profile failed: Profiling is not in progress. Call /start_profile first.\n",
                 "text/plain; charset=utf-8")
        return
    server.profiling = False
    ctx.send(200, b"Stop profiling. This will take some time.\n", "text/plain; charset=utf-8")


#: The sidecar's routes: the real ones, and the sim's control endpoint.
SIDECAR_ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/start_profile", _start_profile),
    Route(("POST",), "/stop_profile", _stop_profile),
    admin.CONTROL,
    admin.METRICS,
)


class SidecarServer(SimHTTPServer):
    profiling = False
    handler = SidecarHandler

    def __init__(self, address: tuple[str, int], sim: Sim) -> None:
        super().__init__(address, sim, SIDECAR_ROUTES)


# ---------------------------------------------------------------------------------------------- services


def _serving(sim: Sim) -> bool:
    return sim.ready and not sim.shutting_down and not sim.state.health_failing()


def _slow_health(sim: Sim) -> None:
    delay = sim.state.snapshot().slow_health
    if delay:
        time.sleep(delay)


def _health_servicer(sim: Sim) -> Any:
    health_pb2 = _m("grpc_health.v1.health_pb2")
    base = _m("grpc_health.v1.health_pb2_grpc").HealthServicer
    grpc = _m("grpc")

    class HealthServicer(base):  # type: ignore[misc, valid-type]
        def Check(self, request: Any, context: Any) -> Any:
            _slow_health(sim)
            if request.service not in ("", SCHEDULER_SERVICE):
                context.abort(grpc.StatusCode.NOT_FOUND, f"Unknown service: {request.service}")
            status = health_pb2.HealthCheckResponse.SERVING if _serving(sim) else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            return health_pb2.HealthCheckResponse(status=status)

    return HealthServicer()


def _scheduler_servicer(sim: Sim) -> Any:
    pb = _pb()
    common = _m("smg_grpc_proto.generated.common_pb2")
    base = _m("smg_grpc_proto").sglang_scheduler_pb2_grpc.SglangSchedulerServicer
    grpc = _m("grpc")
    struct_pb2 = _m("google.protobuf.struct_pb2")
    timestamp_pb2 = _m("google.protobuf.timestamp_pb2")
    plan = sim.plan
    started = time.time()

    def abort_status(context: Any, status: int, message: str) -> NoReturn:
        context.abort(getattr(grpc.StatusCode, _STATUS_CODES.get(status, "INTERNAL")), message)
        raise AssertionError("unreachable")  # context.abort raises

    def request_faults(context: Any) -> None:
        faults = sim.state.snapshot()
        k, verdict, status = sim.state.next_request()
        if verdict == "die":
            sim.die(arrived=k)
        if faults.latency:
            time.sleep(faults.latency)
        if verdict == "hang":
            sim.log.info(f"(sim) request {k} hangs ({ENV_FAULT})")
            while not sim.shutting_down and context.is_active():
                time.sleep(0.05)
            abort_status(context, 503, "Server is shutting down")
        if verdict == "fail":
            abort_status(context, status, f"simulated failure of request {k} ({ENV_FAULT})")

    def check_input(ids: list[int], context: Any) -> None:
        """The scheduler's checks: the gRPC path has no tokenizer manager, so neither its context-length refusals
        nor its refusal of ``max_new_tokens`` beyond the context (the scheduler caps those: :func:`capped`)."""
        n = len(ids)
        if not ids:
            abort_status(context, 400, "Generate request has no input_ids (the gRPC API takes tokenized input)")
        if n >= plan.max_req_input_len:
            abort_status(context, 400, f"Input length ({n} tokens) exceeds the maximum allowed length "
                                       f"({plan.max_req_input_len} tokens). Use a shorter input or enable "
                                       "--allow-auto-truncate.")
        vocab = sim.vocab.vocab_size
        if any(i >= vocab for i in ids):
            abort_status(context, 400, f"Input token id out of range: the vocab has {vocab} tokens")

    def finish(gen: Generation) -> dict[str, Any]:
        reason = "length" if gen.finish.get("type") == "length" else "stop"
        matched = gen.finish.get("matched")
        out: dict[str, Any] = {"finish_reason": reason}
        if isinstance(matched, int) and not isinstance(matched, bool):
            out["matched_token_id"] = matched
        elif isinstance(matched, str):
            out["matched_stop_str"] = matched
        return out

    def output_logprobs(gen: Generation, request: Any, upto: slice) -> Any:
        if not request.return_logprob:
            return None
        probs = logprobs(sim.vocab, gen, start_len=-1, top_n=max(request.top_logprobs_num, 0), with_text=False)
        rows = probs.output_token[upto]
        tops = probs.output_top[upto] if request.top_logprobs_num > 0 else []
        return pb.OutputLogProbs(
            token_logprobs=[r[0] for r in rows], token_ids=[r[1] for r in rows],
            top_logprobs=[pb.TopLogProbs(values=[e[0] for e in top], token_ids=[e[1] for e in top])
                          for top in tops])

    class SchedulerServicer(base):  # type: ignore[misc, valid-type]
        def Generate(self, request: Any, context: Any) -> Iterator[Any]:
            sim.log.info(f"Receive generation request: {request.request_id}")
            if plan.is_embedding:
                abort_status(context, 400, "This model is served with --is-embedding and does not generate")
            sp = request.sampling_params
            ids = list(request.tokenized.input_ids)
            check_input(ids, context)
            # the scheduler caps max_new_tokens to what the context leaves (init_req_max_new_tokens), not refuses it
            max_new = max(0, min(sp.max_new_tokens if sp.HasField("max_new_tokens") else 128,
                                 plan.max_req_len - len(ids) - 1))
            with sim.lock:
                sim.running += 1
            try:
                with sim.loads.scope():  # what it generates counts in the loads until it ends
                    request_faults(context)
                    n = max(int(sp.n or 1), 1)
                    try:  # the grammar is compiled once the request is admitted; a failure aborts it with 400
                        output = constrained_text(grammar_of_params(sp), prompt_seed(ids))
                    except ConstraintError as exc:
                        sim.log.error(f"{exc}, self.rid={request.request_id!r}")
                        abort_status(context, 400, str(exc))
                    gens = [sim.generate(ids, None, max_new, list(sp.stop), bool(sp.ignore_eos),
                                         list(sp.stop_token_ids) or None, constraint=output,
                                         sampling=sampling_of(sp)) for _ in range(n)]
                    if plan.mode == "prefill":  # the prefill side stops after its first token
                        for gen in gens:
                            gen.output_ids, gen.texts = gen.output_ids[:1], gen.texts[:1]
                            gen.finish = {"type": "length", "length": 0}
                    for index, gen in enumerate(gens):
                        counts = {"prompt_tokens": gen.prompt_tokens, "cached_tokens": gen.cached_tokens}
                        if request.stream:
                            for k, token in enumerate(gen.output_ids):
                                if sim.token_seconds:
                                    time.sleep(sim.token_seconds)
                                sim.loads.advance(1, int(sim.token_seconds * 1e6))
                                yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateStreamChunk(
                                    token_ids=[token], completion_tokens=k + 1, index=index,
                                    output_logprobs=output_logprobs(gen, request, slice(k, k + 1)), **counts))
                            last = gen.output_ids[-1:]  # the servicer's Complete repeats the last chunk's tokens
                            yield pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
                                output_ids=last, completion_tokens=gen.completion_tokens, index=index,
                                **counts, **finish(gen)))
                        else:
                            if sim.token_seconds:
                                time.sleep(sim.token_seconds * gen.completion_tokens)
                            sim.loads.advance(gen.completion_tokens, int(sim.token_seconds * 1e6))
                            yield pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
                                output_ids=gen.output_ids, completion_tokens=gen.completion_tokens, index=index,
                                output_logprobs=output_logprobs(gen, request, slice(None)), **counts, **finish(gen)))
            finally:
                with sim.lock:
                    sim.running -= 1
            if sim.count_inference():
                sim.die()

        def Embed(self, request: Any, context: Any) -> Any:
            sim.log.info(f"Receive embedding request: {request.request_id}")
            ids = list(request.tokenized.input_ids)
            check_input(ids, context)
            with sim.lock:
                sim.running += 1
            try:
                request_faults(context)
                vector = embedding(ids, plan.hidden_size)
            finally:
                with sim.lock:
                    sim.running -= 1
            if sim.count_inference():
                sim.die()
            return pb.EmbedResponse(embedding_dim=len(vector), embedding=vector, prompt_tokens=len(ids))

        def HealthCheck(self, request: Any, context: Any) -> Any:
            rid = f"HEALTH_CHECK_{time.time()}"
            sim.log.info(f"Receive health check request: {rid}")
            _slow_health(sim)
            if sim.shutting_down:
                sim.log.info("Health check request received during shutdown. Returning unhealthy.")
                return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
            if sim.state.health_failing():
                return pb.HealthCheckResponse(healthy=False, message=f"simulated health failure ({ENV_FAULT})")
            # The real RPC sends a one-token request to the scheduler: healthy once it answers, warmup or not.
            return pb.HealthCheckResponse(healthy=True, message="Health check passed")

        def Abort(self, request: Any, context: Any) -> Any:
            sim.log.info(f"Abort request: {request.request_id} ({request.reason})")
            return pb.AbortResponse(success=True, message="")

        def GetModelInfo(self, request: Any, context: Any) -> Any:
            args = plan.args
            config = plan.model.config or {}
            labels = config.get("id2label") or {"0": "LABEL_0", "1": "LABEL_1"}  # transformers' default config
            return pb.GetModelInfoResponse(
                model_path=args["model_path"], tokenizer_path=args["tokenizer_path"] or "",
                is_generation=not plan.is_embedding, served_model_name=plan.served_model_name,
                weight_version="default", max_context_length=plan.max_total_tokens,
                # The servicer reads these from the scheduler's info, which 0.5.23 does not publish: its defaults.
                vocab_size=128256, eos_token_ids=[], pad_token_id=0, bos_token_id=1,
                supports_vision=False, model_type=plan.model.model_type or plan.facts.model_type or "",
                architectures=[plan.model.architecture or plan.facts.architecture],
                max_req_input_len=plan.max_req_input_len,
                id2label_json=_json(labels), num_labels=len(labels))

        def GetServerInfo(self, request: Any, context: Any) -> Any:
            server_args = struct_pb2.Struct()
            server_args.update(_plain({k: v for k, v in plan.args.items() if not k.startswith("_")}))
            info = struct_pb2.Struct()
            info.update({"status": "ready", "max_total_num_tokens": plan.max_total_tokens,
                         "max_req_input_len": plan.max_req_input_len,
                         "startup_time": _plain(sim.startup_timings)})
            start = timestamp_pb2.Timestamp()
            start.FromSeconds(int(started))
            with sim.lock:
                running = sim.running
            return pb.GetServerInfoResponse(
                server_args=server_args, scheduler_info=info, active_requests=running, is_paused=False,
                last_receive_timestamp=time.time(), uptime_seconds=time.time() - started, sglang_version=VERSION,
                server_type="grpc", start_time=start, max_total_num_tokens=plan.max_total_tokens)

        def GetLoads(self, request: Any, context: Any) -> Any:
            loads = [pb.SchedulerLoad(
                dp_rank=rank["dp_rank"], num_running_reqs=rank["running"],
                num_waiting_reqs=rank["waiting"] + rank["pd_waiting"],
                num_total_reqs=rank["running"] + rank["waiting"] + rank["pd_waiting"], num_used_tokens=rank["used"],
                max_total_num_tokens=plan.max_total_tokens, token_usage=round(rank["used"] / plan.max_total_tokens, 4),
                max_running_requests=plan.max_running_requests, num_waiting_uncached_tokens=rank["uncached"],
                memory=pb.MemoryMetrics(weight_gb=round(plan.weights, 3), token_capacity=plan.max_total_tokens),
                disaggregation=pb.DisaggregationMetrics(mode=plan.mode),
                queues=pb.QueueMetrics(waiting=rank["waiting"])) for rank in sim.loads.ranks()]
            running = sum(load.num_running_reqs for load in loads)
            waiting = sum(load.num_waiting_reqs for load in loads)
            return pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                                       version=VERSION, dp_rank_count=len(loads), loads=loads,
                                       aggregate=pb.AggregateMetrics(total_running_reqs=running,
                                                                     total_waiting_reqs=waiting,
                                                                     total_reqs=running + waiting))

        def FlushCache(self, request: Any, context: Any) -> Any:
            sim.flush_cache()
            return common.FlushCacheResponse(success=True, message="Cache flushed successfully!")

    return SchedulerServicer()


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def _plain(value: Any) -> Any:
    """``value`` as JSON-like data for a protobuf ``Struct`` (the servicer's ``make_serializable``)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


# ---------------------------------------------------------------------------------------------- lifecycle


class GrpcSim:
    """The running gRPC server and HTTP sidecar of one simulated engine."""

    def __init__(self, sim: Sim, server: Any, sidecar: SidecarServer | None) -> None:
        self.sim = sim
        self.server = server
        self.sidecar = sidecar

    def stop(self) -> None:
        log = self.sim.log
        log.info("Shutting down gRPC server")
        log.info("Health service status set to NOT_SERVING")
        self.server.stop(grace=5.0).wait(6.0)
        log.info("Shutting down gRPC service")
        if self.sidecar is not None:
            self.sidecar.shutdown()
            self.sidecar.server_close()


def _bind_failure(sim: Sim, exc: BaseException) -> int:
    log = sim.log
    lines = traceback.format_exception_only(type(exc), exc)
    log.error("gRPC startup failed, releasing scheduler resources\nTraceback (most recent call last):\n"
              f'  File "{SITE}/smg_grpc_servicer/sglang/server.py", line 499, in serve_grpc\n'
              "    server.add_insecure_port(listen_addr)\n"
              f'  File "{SITE}/grpc/aio/_server.py", line 98, in add_insecure_port\n'
              "    return _common.validate_port_binding_result(\n" + "".join(lines).rstrip())
    log.info(f"kill_process_tree called: parent_pid={os.getpid()}, include_parent=False, pid={os.getpid()}")
    sim.recorder.record("exit", returncode=1, reason="bind")
    return 1


def _warmup_crash(sim: Sim) -> NoReturn:
    """The real scheduler on the servicer's warmup ids with a vocab they overflow."""
    log = sim.log
    log.info("Sending warmup request to gRPC server...")
    log.error(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{SITE}/sglang/srt/managers/scheduler.py", line 6368, in run_scheduler_process\n'
        "    scheduler.run_event_loop()\n"
        f'  File "{SITE}/sglang/srt/layers/vocab_parallel_embedding.py", line 481, in _embed_local_shard\n'
        "    output_parallel = self.quant_method.embedding(self, input_.long())\n"
        f'  File "{SITE}/torch/nn/functional.py", line 2615, in embedding\n'
        "    return torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)\n"
        "IndexError: index out of range in self\n"
        f"(sim: the servicer's warmup ids go up to {max(WARMUP_INPUT_IDS)}, the vocab has "
        f"{sim.vocab.vocab_size} tokens; --skip-server-warmup avoids it)")
    log.info("Received SIGQUIT from scheduler process. Scheduler failed, shutting down gRPC server.")
    log.info("Note: Crash dumps are handled by the scheduler process, not the gRPC server.")
    log.info(f"kill_process_tree called: parent_pid={os.getpid()}, include_parent=True, pid={os.getpid()}")
    sim.recorder.record("exit", returncode=-9, reason="warmup_vocab")
    kill_self()


def serve(sim: Sim, warmup: float) -> GrpcSim | int:
    """Bind the gRPC server (and its sidecar) and run the startup to readiness, as the servicer does; the
    running servers, or the exit code of a failed bind."""
    grpc = _m("grpc")
    args = sim.plan.args
    host, port = args["host"], args["port"]
    log = sim.log
    sidecar_port = args.get("smg_http_sidecar_port") or port + 1
    sidecar: SidecarServer | None = None
    try:
        sidecar = SidecarServer((host, sidecar_port), sim)
    except OSError as exc:
        log.error(f"Failed to start HTTP sidecar server: {exc}. Continuing without metrics/profile endpoints.")
    else:
        threading.Thread(target=sidecar.serve_forever, kwargs={"poll_interval": 0.05}, name="sim-sidecar",
                         daemon=True).start()
        log.info(f"HTTP sidecar server started on http://{host}:{sidecar_port}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=10), options=[
        ("grpc.max_send_message_length", 1024 * 1024 * 256),
        ("grpc.max_receive_message_length", 1024 * 1024 * 256),
        ("grpc.so_reuseport", 0),  # a port in use must fail the bind, as a real second server's would
    ])
    _m("grpc_health.v1.health_pb2_grpc").add_HealthServicer_to_server(_health_servicer(sim), server)
    log.info("Standard gRPC health service initialized")
    _m("smg_grpc_proto").sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(
        _scheduler_servicer(sim), server)
    log.info("gRPC scheduler servicer initialized")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        if sidecar is not None:
            sidecar.shutdown()
            sidecar.server_close()
        return _bind_failure(sim, exc)
    server.start()
    running = GrpcSim(sim, server, sidecar)
    sim.grpc = running
    sim.bound = True
    log.info(f"gRPC server listening on {address}")
    if sim.faults.hang:
        wait_forever()
    if args["skip_server_warmup"]:
        log.info("Skipping gRPC server warmup (skip_server_warmup=True)")
    else:
        time.sleep(warmup)
        if not sim.plan.is_embedding and max(WARMUP_INPUT_IDS) >= sim.vocab.vocab_size:
            _warmup_crash(sim)
        log.info("Sending warmup request to gRPC server...")
        log.info(f"Receive generation request: WARMUP_{time.time()}")
        if sim.plan.is_embedding:
            embedding(list(WARMUP_INPUT_IDS[:3]), sim.plan.hidden_size)
        else:
            sim.generate(list(WARMUP_INPUT_IDS), None, 8, [], False)
        log.info("gRPC warmup request completed successfully")
    log.info("Health service status set to SERVING")
    sim.ready = True
    return running
