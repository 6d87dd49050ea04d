"""Record the real sglang 0.5.23 CPU engine's answers to the server flags and routes of
tests/sim/test_sim_server_flags.py (run with the project's Python, which has httpx; the engine is the real-engine
venv's): ``python tests/engine_scripts/record_server_flags.py WORK_DIR``. Writes WORK_DIR/answers.json, from which
tests/data/sim/server_flags_real.json was made (its "answers"). Three launches, one after the other, each killed
(its process group, started by this script) when done. Takes minutes on a busy 2-core machine."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
WORK = Path(sys.argv[1]).resolve()
WORK.mkdir(parents=True, exist_ok=True)
from pytest_sglworker.engine.cpu_engine import CPU_ENGINE_ARGS, build_tiny_model, real_engine_python  # noqa: E402
from pytest_sglworker.engine.specs import CI_WORKER_ARGS  # noqa: E402

py = real_engine_python()
model = build_tiny_model(py, str(WORK / "tiny"))
out = {}


def launch(name, port, extra):
    log = open(WORK / f"{name}.log", "w")
    argv = [
        str(py),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *CI_WORKER_ARGS,
        *CPU_ENGINE_ARGS,
        *extra,
    ]
    p = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
        start_new_session=True,
    )
    return p


def wait(port, p, limit=600):
    end = time.time() + limit
    while time.time() < end:
        if p.poll() is not None:
            return False
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health_generate", timeout=5).status_code == 200:
                return True
        except Exception:
            pass
        time.sleep(1)
    return False


def kill(p):
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def save():
    json.dump(out, open(WORK / "answers.json", "w"), indent=1)


def B(port):
    return f"http://127.0.0.1:{port}"
# 1: incremental streaming + no radix cache
port = 31100
p = launch("incr", port, ["--incremental-streaming-output", "--disable-radix-cache"])
try:
    ok = wait(port, p)
    out["incr_ready"] = ok
    if ok:
        url = B(port)
        chunks = []
        with httpx.stream(
            "POST",
            url + "/generate",
            json={"text": "hello world", "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    chunks.append(json.loads(line[5:]))
        out["incr_stream"] = [
            {
                "text": c.get("text"),
                "output_ids": c.get("output_ids"),
                "completion_tokens": c["meta_info"].get("completion_tokens"),
                "finish": c["meta_info"].get("finish_reason"),
            }
            for c in chunks
        ]
        cached = []
        for _ in range(2):
            r = httpx.post(
                url + "/generate",
                json={"text": "the same prompt for the cache test", "sampling_params": {"max_new_tokens": 2}},
                timeout=60,
            )
            cached.append(r.json()["meta_info"]["cached_tokens"])
        out["noradix_cached"] = cached
        r = httpx.post(
            url + "/generate",
            json={"text": "hi", "rid": "my-rid-1", "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        out["rid_single"] = r.json()["meta_info"]["id"]
        r = httpx.post(
            url + "/generate",
            json={"text": ["a", "b"], "rid": ["x1", "x2"], "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        out["rid_batch"] = [o["meta_info"]["id"] for o in r.json()]
        r = httpx.post(
            url + "/generate",
            json={"text": ["a", "b"], "rid": ["dup", "dup"], "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        out["rid_dup"] = [r.status_code, r.text]

        # sampling
        def gen(sp, prompt="The quick brown fox"):
            r = httpx.post(
                url + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 24, **sp}}, timeout=120
            )
            return r.json()["output_ids"]

        out["greedy"] = [gen({"temperature": 0}), gen({"temperature": 0})]
        out["seeded"] = [
            gen({"temperature": 1.0, "sampling_seed": 42}),
            gen({"temperature": 1.0, "sampling_seed": 42}),
            gen({"temperature": 1.0, "sampling_seed": 7}),
        ]
        out["unseeded"] = [gen({"temperature": 1.0}), gen({"temperature": 1.0})]
        out["freq"] = gen({"temperature": 0, "frequency_penalty": 2.0})
        out["pres"] = gen({"temperature": 0, "presence_penalty": 2.0})
        out["rep"] = gen({"temperature": 0, "repetition_penalty": 2.0})
        # abort
        res = {}

        def long():
            r = httpx.post(
                url + "/generate",
                json={
                    "text": "abort me",
                    "rid": "abort-me",
                    "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
                },
                timeout=300,
            )
            res["status"] = r.status_code
            res["body"] = r.json()["meta_info"]["finish_reason"] if r.status_code == 200 else r.text

        t = threading.Thread(target=long)
        t.start()
        time.sleep(3)
        a = httpx.post(url + "/abort_request", json={"rid": "abort-me"}, timeout=30)
        t.join(120)
        out["abort_rid"] = [a.status_code, a.text, res]
        res = {}
        t = threading.Thread(target=long)
        t.start()
        time.sleep(3)
        a = httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
        t.join(120)
        out["abort_all"] = [a.status_code, a.text, res]
        # sessions
        r = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000}, timeout=30)
        out["open_session"] = [r.status_code, r.text]
        sid = r.json() if r.status_code == 200 else None
        r = httpx.post(
            url + "/generate",
            json={
                "input_ids": [1, 2, 3],
                "session_params": {"id": sid, "rid": None},
                "sampling_params": {"max_new_tokens": 2},
            },
            timeout=60,
        )
        out["session_gen1"] = [r.status_code, r.text]
        rid1 = r.json()["meta_info"]["id"] if r.status_code == 200 else None
        r = httpx.post(
            url + "/generate",
            json={
                "input_ids": [4, 5],
                "session_params": {"id": sid, "rid": rid1},
                "sampling_params": {"max_new_tokens": 2},
            },
            timeout=60,
        )
        out["session_gen2"] = [r.status_code, r.text]
        r = httpx.post(url + "/close_session", json={"session_id": sid}, timeout=30)
        out["close_session"] = [r.status_code, r.text]
        r = httpx.post(
            url + "/generate",
            json={"input_ids": [4, 5], "session_params": {"id": sid}, "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        out["session_after_close"] = [r.status_code, r.text]
        r = httpx.post(url + "/close_session", json={"session_id": "nope"}, timeout=30)
        out["close_unknown"] = [r.status_code, r.text]
        r = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000, "session_id": "mine"}, timeout=30)
        out["open_named"] = [r.status_code, r.text]
        r = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000, "session_id": "mine"}, timeout=30)
        out["open_named_again"] = [r.status_code, r.text]
        # input_embeds
        r = httpx.post(
            url + "/generate",
            json={"input_embeds": [[0.01] * 64] * 3, "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        out["input_embeds"] = [r.status_code, r.text[:600]]
finally:
    save()
    kill(p)
port = 31104
p = launch("skiptok", port, ["--skip-tokenizer-init"])
try:
    ok = wait(port, p)
    out["skip_ready"] = ok
    if ok:
        url = B(port)
        r = httpx.post(
            url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}, timeout=60
        )
        out["skip_ids"] = [r.status_code, r.text]
        r = httpx.post(url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3}}, timeout=60)
        out["skip_text"] = [r.status_code, r.text]
        chunks = []
        with httpx.stream(
            "POST",
            url + "/generate",
            json={"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 3}},
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    chunks.append(json.loads(line[5:]))
        out["skip_stream"] = chunks
finally:
    save()
    kill(p)
port = 31108
p = launch("triton", port, ["--attention-backend", "triton"])
try:
    ok = wait(port, p, 300)
    out["triton_ready"] = ok
    out["triton_rc"] = p.poll()
finally:
    save()
    kill(p)
print("DONE")
