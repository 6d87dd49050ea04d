"""GPU memory holder: a tiny sglang stand-in for ``sglworker gpu-check``. Stdlib only (ctypes), so it carries.

Launched by pytest-sglworker as the engine (``--sgl-engine real --sgl-launcher "<python> holder.py"``), it
takes sglang's argv (``--model-path --host --port --nccl-port --tp-size`` and any other flag, ignored), then:

1. ``cuInit``, device 0 of what ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` give it: name, PCI bus id
   (``cuDeviceGetPCIBusId``), UUID, total memory;
2. a context, ``cuMemGetInfo`` (the free memory an engine would see), ``cuMemAlloc`` of
   ``$GPU_CHECK_HOLD_MIB`` MiB, touched with ``cuMemsetD8`` so that it is really backed;
3. only then binds ``--host``:``--port`` (loopback only) and answers ``/health``, ``/health_generate``,
   ``/get_model_info``, ``/get_server_info``, ``/v1/models``, ``/generate`` (empty text) and
   ``/gpu_check`` (everything above, as JSON);
4. on SIGTERM/SIGINT: with ``$GPU_CHECK_EXIT_MODE=free`` (default) ``cuMemFree`` and context destroy, then
   exit 0; with ``exit``, exit at once holding the memory (the driver frees it, as after a crash).

Each step is appended as one JSON line to ``$GPU_CHECK_EVENTS`` (``start``, ``allocated``, ``exit``,
``error``), with ``time.time()`` stamps the check compares with its NVML samples. A CUDA failure is one
line, ``[gpu-check holder] ERROR: cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)``, and exit code 3.
Whatever happens it exits after ``$GPU_CHECK_MAX_LIFETIME_S`` (default 600 s).

``python holder.py --probe`` only enumerates the devices (no context, no memory) and prints JSON.
``$GPU_CHECK_FAKE_GPU`` set (dry run): the fake CUDA driver of ``cuda_driver.py`` instead of libcuda.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuda_driver import MIB, CudaApi, CudaError, FakeCuda, load_cuda

PREFIX = "[gpu-check holder]"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def log(text: str) -> None:
    print(f"{PREFIX} {text}", flush=True)


def emit(event: str, **fields: Any) -> None:
    """One JSON line appended to $GPU_CHECK_EVENTS with a single O_APPEND write (atomic for short lines)."""
    path = os.environ.get("GPU_CHECK_EVENTS")
    if not path:
        return
    record = {"t": time.time(), "event": event, "source": "holder", "pid": os.getpid(), **fields}
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as exc:
        log(f"cannot write the event file {path}: {exc.strerror}")


class _Stop(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        return default


def probe() -> int:
    """Enumerate the devices CUDA shows this process, as JSON on stdout. Creates no context."""
    result: dict[str, Any] = {"ok": False, "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
                              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        cuda = load_cuda()
        result["library"] = cuda.library
        result["kind"] = cuda.kind
        cuda.init()
        result["driver_version"] = cuda.driver_version()
        result["devices"] = [vars(cuda.device_info(i)) for i in range(cuda.device_count())]
        result["ok"] = True
    except CudaError as exc:
        result["error"] = str(exc)
    print(json.dumps(result))
    return 0 if result["ok"] else 3


class Holder:
    def __init__(self, ns: argparse.Namespace, unknown: list[str]) -> None:
        self.ns = ns
        self.unknown = unknown
        self.hold_mib = int(_env_float("GPU_CHECK_HOLD_MIB", 1024))
        self.exit_mode = os.environ.get("GPU_CHECK_EXIT_MODE", "free")
        self.cuda: CudaApi | None = None
        self.ptr: int | None = None
        self.info: dict[str, Any] = {}

    def start_gpu(self) -> None:
        cuda = self.cuda = load_cuda()
        cuda.init()
        count = cuda.device_count()
        if count < 1:
            raise CudaError("cuDeviceGetCount", 100, "CUDA_ERROR_NO_DEVICE (no device visible)")
        device = cuda.device_info(0)
        visible = [vars(cuda.device_info(i)) for i in range(count)]
        cuda.create_context(0)
        free_ctx, total = cuda.mem_get_info()
        nbytes = self.hold_mib * MIB
        started = time.time()
        self.ptr = cuda.alloc(nbytes)
        cuda.touch(self.ptr, nbytes)
        alloc_s = time.time() - started
        free_after, _ = cuda.mem_get_info()
        self.info = {
            "pid": os.getpid(),
            "cuda": cuda.kind,
            "library": cuda.library,
            "driver_version": cuda.driver_version(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
            "device_count": count,
            "device": vars(device),
            "visible_devices": visible,
            "context_method": cuda.context_method,
            "free_after_context_mib": free_ctx // MIB,
            "free_after_alloc_mib": free_after // MIB,
            "total_mib": total // MIB,
            "allocated_mib": self.hold_mib,
            "alloc_seconds": round(alloc_s, 4),
            "exit_mode": self.exit_mode,
            "port": self.ns.port,
        }
        log(f"device 0 of {count}: {device.name}, PCI {device.pci_bus_id}, {device.uuid}, {device.total_mib} MiB; "
            f"context by {cuda.context_method}; free {free_ctx // MIB} MiB; allocated {self.hold_mib} MiB in "
            f"{alloc_s:.3f} s; free now {free_after // MIB} MiB")
        emit("allocated", **self.info)

    def release_gpu(self) -> None:
        cuda = self.cuda
        if cuda is None:
            return
        if self.ptr is not None:
            cuda.free(self.ptr, self.hold_mib * MIB)
            self.ptr = None
        cuda.destroy_context()

    def mark_exiting(self) -> None:
        if isinstance(self.cuda, FakeCuda):
            self.cuda.mark_exiting()


def make_handler(holder: Holder) -> type[BaseHTTPRequestHandler]:
    model = holder.ns.model_path or "gpu-check/holder"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "gpu-check-holder"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # health is polled every 50 ms: no access log

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode() if not isinstance(body, bytes) else body
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/health_generate"):
                self._send(200, b"")
            elif path in ("/get_model_info", "/model_info"):
                self._send(200, {"model_path": model, "tokenizer_path": model, "is_generation": True})
            elif path in ("/get_server_info", "/server_info"):
                self._send(200, {"version": "gpu-check-holder", "model_path": model, "tp_size": holder.ns.tp_size,
                                 "port": holder.ns.port, "ignored_args": holder.unknown})
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "gpu-check"}]})
            elif path == "/gpu_check":
                self._send(200, holder.info)
            else:
                self._send(404, {"error": f"no route {path}"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            if self.path.split("?", 1)[0] == "/generate":
                self._send(200, {"text": "", "meta_info": {"prompt_tokens": 0, "completion_tokens": 0,
                                                           "finish_reason": {"type": "stop"}}})
            else:
                self._send(404, {"error": f"no route {self.path}"})

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GPU memory holder for sglworker gpu-check (an sglang stand-in)")
    parser.add_argument("--model-path", default="")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--nccl-port", type=int, default=None)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--probe", action="store_true", help="only list the devices CUDA shows, as JSON")
    ns, unknown = parser.parse_known_args(argv)
    if ns.probe:
        return probe()
    if ns.host not in LOOPBACK:
        log(f"ERROR: refusing to bind {ns.host!r}: the holder listens on loopback only")
        return 2
    if ns.tp_size != 1:
        log(f"ERROR: --tp-size {ns.tp_size}: the holder holds memory on one GPU (--tp-size 1) only")
        return 2

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lifetime = _env_float("GPU_CHECK_MAX_LIFETIME_S", 600.0)

    def end_of_life() -> None:
        log(f"lifetime of {lifetime:g} s is over: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(lifetime, end_of_life)
    timer.daemon = True
    timer.start()

    holder = Holder(ns, unknown)
    log(f"pid {os.getpid()}: model {ns.model_path!r}, port {ns.port}, hold {holder.hold_mib} MiB, exit mode "
        f"{holder.exit_mode}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
        f"CUDA_DEVICE_ORDER={os.environ.get('CUDA_DEVICE_ORDER')!r}; ignored args: {' '.join(unknown) or '-'}")
    emit("start", port=ns.port, hold_mib=holder.hold_mib, exit_mode=holder.exit_mode,
         cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    server: ThreadingHTTPServer | None = None
    signum = 0
    try:
        try:
            holder.start_gpu()
        except CudaError as exc:
            log(f"ERROR: {exc}")
            emit("error", error=str(exc))
            try:
                holder.release_gpu()
            except CudaError:
                pass
            return 3
        try:
            server = ThreadingHTTPServer((ns.host, ns.port), make_handler(holder))
        except OSError as exc:
            # sglang's wording, so that the plugin's diagnosis sees a port in use and retries another port
            log(f"ERROR: [Errno {exc.errno}] error while attempting to bind on address ({ns.host!r}, {ns.port}): "
                f"{exc.strerror}")
            emit("error", error=f"bind: {exc}")
            holder.release_gpu()
            return 4
        server.daemon_threads = True
        log(f"serving on http://{ns.host}:{ns.port} (ready)")
        server.serve_forever(poll_interval=0.2)
    except _Stop as stop:
        signum = stop.signum
    finally:
        if server is not None:
            server.server_close()
    name = signal.Signals(signum).name if signum else "end of serving"
    if holder.exit_mode == "exit":
        holder.mark_exiting()
        log(f"{name}: exiting without freeing {holder.hold_mib} MiB (the driver frees it)")
        emit("exit", mode="exit", signal=name)
        sys.stdout.flush()
        os._exit(0)
    try:
        holder.release_gpu()
    except CudaError as exc:
        log(f"ERROR: while freeing: {exc}")
        emit("error", error=f"free: {exc}")
        emit("exit", mode="free-failed", signal=name)
        return 5
    log(f"{name}: freed {holder.hold_mib} MiB and the context; exiting")
    emit("exit", mode="free", signal=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
