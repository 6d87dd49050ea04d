"""Upstream's own gateway e2e test files, unchanged, through the drop-in: their conftest, ``infra/`` and
``fixtures/`` replaced by the one line ``pytest_plugins = ["pytest_sglworker.compat.gateway"]``.

The files are not part of this repository: ``tests/data/gateway_e2e/MANIFEST.json`` pins each one (upstream path,
commit, sha256) and ``scripts/gateway_e2e_files.py CLONE`` writes them from a sglang clone into the user's cache
(or ``SGLWORKER_SGLANG_TESTS`` names their folder). The slow tier runs every pinned file it finds with the pinned
bytes on the simulated engine and the real router, and holds the outcome to the manifest: every test passes or is
skipped by upstream's own reason, except those ``classified`` for that engine, which must still fail as said, or be
skipped by the drop-in where the classification's ``outcome`` says ``SKIPPED`` (one that passes now makes its
classification stale: the test says so), or may pass or fail where the classification says ``"either": true`` (its
outcome is the sampling of a random-weight model, and the reason says so). Without the files it is skipped with the
command that writes them. The manifest itself (every file pinned, none in the repository, every classified test in
a pinned file) is checked in the default run, as is the script.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_sglworker.compat import models as compat_models
from pytest_sglworker.engine.install_dirs import user_cache_root

REPO = Path(__file__).resolve().parents[2]
MANIFEST_PATH = REPO / "tests" / "data" / "gateway_e2e" / "MANIFEST.json"
MANIFEST: dict[str, Any] = json.loads(MANIFEST_PATH.read_text(encoding="utf-8"))
SOURCE_ENV = "SGLWORKER_SGLANG_TESTS"
#: ``1``: the slow tier rewrites tests/data/gateway_e2e/outcomes.json (then run tests/compat_gateway/outcomes_doc.py)
WRITE_ENV = "SGLWORKER_GATEWAY_E2E_WRITE"
OUTCOMES_FILE = REPO / "tests" / "data" / "gateway_e2e" / "outcomes.json"
TINY = str(REPO / "tests" / "data" / "sim" / "tiny-llama")
PREFIX = "sgl-model-gateway/e2e_test/"

#: The one line, and the specs that serve the suite's model ids (the tiny Llama; the embedding id with
#: --is-embedding, which sglang infers from e5-mistral's architecture and not from the tiny model's).
INNER_CONFTEST = f'''
pytest_plugins = ["pytest_sglworker.compat.gateway"]

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec


def pytest_sglworker_register_specs(registry):
    args = (*CI_WORKER_ARGS, "--skip-server-warmup")
    registry.add(ModelSpec(name="tiny", model={TINY!r}, memory_gb=1, features=frozenset({{"chat"}}),
                           worker_args=args))
    registry.add(ModelSpec(name="tiny-embed", model={TINY!r}, memory_gb=1, features=frozenset({{"embedding"}}),
                           worker_args=(*args, "--is-embedding")))
'''
MODEL_MAP = ("llama-8b=tiny,llama-1b=tiny,gpt-oss=tiny,deepseek-7b=tiny,qwen-30b=tiny,qwen-7b=tiny,qwen-14b=tiny,"
             "mistral-7b=tiny,embedding=tiny-embed")


def _upstream_file(info: dict[str, Any]) -> tuple[Path | None, str]:
    """The copy of one pinned file with the manifest's sha256, or None and why not."""
    root = os.environ.get(SOURCE_ENV)
    path = (Path(root) if root else user_cache_root() / "sglang-tests") / info["upstream"]
    if not path.is_file():
        return None, (f"{path} is missing: upstream's {info['upstream']} at commit {info['commit']}; write the "
                      "files from a sglang clone with `python scripts/gateway_e2e_files.py CLONE` (or name their "
                      f"folder with {SOURCE_ENV}; tests/data/gateway_e2e/README.md)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != info["sha256"]:
        return None, (f"{path} is not upstream's {info['upstream']} at commit {info['commit']} (sha256 {digest}, "
                      f"expected {info['sha256']}): its classification was written for that version")
    return path, ""


# ------------------------------------------------------------------------------------------------ the default run
def test_the_manifest_pins_every_file_and_classifies_only_their_tests() -> None:
    files = MANIFEST["files"]
    assert files
    for name, info in files.items():
        assert info["upstream"] == PREFIX + name
        assert len(info["commit"]) == 40 and len(info["sha256"]) == 64
        assert not (REPO / "tests" / "data" / "gateway_e2e" / name).exists()  # upstream code stays out
    for engine, tests in MANIFEST["classified"].items():
        assert engine in ("sim", "real")
        for nodeid, why in tests.items():
            assert nodeid.split("::")[0] in files, nodeid
            assert why["kind"] in ("inherent", "defect, not fixed yet") and why["reason"].strip(), nodeid
            assert why.get("either", False) in (True, False), nodeid
            assert why.get("outcome", "FAILED") in ("FAILED", "SKIPPED"), nodeid
    for engine, left_out in MANIFEST.get("deselected", {}).items():
        assert engine in ("sim", "real") and all(name in files and why.strip() for name, why in left_out.items())


def test_the_generated_page_is_the_committed_outcomes() -> None:
    """``docs/GATEWAY_E2E.md`` is what ``outcomes_doc.py`` renders from the manifest and the committed outcomes, and
    every committed outcome that is not a pass or upstream's own skip is classified (none unexplained)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from outcomes_doc import DOC_FILE, render

    outcomes = json.loads(OUTCOMES_FILE.read_text(encoding="utf-8"))
    assert DOC_FILE.read_text(encoding="utf-8") == render(MANIFEST, outcomes), \
        "regenerate it: python tests/compat_gateway/outcomes_doc.py"
    for engine, ran in outcomes["engines"].items():
        classified = MANIFEST["classified"].get(engine, {})
        either = {t for t, why in classified.items() if why.get("either")}
        skipped = {t for t, why in classified.items() if why.get("outcome") == "SKIPPED"}
        not_passing = {t for t, o in ran.items() if o not in ("PASSED", "SKIPPED")}
        failing = set(classified) - skipped
        assert not_passing <= failing and failing - not_passing <= either, engine
        assert all(ran.get(t) == "SKIPPED" for t in skipped), engine


def test_the_script_writes_the_pinned_files_from_a_clone(tmp_path: Path) -> None:
    """``scripts/gateway_e2e_files.py`` writes each file at its commit with its sha256 checked, and names a file
    the clone lacks with the fetch that brings it."""
    clone = tmp_path / "sglang"
    path = PREFIX + "router/test_x.py"
    (clone / path).parent.mkdir(parents=True)
    (clone / path).write_text("old = 1\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    (clone / path).write_text("new = 2\n")
    git("commit", "-qam", "two")
    manifest = {"files": {"router/test_x.py": {"upstream": path, "commit": first,
                                               "sha256": hashlib.sha256(b"old = 1\n").hexdigest()},
                          "router/test_y.py": {"upstream": PREFIX + "router/test_y.py", "commit": first,
                                               "sha256": "0" * 64}}}
    spec = importlib.util.spec_from_file_location("sglworker_gateway_e2e_files", REPO / "scripts" /
                                                  "gateway_e2e_files.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.MANIFEST == MANIFEST_PATH
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    dest = tmp_path / "dest"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gateway_e2e_files.py"), str(clone), str(dest)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1  # the real manifest's commits are not in this clone: each named, none written
    assert f"not written: {MANIFEST['files']['router/test_worker_api.py']['upstream']}" in done.stderr
    assert module.main([str(clone), str(dest), "--manifest", str(tmp_path / "m.json")]) == 1
    assert (dest / path).read_text() == "old = 1\n"  # the pinned commit's bytes, not the clone's head


# ------------------------------------------------------------------------------------------------ the slow tier
def _outcomes(lines: list[str]) -> dict[str, str]:
    """Each test's outcome from the run's verbose lines (``e2e_test/FILE::TEST PASSED [ 5%]``); a test that passed
    and then errored at teardown is an error."""
    found: dict[str, str] = {}
    for line in lines:
        m = re.match(r"^e2e_test/(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
        if m and found.get(m.group(1)) != "ERROR":
            found[m.group(1)] = m.group(2)
    return found


#: The real engine's specs: the CPU recipe (cpu_engine_spec) on a tiny model built with the engine's Python, with the
#: same --skip-server-warmup (the gRPC servicer's warmup ids are over the tiny vocab) and --is-embedding.
REAL_CONFTEST = '''
pytest_plugins = ["pytest_sglworker.compat.gateway"]

import dataclasses

from pytest_sglworker import cpu_engine_spec


def pytest_sglworker_register_specs(registry):
    chat = cpu_engine_spec("tiny", {model!r})
    registry.add(dataclasses.replace(chat, worker_args=(*chat.worker_args, "--skip-server-warmup")))
    embed = cpu_engine_spec("tiny-embed", {model!r})
    registry.add(dataclasses.replace(embed, worker_args=(*embed.worker_args, "--skip-server-warmup", "--is-embedding")))
'''


def _engine_args(engine: str, pytester: pytest.Pytester, tmp_path: Path) -> list[str]:
    """The inner session's engine options and its conftest; a skip with the install command for a missing engine."""
    if engine == "sim":
        (pytester.path / "e2e_test" / "conftest.py").write_text(INNER_CONFTEST)
        return ["--sgl-engine", "sim"]
    from pytest_sglworker.engine.cpu_engine import build_tiny_model, real_engine_missing_reason, real_engine_python

    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    model = build_tiny_model(python, tmp_path / "tiny")
    (pytester.path / "e2e_test" / "conftest.py").write_text(REAL_CONFTEST.format(model=str(model)))
    return ["--sgl-launcher", f"{python} -m sglang.launch_server", "--sgl-gpus", "sim:4", "--sgl-startup-timeout",
            "300"]


@pytest.mark.slow
@pytest.mark.router
@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None or importlib.util.find_spec("openai") is None,
                    reason="needs the sglang router and openai: pip install 'pytest-sglworker[test]'")
@pytest.mark.parametrize("engine", ["sim", pytest.param("real", marks=pytest.mark.real_engine)])
def test_upstream_files_run_unchanged(engine: str, pytester: pytest.Pytester, sim_env: dict[str, str],
                                      monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every pinned file found, on the simulated engine and on the real CPU engine: each test passes or is skipped
    by upstream's own reason, but those the manifest classifies for that engine (which must still fail) and the
    files it leaves out on that engine (``deselected``, with why)."""
    found: dict[str, Path] = {}
    missing = []
    for name, info in MANIFEST["files"].items():
        path, why = _upstream_file(info)
        if path is None:
            missing.append(why)
        else:
            found[name] = path
    if not found:
        pytest.skip("; ".join(missing))
    left_out = MANIFEST.get("deselected", {}).get(engine, {})
    for name, path in found.items():
        if name in left_out:
            continue
        target = pytester.path / "e2e_test" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())  # unchanged: the pinned bytes
    engine_args = _engine_args(engine, pytester, tmp_path)
    for key in ("SGLWORKER_MODELS", "SGLWORKER_GPUS", "OPENAI_API_KEY", "XAI_API_KEY", "E2E_MODEL",
                "SKIP_BACKEND_SETUP", "SKIP_MODEL_POOL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(compat_models.ENV_MODELS, MODEL_MAP)
    result = pytester.runpytest_subprocess("-v", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", *engine_args,
                                           "e2e_test", timeout=1500)
    lines = result.outlines + result.errlines
    outcomes = _outcomes(lines)
    classified = MANIFEST["classified"].get(engine, {})
    ran = {test for test in outcomes if test.split("::")[0] in found}
    assert ran, "\n".join(lines[-80:])
    wrong = {test: outcome for test, outcome in outcomes.items()
             if test not in classified and outcome not in ("PASSED", "SKIPPED")}
    # a classified test still does what its classification says: fails (FAILED/ERROR), or is skipped by the drop-in;
    # one whose classification says "either" may pass or fail
    stale = {test: outcomes.get(test) for test, why in classified.items()
             if not why.get("either") and test.split("::")[0] in found
             and outcomes.get(test) not in (("SKIPPED",) if why.get("outcome") == "SKIPPED" else ("FAILED", "ERROR"))}
    if os.environ.get(WRITE_ENV) == "1":  # the outcomes the generated page shows
        written = json.loads(OUTCOMES_FILE.read_text()) if OUTCOMES_FILE.is_file() else {"engines": {}}
        written["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                                           capture_output=True, text=True, check=True).stdout.strip()
        written["engines"][engine] = dict(sorted(outcomes.items()))
        OUTCOMES_FILE.write_text(json.dumps(written, indent=1) + "\n")
    assert not wrong, f"not classified, and not passing: {wrong}\n" + "\n".join(lines[-120:])
    assert not stale, f"classified as failing, but now {stale}: update tests/data/gateway_e2e/MANIFEST.json"
    assert "INTERNALERROR" not in "\n".join(lines)
