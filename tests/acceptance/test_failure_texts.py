"""The golden corpus of failure texts: for each failure class the exact text a person reads in the terminal is a
reviewed snapshot (``tests/data/failure_texts/<name>.txt``), paths, ports, pids, times normalised.

Two inner sessions produce them, as users meet the plugin (``runpytest_subprocess``):

- **every diagnosis rule**, through a stand-in engine (``tests/engine_scripts/replay_log.py``) that writes a log
  fixture of ``tests/data/logs`` (real logs of sglang's issue tracker and of the real engine on a CPU) and ends as
  that engine ended;
- **the simulated engine's faults and the plugin's own scenes**: startup faults (a capture OOM, a KV pool that does
  not fit, an exit, a hang after and before the bind, a flood of log lines, faults the engine refuses), a worker
  that dies during its test, one the test kills itself, a group member that dies, a PD decode side that never gets
  ready, and a router that dies at startup; and the deaths a test meets at run time, which lead its report: a
  worker that dies on the test's request, one that died between two requests, a group member that dies on its
  request, and a router another process kills.

(The real CPU engine's crash is held to the same goals in the real-engine tier:
``tests/acceptance/test_real_engine.py``.)

Each text is held to the goals: at most :data:`MAX_LINES` lines at the default tail, the first cause within the
first :data:`CAUSE_WITHIN` lines, nothing the plugin says said twice (no line of its own repeated, the headline once,
no log tail twice). ``tests/data/failure_texts/INDEX.md`` lists each entry's length and the line of its first cause.

Regenerate after a reviewed change of wording: ``SGLWORKER_UPDATE_SNAPSHOTS=1 pytest tests/acceptance/
test_failure_texts.py``, then read the diff of ``tests/data/failure_texts`` before committing it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from failure_goals import CAUSE_WITHIN, MAX_LINES, check_goals

DATA = Path(__file__).resolve().parents[1] / "data"
SNAPSHOTS = DATA / "failure_texts"
LOGS = DATA / "logs"
REPLAY = Path(__file__).resolve().parents[1] / "engine_scripts" / "replay_log.py"
UPDATE = os.environ.get("SGLWORKER_UPDATE_SNAPSHOTS") == "1"

#: diagnosis rule -> (log fixture, exit code, words of the cause the first lines must show)
RULES = {
    "graph_capture_oom": ("seed_prefill_capture_oom.log", -9, "CUDA out of memory while capturing the prefill"),
    "graph_capture_error": ("github_graph_capture_error_7227.log", 1, "capturing"),
    "kv_pool_does_not_fit": ("kv_does_not_fit.log", -9, "KV"),
    "weights_oom": ("weights_oom.log", -9, "loading the weights"),
    "cuda_oom": ("github_cuda_oom_12496.log", 1, "CUDA out of memory"),
    "port_in_use": ("rpc_port_in_use.log", 1, "rpc_port 31236"),
    "model_not_found": ("model_not_found_repo.log", 1, "acme/Qwen3-0.6B-typo"),
    "nccl_error": ("nccl_error.log", -9, "NCCL"),
    "bad_flag": ("real_bad_flag_unrecognized.log", 2, "rejected the arguments"),
    "killed_by_signal": ("silent_sigkill.log", -9, "SIGKILL"),
    "web_worker_crash_loop": ("web_worker_crash_loop.log", -15, "web-server worker process of the HTTP server died"),
    "unknown": ("unknown_traceback.log", 1, "qwen9_moe"),
}

REPLAY_SUITE = "import pytest\n" + "".join(f"""

@pytest.mark.sgl_worker(env={{"SGLREPLAY_LOG": {str(LOGS / log)!r}, "SGLREPLAY_EXIT": "{code}"}})
def test_rule_{name}(sgl_worker):
    pass
""" for name, (log, code, _) in RULES.items())

#: scene -> words of the cause the first lines must show
SCENES = {
    "startup_crash_oom": "CUDA out of memory while capturing the prefill CUDA graph",
    "startup_kv_oom": "KV",
    "startup_exit": "simulated scheduler failure",
    "startup_hang": "its log shows no error",
    "startup_hang_before_bind": "its log shows no error",
    "startup_flood": "simulated",
    "faults_refused": "the simulated engine refused its faults",
    "death_during_test": "simulated death after 1 requests",
    "killed_by_the_test": "this test killed it",
    "group_member_dies": "simulated death after 1 requests",
    "pd_decode_never_ready": "its log shows no error",
    "router_dies_at_startup": "router",
    # run-time deaths: the death leads the test's report, what the test met follows in its own frames
    "death_mid_request": "exited with code -9 (SIGKILL) during the test: RuntimeError: simulated death on request 1",
    "death_between_requests": "exited with code -9 (SIGKILL) during the test: RuntimeError: simulated death after 1",
    "group_member_dies_mid_request": "during the test: RuntimeError: simulated death on request 1",
    "router_dies_during_test": "exited with code -9 (SIGKILL) during the test: the router was killed by SIGKILL",
}

SIM_SUITE = """
import os
import signal
import subprocess
import sys

import pytest


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "crash_oom"})
def test_startup_crash_oom(sgl_worker):
    pass


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "kv_oom"})
def test_startup_kv_oom(sgl_worker):
    pass


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "exit=3"})
def test_startup_exit(sgl_worker):
    pass


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "hang"}, startup_timeout=3)
def test_startup_hang(sgl_worker):
    pass


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "hang_before_bind"}, startup_timeout=3)
def test_startup_hang_before_bind(sgl_worker):
    pass


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "flood=1,exit=1"})
def test_startup_flood(sgl_worker):
    pass


def test_faults_refused(sgl_spawn_worker):
    sgl_spawn_worker(env={"SGLSIM_FAULT": "latency=-1"})


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1"})
def test_death_during_test(sgl_worker):
    sgl_worker.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    sgl_worker.process.wait(10)


def test_killed_by_the_test(sgl_worker):
    os.kill(sgl_worker.pid, signal.SIGKILL)
    sgl_worker.process.wait(10)


@pytest.mark.sgl_workers(count=2, worker_env=[{}, {"SGLSIM_FAULT": "die_after=1"}])
def test_group_member_dies(sgl_workers):
    sgl_workers[1].client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    sgl_workers[1].process.wait(10)


@pytest.mark.sgl_workers(prefill=1, decode=1, decode_env={"SGLSIM_FAULT": "hang"}, startup_timeout=3)
def test_pd_decode_never_ready(sgl_workers):
    pass


@pytest.mark.sgl_router(args=["--no-such-router-flag"])
def test_router_dies_at_startup(sgl_router):
    pass


GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_on_request=1"})
def test_death_mid_request(sgl_worker):
    answer = sgl_worker.client.post("/generate", json=GENERATE)
    assert answer.status_code == 200


@pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "die_after=1"})
def test_death_between_requests(sgl_worker):
    sgl_worker.client.post("/generate", json=GENERATE)
    sgl_worker.process.wait(10)
    sgl_worker.client.post("/generate", json=GENERATE)


@pytest.mark.sgl_workers(count=2, worker_env=[{}, {"SGLSIM_FAULT": "die_on_request=1"}])
def test_group_member_dies_mid_request(sgl_workers):
    for worker in sgl_workers:
        worker.client.post("/generate", json=GENERATE)


@pytest.mark.sgl_workers(count=2)
@pytest.mark.sgl_router(args=["--log-level", "error"])  # its info lines name random ids, in no set order
def test_router_dies_during_test(sgl_workers, sgl_router):
    # another process kills it (the host's OOM killer, a CI timeout): nothing the test itself sent
    subprocess.run([sys.executable, "-c", f"import os; os.kill({sgl_router.pid}, 9)"], check=True)
    sgl_router.process.wait(10)
    sgl_router.client.post("/generate", json=GENERATE)
"""

HEADER = re.compile(r"^_{3,} (?:ERROR at (?:setup|teardown) of )?(test_\w+)(?:\[[^\]]*\])? _{3,}$")


def sections(output: str) -> dict[str, str]:
    """Each test's failure text (its report, sections included), by test name."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in output.splitlines():
        header = HEADER.match(line)
        if header:
            current = found.setdefault(header.group(1), [])
            continue
        if re.match(r"^={3,}", line) or re.match(r"^-{3,} sglang workers -{3,}$", line):
            current = None
            continue
        if current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip("\n") for name, lines in found.items()}


def normalise(text: str, root: Path) -> str:
    """Paths, ports, pids, times and durations out: what stays is what the plugin says."""
    text = text.replace(str(root), "<TEST>").replace(sys.executable, "<PYTHON>")
    text = text.replace(str(REPLAY), "<REPLAY>").replace(str(LOGS), "<LOGS>")
    text = re.sub(r"\[\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?", "[<TIME>", text)
    text = re.sub(r"sglang-(worker|router)-\d+(?:-\d+)?\.log", r"sglang-\1-<PORT>.log", text)
    text = re.sub(r"(127\.0\.0\.1|localhost):\d+", r"\1:<PORT>", text)
    text = re.sub(r"(--(?:[a-z-]*-)?port) \d+", r"\1 <PORT>", text)
    text = re.sub(r"(--prefill \S+ )\d+", r"\1<PORT>", text)
    text = re.sub(r"\b(pid[ =]|parent_pid=|process \[|os\.kill\(|os\.killpg\()\d+", r"\1<PID>", text)
    text = re.sub(r"\b(after|within|in|took) \d+\.\d+ s\b", r"\1 <T> s", text)
    # how many health probes a wait took, and so the line numbers after them, vary with the machine's load
    text = re.sub(r"\b\d+ health probe lines collapsed", "<N> health probe lines collapsed", text)
    text = re.sub(r"… \d+ x (GET|HEAD) ", r"… <N> x \1 ", text)
    # the carets under the failing expression of a test's own frame: Python 3.11+ only
    text = re.sub(r"\n *\^+\n(?=E )", "\n", text)
    if "x GET /ready 200 (health probes)" in text:  # it became ready: whether a probe met its warm-up is timing
        text = re.sub(r"\n *… <N> x GET /ready 503 \(health probes\)(?=\n)", "", text)
    text = re.sub(r"\blog line \d+", "log line <N>", text)
    text = re.sub(r"\bGPUs \d+(?:,\d+)*", "GPUs <G>", text)  # which free GPU a lease got depends on the order
    text = re.sub(r"\bCUDA_VISIBLE_DEVICES=\d+(?:,\d+)*", "CUDA_VISIBLE_DEVICES=<G>", text)
    text = re.sub(r"(elapsed|load_weight|kv_cache_allocation|scheduler_e2e|tokenizer_e2e|prefill|decode|"
                  r"target_verify|draft_prefill|draft_decode|draft_extend)=\d+\.\d+", r"\1=<T>", text)
    return text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The failure texts of both inner sessions, normalised (one run for the module: a few seconds)."""
    import subprocess

    texts: dict[str, str] = {}
    for label, suite, args in (
        ("replay", REPLAY_SUITE, ["--sgl-launcher", f"{sys.executable} {REPLAY}"]),
        ("sim", SIM_SUITE, ["--sgl-engine", "sim"]),
    ):
        root = tmp_path_factory.mktemp(f"failure-texts-{label}")
        (root / f"test_{label}.py").write_text(suite)
        env = {**os.environ, "SGLWORKER_LOG_DIR": str(root / "logs"), "SGLWORKER_LOCK_DIR": str(root / "locks"),
               "SGLSIM_STARTUP_SECONDS": "0.2", "COLUMNS": "120",
               # ready as soon as it binds: no health probe lands in a warm-up whose length the load decides
               "SGLSIM_WARMUP_SECONDS": "0",
               # no Hugging Face cache: the sim says the same about its token counts on every machine
               "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(root / "hf" / "hub")}
        env.pop("PYTEST_ADDOPTS", None)
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                               "-p", "no:xdist", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:4",
                               "--sgl-reorder", "off", *args, f"test_{label}.py"],
                              cwd=root, env=env, capture_output=True, text=True, timeout=240)
        output = done.stdout + done.stderr
        assert "INTERNALERROR" not in output, output
        found = sections(output)
        texts.update({name: normalise(text, root) for name, text in found.items()})
    yield texts


ENTRIES = [(f"test_rule_{name}", words) for name, (_, _, words) in RULES.items()] + \
          [(f"test_{name}", words) for name, words in SCENES.items()]


@pytest.mark.parametrize(("name", "cause"), ENTRIES, ids=[e[0].removeprefix("test_") for e in ENTRIES])
def test_failure_text(corpus: dict[str, str], name: str, cause: str) -> None:
    assert name in corpus, f"{name} did not fail: {sorted(corpus)}"
    text = corpus[name]
    check_goals(name, text, cause)
    path = SNAPSHOTS / f"{name.removeprefix('test_')}.txt"
    if UPDATE:
        path.write_text(text + "\n")
    assert path.exists(), f"no snapshot {path}: run with SGLWORKER_UPDATE_SNAPSHOTS=1 and review it"
    assert text + "\n" == path.read_text(), f"{name}: the text changed from its reviewed snapshot {path}"


def test_the_index_lists_every_entry_with_its_measures(corpus: dict[str, str]) -> None:
    """INDEX.md: each entry's length in lines and the line where its first cause appears."""
    rows = ["| entry | lines | first cause on line |", "|---|---|---|"]
    for name, cause in ENTRIES:
        if name in corpus:
            lines, at = check_goals(name, corpus[name], cause)
            rows.append(f"| {name.removeprefix('test_')} | {lines} | {at} |")
    index = SNAPSHOTS / "INDEX.md"
    text = ("# Failure texts\n\nThe reviewed snapshots of `tests/acceptance/test_failure_texts.py`, with the goals "
            f"each meets: at most {MAX_LINES} lines at the default tail, the first cause within the first "
            f"{CAUSE_WITHIN} lines.\n\n" + "\n".join(rows) + "\n")
    if UPDATE:
        index.write_text(text)
    assert index.read_text() == text


README = Path(__file__).resolve().parents[2] / "README.md"
_PLACEHOLDER = re.compile(r"<(?:T|N|PORT|PID|G|TIME|TEST|PYTHON|REPLAY|LOGS)>")


def _pattern(snapshot_line: str) -> str:
    """A snapshot line as a regex: each placeholder stands for any text."""
    parts = _PLACEHOLDER.split(snapshot_line)
    return ".+?".join(re.escape(part) for part in parts)


def _matches(readme_line: str, snapshot_line: str) -> bool:
    """The README's line is the snapshot's with real values for the placeholders; one ending in `` …`` is cut
    there (a prefix of the snapshot's line)."""
    if not readme_line.endswith(" …"):
        return re.fullmatch(_pattern(snapshot_line), readme_line) is not None
    cut = readme_line[:-2]
    return any(re.fullmatch(_pattern(snapshot_line[:end]), cut) for end in range(len(snapshot_line), 0, -1))


def test_the_readme_failure_example_is_a_reviewed_snapshot() -> None:
    """What the README shows as a failure text is what the plugin writes: each line of the README's example is
    the snapshot's line (real values for the placeholders; a line may be cut with `` …``), in order, up to the
    log tail."""
    section = README.read_text().split("## Read failures", 1)[1]
    marker = re.search(r"<!-- snapshot: (\S+) ", section)
    assert marker, "the README's failure example names no snapshot"
    snapshot = (README.parent / marker.group(1)).read_text().splitlines()
    block = section[marker.end():].split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[-1] == "    …" and block[-2].startswith("last lines of the log"), block[-2:]
    shown = block[:-1]
    assert len(shown) <= len(snapshot)
    for readme_line, snapshot_line in zip(shown, snapshot, strict=False):
        assert _matches(readme_line, snapshot_line), f"README: {readme_line!r}\nsnapshot: {snapshot_line!r}"
