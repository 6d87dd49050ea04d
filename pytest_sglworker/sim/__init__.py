"""The simulated engine: a CPU-only stand-in for ``python -m sglang.launch_server``, run as ``python -m
pytest_sglworker.sim <sglang argv>``, that speaks sglang's CLI, HTTP, gRPC and PD on a real port, with switchable
faults.

It imports the engine layer (the flag table, the memory arithmetic) and nothing above it. The rest of the
package starts it as a subprocess and imports only what this package surface names: the environment
variables through which a worker's environment configures it, the fault-setting check that collection
runs before anything launches, and the control endpoint's path (the pool sets a pooled worker's runtime faults
back through it).

A new sim fault is one new record in :data:`pytest_sglworker.sim.faults.FAULTS` (with the field it sets in
``Faults`` or ``RequestFaults`` of the same module), plus the code that acts on it where it acts: the startup
step in :mod:`.startup`, or the request hook in :mod:`.routes.common`. A new endpoint family is one new module in
:mod:`.routes` plus one line registering it in ``routes/__init__.py``.

It is a real subprocess serving real HTTP on the given host and port, with sglang 0.5.23's flags, startup log
lines, endpoints, request checks and response shapes (the facts in :mod:`pytest_sglworker.engine.sglang_facts`;
the shapes checked against the real engine by ``tests/sim/test_sim_differential.py``), deterministic text (the
prompt's tokens echoed, or the output a ``regex`` or ``json_schema`` allows) and logprobs, its load as it is
(``/v1/loads``), and injectable faults. Stdlib only at import (``tokenizers`` is used when it is importable and the
model's ``tokenizer.json`` is found, else the sim says why in its log and counts with its fallback; ``grpc`` only
in ``--grpc-mode``), so that it starts in a few tens of milliseconds. The modules:

- :mod:`.main`: the program (``main()``): signals, the startup's outcome, the drain and exit;
- :mod:`.cli`: the parser (sglang's flags), its ``--help`` (the sim's knobs first) and ``--help-faults``, the
  ``SGLSIM_*`` values;
- :mod:`.plan`: the resolved configuration and the memory arithmetic (:class:`~.plan.Plan`, ``make_plan``);
- :mod:`.startup`: the startup sequence and its log lines, the startup faults, binding and warmup;
- :mod:`.core`: environment names, the log, the event recorder; :mod:`.faults`: the faults;
- :mod:`.state`: the state of a running server (``Sim``), shared by the HTTP and gRPC sides;
- :mod:`.server`: the HTTP plumbing (uvicorn's manners, the route dispatch, the request-fault gate);
- :mod:`.routes`: the HTTP endpoints, one module per family, each a table of routes;
- :mod:`.vocab`: the tokenizer (the model's own, else the fallback) and what a model directory says;
- :mod:`.tokens`: generations, logprobs, embeddings; :mod:`.constrained`: the output a ``regex`` or
  ``json_schema`` allows, and the grammar errors; :mod:`.load`: the requests in flight and their tokens, per DP
  rank (``/v1/loads``); :mod:`.pd`: prefill/decode disaggregation; :mod:`.grpc_server`: ``--grpc-mode``.

Startup, as the real engine does it: the server-args line, ``Init parallel``, ``Memory baseline taken``,
``Load weight begin/end``, ``KV Cache is allocated``, ``Memory pool end``, the decode and prefill CUDA-graph
captures with their progress bars (unless their backend is ``disabled``), ``max_total_num_tokens=...``; only
then is the port bound (``Uvicorn running on ...``); ``/health`` answers 503 until the warmup is over (``The
server is fired up and ready to roll!``), 200 after. With ``--tp-size 1`` lines carry no rank; with tp > 1
the per-rank lines repeat as ``[ts TPk]``.

Environment:

- ``SGLSIM_STARTUP_SECONDS`` (float, default 0.3): total simulated startup, counted from the process's start
  (as a real server's, its interpreter's start and imports are part of it); 70 % before binding (weights, KV
  pool, graph captures: less what the process took to get there), 30 % warmup after binding.
- ``SGLSIM_WARMUP_SECONDS`` (float): overrides the warmup part (the part before binding stays 70 % of
  the total). ``--skip-server-warmup`` makes the server ready at once after binding.
- ``SGLSIM_GPU_MEM_GIB`` (float, default 80): the declared card size, for the memory arithmetic.
- ``SGLSIM_GPU_FREE_MIB`` (integer MiB, default 98.125 % of the card): the memory free when the weights
  load (sglang's ``pre_model_load_memory``, the ``Load weight begin. avail mem=`` figure). With it, the KV
  pool's ``#tokens`` is exactly :func:`pytest_sglworker.engine.ledger.predict_memory`'s ``kv_tokens`` for the same
  card, argv and ``gpu_free_mib``.
- ``SGLSIM_TOKEN_SECONDS`` (float, default 0): time to generate one token.
- ``SGLSIM_PD_WAIT_SECONDS`` (float, default 15): how long a PD side waits for its peer (sglang's decode
  side retries 15 times a second apart) before it aborts the request with sglang's 500.
- ``SGLSIM_RECORD`` (path): append one JSON line per event (``start``, ``ready``, ``exit``), each with a
  single ``O_APPEND`` write.
- ``SGLSIM_FAULT``: comma-separated faults; ``python -m pytest_sglworker.sim --help-faults`` lists them all (from
  :data:`~.faults.FAULTS`). An unknown fault or a value out of range exits 2 with one line naming it and listing
  the known ones (on stderr and in the log). Startup faults: ``crash_oom``, ``kv_oom``, ``exit=N``, ``hang``,
  ``hang_before_bind``, ``flood=MB``, ``ignore_sigterm``, ``escape_child``. Request faults (also
  switchable at run time): ``die_after=N``, ``die_on_request=N``, ``slow_health=S``, ``fail_first=N``,
  ``fail_rate=P``, ``fail_seed=N``, ``status=CODE``, ``latency=S``, ``hang_request=N``, ``hang_requests``,
  ``health_fail_after=S``, ``health_fail``, ``api_key=KEY``, ``max_payload=N``, ``trickle=S``.

  - ``crash_oom``: CUDA OOM in the prefill-graph capture (forced even when the prefill graph is disabled,
    so that it works with the budget flags): the capture bar stops at the failing bucket, the
    breakable-graph context's own error record (the ``num_active_captures_`` assertion, ``Fail when using
    backend: breakable for prefill runner.``), then the scheduler's chained traceback (OOM first), then
    ``Received sigquit ...`` and ``kill_process_tree called: ...``, then SIGKILL of itself (returncode -9).
  - ``kv_oom``: the 0.5.23 "Loaded weights leave no GPU memory for the KV cache" failure, exit 1.
  - ``exit=N``: a scheduler traceback after the weights load, exit N.
  - ``hang``: binds, then never becomes ready. ``hang_before_bind``: never binds.
  A port that is already in use is not a fault but the real behaviour: the bind error is logged and the
  process stays alive (as sglang 0.5.23 does) until it is signalled.
  - ``flood=MB``: MB MiB of log lines to stdout and as many to stderr while the weights load.
  - ``ignore_sigterm``: SIGTERM is ignored (SIGINT and SIGKILL still work).
  - ``escape_child``: spawns a child in its own session (``SGLSIM_ESCAPED=1`` in its environment, the rest
    inherited), logged as ``spawned scheduler pid=N``; it outlives a kill of the sim's process group and
    exits by itself only after 600 s.
  - ``die_after=N``: SIGKILL of itself right after answering the N-th inference request (``/generate``,
    the OpenAI endpoints, ``/encode``, ``/v1/score``; health and info probes do not count).
  - ``die_on_request=N``: SIGKILL of itself when the N-th inference request (counted from when the fault is
    set) arrives, before any byte of its answer: its client sees the connection close.
  - ``slow_health=SECONDS``: every ``/health`` and ``/health_generate`` answer is delayed.

Control endpoint (exempt from the API key and from the faults themselves): ``GET /_sim/faults`` answers the
request faults in force, the counters since they were set and the worker's identity; ``POST /_sim/faults``
with ``{"fail_first": 2, "latency": 0.1}`` (``null`` clears one), ``{"spec": "fail_first=2,latency=0.1"}``
or ``{"reset": true, ...}`` (clear all first) changes them at once and restarts their counters; a bad body
answers 400 with the one-line error. Every response carries ``X-SGLSim-Worker: <port>/<pid>``.

Also like the real engine: ``--api-key`` is checked on everything but ``/health*``, ``/ready*`` and
``/metrics*``; SIGTERM/SIGINT drain in-flight requests (``/health`` answers 503 meanwhile) and exit 0, whichever of its
threads the kernel hands the signal to (the main thread waits on Python's signal wakeup pipe); a
``CUDA_VISIBLE_DEVICES`` with fewer devices than ``--base-gpu-id + --tp-size`` fails the startup (exit 1);
the router's HTTP/2 probe (``PRI * HTTP/2.0``) gets uvicorn's 404 and 400; PD disaggregation
(``--disaggregation-mode prefill|decode``) serves sglang's bootstrap server and handshake (:mod:`.pd`);
``/v1/loads`` reports the requests really in flight per DP rank (:mod:`.load`), and ``/get_load`` their legacy
shape, which 0.5.23 no longer serves (it answers 404) but sglang-router 0.3.2 still polls.

Memory arithmetic: :func:`pytest_sglworker.engine.ledger.predict_memory` (sglang's ``memory_hook`` and KV
configurator: the automatic ``--mem-fraction-static``, ``rest = free_after_weights - free * (1 -
fraction)``, ``#tokens = rest // kv_bytes_per_token`` rounded down to ``--page-size``, capped by
``--max-total-tokens``; ``rest <= 0`` fails like 0.5.23, "Loaded weights leave no GPU memory for the KV
cache"), over the model's dims (the built-in table, or the ``config.json`` of a model directory).
"""

from .core import CONTROL_PATH, ENV_FAULT, ENV_GPU_FREE, ENV_GPU_MEM
from .faults import FaultError, parse_fault_spec

__all__ = ["CONTROL_PATH", "ENV_FAULT", "ENV_GPU_FREE", "ENV_GPU_MEM", "FaultError", "parse_fault_spec"]
