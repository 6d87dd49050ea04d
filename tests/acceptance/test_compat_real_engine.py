"""sglang's own unittest files, changed by one import line, against the real sglang 0.5.23 on the CPU, through
``pytest_sglworker.compat`` (the ``real_engine`` tier; ``slow``: each class launches its own server).

The files are upstream's ``test/registered/openai_server/basic/test_openai_server.py`` (commit ``341ffe19``) and
``test/registered/core/test_srt_endpoint.py`` (commit ``3d0cf68a``), Apache-2.0, from
https://github.com/sgl-project/sglang; they are not part of this repository: ``scripts/sglang_test_files.py`` writes
them from a sglang clone into the user's cache (or ``SGLWORKER_SGLANG_TESTS`` names their folder), and the test is
skipped with that command otherwise; found with the sha256 of ``MANIFEST.json``, each is copied with its
``from sglang.test.test_utils import (`` replaced by ``from pytest_sglworker.compat import (`` (exactly one line
differs) into pytester's directory and run in ONE inner pytest session, a subprocess of the engine's Python (the
files import sglang, which the project's own Python does not have; pytest comes from this Python's site-packages,
appended to the engine's ``sys.path`` so that the engine's own packages win; the plugin is loaded with ``-p``). The
inner ``conftest.py`` registers the tiny CPU model's spec and says, without editing the files:

- ``SGLWORKER_COMPAT_MODELS='meta-llama/Llama-3.2-1B-Instruct=tiny-cpu'``: the model of
  ``DEFAULT_SMALL_MODEL_NAME_FOR_TEST`` is served by the tiny model (and the constant, re-exported by the drop-in,
  is its path: the files' ``get_tokenizer(DEFAULT_SMALL_MODEL_NAME_FOR_TEST)`` read the tiny tokenizer);
- ``budget_opt_out("TestSRTEndpoint", ...)``: its ``setUpClass`` asks for ``--mem-fraction-static 0.7``;
- ``rename_flag("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", ...)``: sglang 0.5.23 has only the split
  flags and its parser rejects the old name before anything starts.

A random-weight model with a 512-token context and vocabulary cannot pass assertions about what the text says, so
these upstream tests are deselected (:data:`DESELECTED`, with the reason of each); every other test of the two files
runs and must pass:

- ``test_openai_server.py``: ``TestOpenAIServer`` (``test_completion``, ``test_completion_stream``,
  ``test_chat_completion``, ``test_chat_completion_stream``: usage counts, logprobs shapes, streaming chunks, one
  finish reason per choice; ``test_penalty``, ``test_model_list``, ``test_retrieve_model``: the model list and a 404
  for another model), ``TestOpenAIServerCustomLogitProcessor::test_custom_logit_processor`` (a logit processor
  pickled by the test and unpickled in the engine's scheduler, which imports the test module and so the drop-in),
  ``TestOpenAIV1Score`` (scores that sum to one per item for text and token input, a 400 for a
  token id out of the vocabulary);
- ``test_srt_endpoint.py``: ``TestSRTEndpoint`` (decode plain, batched, parallel sampling plain and streamed,
  logprobs with text, ``logprob_start_len`` bookkeeping, the custom logit processor for one request and for a mixed
  batch, server info, concurrent server info) and ``TestTokenizeDetokenize`` (tokenize counts, a 400 for a bad
  prompt type, the detokenize round trip, 400/500 for bad token lists). Upstream's own two ``unittest.skip`` tests
  stay skipped.

Outer tests: each file's selection passes (with the counts), every class's server was a plugin worker on
``DEFAULT_URL_FOR_TEST``'s port that its own ``tearDownClass`` (sglang's ``kill_process_tree``, unchanged) ended as
a stop, and nothing is left running.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from pytest_sglworker.engine.cpu_engine import (
    build_tiny_model,
    real_engine_launcher,
    real_engine_missing_reason,
    real_engine_python,
)
from pytest_sglworker.engine.install_dirs import user_cache_root

pytestmark = [pytest.mark.real_engine, pytest.mark.slow, pytest.mark.xdist_group("real-engine")]

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "sglang_tests"
MANIFEST: dict[str, Any] = json.loads((DATA / "MANIFEST.json").read_text(encoding="utf-8"))
#: a folder holding the files at their upstream paths (default: the user's cache, where
#: ``scripts/sglang_test_files.py`` writes them from a sglang clone; they are not part of this repository)
SOURCE_ENV = "SGLWORKER_SGLANG_TESTS"
IMPORT_FROM = "from sglang.test.test_utils import ("
IMPORT_TO = "from pytest_sglworker.compat import ("
MARK = "SGLWORKER_TEST_MARK"
#: a real launch takes 40-60 s on an idle 2-core machine, over 200 s on a busy one
STARTUP_TIMEOUT = 420
PORT = 21000  # sglang's DEFAULT_URL_FOR_TEST outside its CI (CUDA_VISIBLE_DEVICES unset)

CONTENT = "asserts what the random-weight tiny model says"
#: upstream tests not run, by node id (a class: all its tests), and why
DESELECTED: dict[str, str] = {
    "test_openai_server.py::TestOpenAIServer::test_regex": (
        f"{CONTENT}: json.loads of a regex-constrained answer the model has to close within 128 tokens"),
    "test_openai_server.py::TestOpenAIServer::test_response_prefill": (
        f"{CONTENT} (that it starts with '\"name\": \"SmartHome Mini\",'), and names Llama-3.1-8B"),
    "test_openai_server.py::TestOpenAIServerv1Responses": (
        "sglang 0.5.23 serves /v1/responses only with the openai_harmony package, which the CPU engine does not "
        "install ('OpenAI Responses API (/v1/responses) disabled' in its log); its test_regex and "
        "test_response_prefill assert content too"),
    "test_openai_server.py::TestOpenAIV1Rerank": (
        "needs a cross-encoder model (DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST, --is-embedding); the tiny "
        "model is a causal LM"),
    "test_openai_server.py::TestOpenAIServerCustomLogitProcessor::test_custom_logit_processor_batch_mixed": (
        "forces token ids 0-31 and compares the answer with tokenizer.decode: id 0 of the tiny vocabulary is the "
        "special <|endoftext|>, which the answer skips and decode keeps (in Llama-3.2's vocabulary 0-31 are "
        "plain characters)"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_logprob_with_chunked_prefill": (
        "a 72k-token prompt: over the tiny model's 512-token context"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_logprob_mixed": (
        "prompts of 1,000 to 50,000 tokens: over the tiny model's 512-token context"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_cache_tokens": (
        "input ids up to 11,000: over the tiny model's 512-token vocabulary and context"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_logit_bias": (
        "token id 60704 ('Paris' in Llama-3.2's vocabulary): not in the tiny model's 512-token vocabulary"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_logit_bias_isolation": (
        "token id 60704 ('Paris' in Llama-3.2's vocabulary): not in the tiny model's 512-token vocabulary"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_forbidden_token": (
        "token id 23994 ('rice' in Llama-3.2's vocabulary): not in the tiny model's 512-token vocabulary"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_logprob_match": (
        "512 new tokens after a 9-token prompt: over the tiny model's 512-token context (an error, no meta_info)"),
    "test_srt_endpoint.py::TestSRTEndpoint::test_logprob_grammar": (
        f"{CONTENT}: both ' Yes' and ' No' among the top-5 first tokens; the tiny BPE vocabulary has no such tokens"),
}
#: the servers the selection launches, one per class, in run order
LAUNCHED = ["test_openai_server.py::TestOpenAIServer", "test_openai_server.py::TestOpenAIServerCustomLogitProcessor",
            "test_openai_server.py::TestOpenAIV1Score",
            "test_srt_endpoint.py::TestSRTEndpoint", "test_srt_endpoint.py::TestTokenizeDetokenize"]
#: upstream's own unittest.skip
UPSTREAM_SKIPS = {"test_srt_endpoint.py::TestSRTEndpoint::test_stateful_custom_logit_processor",
                  "test_srt_endpoint.py::TestSRTEndpoint::test_stateful_custom_logit_processor_batch_mixed"}

INNER_CONFTEST = '''
from pytest_sglworker.compat import budget_opt_out, rename_flag
from pytest_sglworker.engine.cpu_engine import cpu_engine_spec

MODEL = {model!r}


def pytest_sglworker_register_specs(registry):
    registry.add(cpu_engine_spec("tiny-cpu", MODEL))


budget_opt_out("TestSRTEndpoint", reason="upstream asks for --mem-fraction-static 0.7; a CPU engine has no GPU "
                                         "memory to budget")
rename_flag("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode",
            reason="sglang 0.5.23 split it into -decode and -prefill; upstream's test still passes the old name")
'''

#: runs pytest with the engine's Python; pytest, pluggy and iniconfig come from the site-packages appended last
BOOT = "import sys; sys.path.append({site!r}); import pytest; raise SystemExit(pytest.main())"


def _upstream_file(name: str, info: dict[str, Any]) -> tuple[Path | None, str]:
    """The upstream copy of ``name`` with the manifest's sha256, or None and why not."""
    root = os.environ.get(SOURCE_ENV)
    path = (Path(root) if root else user_cache_root() / "sglang-tests") / info["upstream"]
    if not path.is_file():
        return None, (f"{path} is missing: upstream's {info['upstream']} at commit {info['commit']}; write the "
                      "files from a sglang clone with `python scripts/sglang_test_files.py CLONE` (or name their "
                      f"folder with {SOURCE_ENV}; tests/data/sglang_tests/README.md)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != info["sha256"]:
        return None, (f"{path} is not upstream's {info['upstream']} at commit {info['commit']} (sha256 {digest}, "
                      f"expected {info['sha256']}): its selection and deselections were written for that version")
    return path, ""


def engine_import_failure(python: Path, stderr: str) -> str:
    """What a real engine that cannot import ``sglang.test.test_utils`` means for the compat tiers, and the fix."""
    return (f"the real engine at {python} cannot import sglang.test.test_utils, which every upstream sglang test "
            f"file imports: {(stderr.strip().splitlines() or ['?'])[-1]}. An install made by an older recipe lacks "
            "'datasets': run `sglworker install-real-engine` again (the recipe installs it now), or install the "
            "missing package into that venv with its own pip")


def _with_one_import_changed(text: str) -> str:
    changed = text.replace(IMPORT_FROM, IMPORT_TO, 1)
    differing = [(a, b) for a, b in zip(text.splitlines(), changed.splitlines(), strict=True) if a != b]
    assert differing == [(IMPORT_FROM, IMPORT_TO)], differing
    return changed


def _inner_env(model: Path, base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLWORKER_") or k == "SGLWORKER_REAL_ENGINE"}
    paths = [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]]
    env.update({
        "PYTHONPATH": os.pathsep.join(paths),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "SGLWORKER_COMPAT_MODELS": "meta-llama/Llama-3.2-1B-Instruct=tiny-cpu",
        "SGLWORKER_LOG_DIR": str(base / "logs"),
        "SGLWORKER_LOCK_DIR": str(base / "locks"),
        MARK: os.environ[MARK],
    })
    env.pop("CUDA_VISIBLE_DEVICES", None)  # DEFAULT_URL_FOR_TEST's port follows it
    return env


@dataclass
class InnerRun:
    ret: int
    lines: list[str]
    seconds: float
    report: dict[str, Any]
    base: Path
    leftovers: dict[int, str] = field(default_factory=dict)

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines)

    def outcomes(self, prefix: str) -> dict[str, str]:
        """``{node id: PASSED/FAILED/ERROR/SKIPPED}`` of the inner tests under ``prefix`` (a file or a class)."""
        found: dict[str, str] = {}
        for line in self.lines:
            m = re.match(r"^(PASSED|FAILED|ERROR) (\S+)", line)
            if m and m.group(2).startswith(prefix):
                found[m.group(2)] = "ERROR" if "ERROR" in (m.group(1), found.get(m.group(2))) else m.group(1)
        return found


def _leftovers(mark: str, since: float, needles: Iterable[str]) -> dict[int, str]:
    """Processes of the run still alive: carrying this test's mark, naming the tiny model, or called sglang and
    started during the run by a session leader that is gone or ours (sglang's renamed children lose the mark)."""
    needles = [n for n in needles if n]
    found: dict[int, str] = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status", "create_time"]):
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            name, cmdline = proc.info["name"] or "", " ".join(proc.info["cmdline"] or ())
            if proc.environ().get(MARK) == mark or any(n in cmdline for n in needles):
                found[proc.pid] = f"{name}: {cmdline}"
            elif "sglang" in name + cmdline and proc.info["create_time"] >= since:
                try:
                    ours = psutil.Process(os.getsid(proc.pid)).environ().get(MARK) == mark
                except psutil.NoSuchProcess:
                    ours = True  # an orphan of a session that is gone
                if ours:
                    found[proc.pid] = f"{name}: {cmdline}"
        except (psutil.Error, OSError):
            continue
    return found


def _prepare_inner(base: Path, python: Path, model: Path, sources: dict[str, Path], *,
                   conftest: str = INNER_CONFTEST) -> tuple[dict[str, str], list[str]]:
    """The inner session's ``conftest`` and copies of the upstream files in the folder ``base``, its environment,
    and its command up to the options of its engine: ``(env, command)``. Skips when the engine's Python cannot
    import what the files import (``sglang.test.test_utils`` needs ``datasets``): fails, never skips, since the
    engine is installed and its recipe installs ``datasets``; a skip here hid the whole tier once."""
    base.mkdir(parents=True, exist_ok=True)
    (base / "conftest.py").write_text(conftest.format(model=str(model)), encoding="utf-8")
    for name, path in sources.items():
        (base / name).write_text(_with_one_import_changed(path.read_text(encoding="utf-8")), encoding="utf-8")
    env = _inner_env(model, base)
    probe = subprocess.run([str(python), "-c", "import sglang.test.test_utils"], env=env, capture_output=True,
                           text=True, timeout=600, check=False)
    if probe.returncode != 0:
        pytest.fail(engine_import_failure(python, probe.stderr), pytrace=False)
    site = str(Path(pytest.__file__).resolve().parents[1])
    return env, [str(python), "-c", BOOT.format(site=site), "-p", "pytest_sglworker.plugin", "-rA", "-p",
                 "no:cacheprovider"]


def _finish_inner(args: list[str], base: Path, env: dict[str, str], model: Path, *, timeout: float,
                  report: Path | None = None) -> InnerRun:
    """Run the inner session ``args`` to its end (``timeout``: the most it may take), then wait (bounded) until
    nothing it started is left; its output, its ``--sgl-report`` (``report``) and what was left."""
    since = time.time()
    start = time.monotonic()
    result = subprocess.run(args, cwd=base, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", timeout=timeout, check=False)
    (base / "inner-session.txt").write_text(result.stdout, encoding="utf-8")  # kept for a failure's reader
    run = InnerRun(ret=result.returncode, lines=result.stdout.splitlines(), seconds=time.monotonic() - start,
                   report=json.loads(report.read_text()) if report is not None and report.is_file() else {},
                   base=base)
    deadline = time.monotonic() + 15
    while True:
        run.leftovers = _leftovers(os.environ[MARK], since, [str(model)])
        if not run.leftovers or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def _run_inner(pytester: pytest.Pytester, python: Path, model: Path, sources: dict[str, Path]) -> InnerRun:
    env, command = _prepare_inner(pytester.path, python, model, sources)
    report = pytester.path / "report.json"
    args = [*command, "--sgl-launcher", shlex.join(real_engine_launcher(python)), "--sgl-gpus", "sim:1",
            "--sgl-startup-timeout", str(STARTUP_TIMEOUT), "--sgl-lease-timeout", "600", "--sgl-report", str(report),
            *[f"--deselect={nodeid}" for nodeid in DESELECTED], *sources]
    return _finish_inner(args, pytester.path, env, model, timeout=len(LAUNCHED) * (STARTUP_TIMEOUT + 300),
                         report=report)


_RUN_KEY = pytest.StashKey[Any]()


@pytest.fixture
def inner(request: pytest.FixtureRequest) -> InnerRun:
    """The shared inner session, run by the first outer test that needs it (a failure is cached too)."""
    cached = request.config.stash.get(_RUN_KEY, None)
    if cached is None:
        try:
            python = real_engine_python()
            if python is None:
                raise pytest.skip.Exception(real_engine_missing_reason())
            sources: dict[str, Path] = {}
            for name, info in MANIFEST["files"].items():
                path, why = _upstream_file(name, info)
                if path is None:
                    raise pytest.skip.Exception(why)
                sources[name] = path
            model = build_tiny_model(python, request.getfixturevalue("tmp_path_factory").mktemp("compat") / "tiny")
            cached = _run_inner(request.getfixturevalue("pytester"), python, model, sources)
        except BaseException as exc:  # cached too (a skip included): the other tests must not run it again
            if not isinstance(exc, Exception | pytest.skip.Exception):
                raise
            cached = exc
        request.config.stash[_RUN_KEY] = cached
    if isinstance(cached, pytest.skip.Exception):
        pytest.skip(str(cached))
    if isinstance(cached, BaseException):
        pytest.fail(f"the shared inner session could not run: {cached!r}")
    return cached


def cached_inner_run(request: pytest.FixtureRequest, runs: pytest.StashKey[dict[str, Any]], engine: str,
                     files: dict[str, dict[str, Any]], label: str,
                     run: Callable[[Path, Path, Path, dict[str, Path], str], InnerRun]) -> InnerRun:
    """The inner session of ``engine`` over the pinned ``files``, run once per outer session by ``run(base, python,
    model, sources, engine)`` (a failure is cached too); skipped without the real engine or a pinned file."""
    done = request.config.stash.setdefault(runs, {})
    if engine not in done:
        try:
            done[engine] = _first_inner_run(request, engine, files, label, run)
        except Exception as exc:  # a skip is not an Exception: skipped again by the next test that asks
            done[engine] = exc
    cached = done[engine]
    if isinstance(cached, BaseException):
        pytest.fail(f"the {engine} engine's inner session could not run: {cached!r}")
    assert isinstance(cached, InnerRun)
    return cached


def _first_inner_run(request: pytest.FixtureRequest, engine: str, files: dict[str, dict[str, Any]], label: str,
                     run: Callable[[Path, Path, Path, dict[str, Path], str], InnerRun]) -> InnerRun:
    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    sources: dict[str, Path] = {}
    for name, info in files.items():
        path, why = _upstream_file(name, info)
        if path is None:
            pytest.skip(why)
        sources[name] = path
    factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
    model = build_tiny_model(python, factory.getbasetemp() / f"{label}-tiny")
    return run(factory.mktemp(f"{label}-{engine}"), python, model, sources, engine)


def _selected(file: str, run: InnerRun) -> dict[str, str]:
    return {nodeid: outcome for nodeid, outcome in run.outcomes(file).items()
            if not any(nodeid == d or nodeid.startswith(d + "::") for d in DESELECTED)}


def test_openai_server_file_passes_its_selection(inner: InnerRun) -> None:
    """Upstream's test_openai_server.py, one import changed: every selected test passes."""
    outcomes = _selected("test_openai_server.py", inner)
    assert outcomes and set(outcomes.values()) == {"PASSED"}, (outcomes, inner.stdout[-8000:])
    assert len(outcomes) == 11, outcomes


def test_srt_endpoint_file_passes_its_selection(inner: InnerRun) -> None:
    """Upstream's test_srt_endpoint.py, one import changed: every selected test passes; upstream's own skips stay
    skipped."""
    outcomes = _selected("test_srt_endpoint.py", inner)
    assert outcomes and set(outcomes.values()) == {"PASSED"}, (outcomes, inner.stdout[-8000:])
    assert len(outcomes) == 14, outcomes
    skipped = [line for line in inner.lines if line.startswith("SKIPPED") and "this feature has a bug" in line]
    assert len(skipped) == len(UPSTREAM_SKIPS), skipped
    assert inner.ret == pytest.ExitCode.OK, inner.stdout[-8000:]


def test_each_class_had_a_plugin_worker_its_teardown_stopped(inner: InnerRun) -> None:
    """One launch per class, on DEFAULT_URL_FOR_TEST's port, the budget opt-out and the flag rename visible; the
    file's own tearDownClass (sglang's kill_process_tree) ended each: a stop, the lease released."""
    launches = inner.report.get("launches", [])
    assert [la["tests"][0]["nodeid"] for la in launches] == LAUNCHED, launches
    for launch in launches:
        assert launch["port"] == PORT and launch["outcome"] == "stopped" and launch["t_released"], launch
    srt = launches[LAUNCHED.index("test_srt_endpoint.py::TestSRTEndpoint")]
    assert "(budget opt-out: upstream asks for --mem-fraction-static 0.7" in srt["label"]
    assert "--cuda-graph-max-bs-decode 8" in srt["argv"] and "--cuda-graph-max-bs " not in srt["argv"]
    assert "other_args renamed --cuda-graph-max-bs -> --cuda-graph-max-bs-decode" in inner.stdout
    stats = inner.report.get("workers", {})
    assert sum(s["deaths"] for s in stats.values()) == 0 and sum(s["failures"] for s in stats.values()) == 0


def test_nothing_is_left_running(inner: InnerRun) -> None:
    assert not inner.leftovers, inner.leftovers
    assert "was still running after" not in inner.stdout  # every class ended its own server
