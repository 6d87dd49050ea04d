"""cpu_engine: the recipe for the real sglang on a CPU (spec, env, launcher, venv discovery) and the tiny
model builder (``tiny_model.py``, run with the real engine's python)."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sglworker.engine.budget import check_argv, check_spec
from pytest_sglworker.engine.cpu_engine import (
    CPU_ENGINE_ARGS,
    CPU_ENGINE_ENV,
    REAL_ENGINE_ENV_VAR,
    REAL_ENGINE_MARKER,
    TINY_MODEL_SCRIPT,
    TinyModelError,
    build_tiny_model,
    cpu_engine_spec,
    real_engine_launcher,
    real_engine_missing_reason,
    real_engine_python,
)
from pytest_sglworker.engine.specs import CI_WORKER_ARGS, ModelSpec, SpecRegistry
from pytest_sglworker.errors import SglWorkerError


def test_constants() -> None:
    assert dict(CPU_ENGINE_ENV) == {"SGLANG_USE_CPU_ENGINE": "1"}
    assert " ".join(CPU_ENGINE_ARGS) == (
        "--device cpu --attention-backend torch_native --sampling-backend pytorch "
        "--cuda-graph-backend-decode=disabled --max-total-tokens 1024 --sleep-on-idle"
    )


def test_spec_carries_the_budget_and_the_recipe() -> None:
    spec = cpu_engine_spec("cpu-tiny", "/models/tiny")
    assert isinstance(spec, ModelSpec)
    assert spec.worker_args == (*CI_WORKER_ARGS, *CPU_ENGINE_ARGS)
    assert check_spec(spec) == []
    assert dict(spec.env) == {"SGLANG_USE_CPU_ENGINE": "1"}
    assert spec.features == frozenset({"chat", "streaming"})
    assert spec.model == "/models/tiny" and spec.tp == 1
    assert 0 < spec.memory_gb <= 2
    assert spec.resolve_model_path({}) == "/models/tiny"
    SpecRegistry([spec])  # registers like any other spec


def test_spec_extra_args_and_features() -> None:
    spec = cpu_engine_spec("cpu-x", "/m", features=["chat"], extra_args=["--skip-server-warmup", "--random-seed", "1"])
    assert spec.worker_args[-3:] == ("--skip-server-warmup", "--random-seed", "1")
    assert spec.worker_args[: len(CI_WORKER_ARGS)] == CI_WORKER_ARGS
    assert spec.features == frozenset({"chat"})
    assert check_spec(spec) == []


def test_budget_stays_mandatory_with_extra_args() -> None:
    spec = cpu_engine_spec("cpu-greedy", "/m", extra_args=("--mem-fraction-static=0.9",))
    problems = check_spec(spec)
    assert [p.flag for p in problems] == ["--mem-fraction-static"]
    assert check_argv((*spec.worker_args, "--cuda-graph-backend-prefill=breakable"))


def test_launcher() -> None:
    assert real_engine_launcher(Path("/v/bin/python")) == ["/v/bin/python", "-m", "sglang.launch_server"]
    assert real_engine_launcher("/v/bin/python")[0] == "/v/bin/python"


def _fake_venv(root: Path, *, marker: bool = True) -> Path:
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    if marker:
        (root / REAL_ENGINE_MARKER).write_text("sglang=0.5.23\n")
    return python


def test_real_engine_python_explicit_and_env(tmp_path: Path) -> None:
    python = _fake_venv(tmp_path / "venv")
    assert real_engine_python(tmp_path / "venv", environ={}) == python
    assert real_engine_python(str(tmp_path / "venv"), environ={}) == python
    assert real_engine_python(environ={REAL_ENGINE_ENV_VAR: str(tmp_path / "venv")}) == python
    # explicit beats the variable; a variable naming nothing finds nothing (no silent fallback)
    assert real_engine_python(tmp_path / "venv", environ={REAL_ENGINE_ENV_VAR: "/nowhere"}) == python
    assert real_engine_python(environ={REAL_ENGINE_ENV_VAR: str(tmp_path / "missing")}) is None
    assert real_engine_python(tmp_path / "missing", environ={}) is None
    reason = real_engine_missing_reason(environ={REAL_ENGINE_ENV_VAR: str(tmp_path / "missing")})
    assert REAL_ENGINE_ENV_VAR in reason and "sglworker install-real-engine" in reason
    assert real_engine_missing_reason(tmp_path / "venv", environ={}) == ""


def test_real_engine_python_keeps_the_venv_symlink(tmp_path: Path) -> None:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    found = real_engine_python(tmp_path / "venv", environ={})
    assert found == tmp_path / "venv" / "bin" / "python"  # not resolved to the base interpreter


def test_real_engine_python_repo_root(tmp_path: Path) -> None:
    python = _fake_venv(tmp_path / "repo" / ".cache" / "real-engine")
    assert real_engine_python(tmp_path / "repo", environ={}) == python


def test_real_engine_python_default_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = tmp_path / "pytest-sglworker" / "real-engine"
    assert real_engine_python(environ={}) is None
    assert "not installed" in real_engine_missing_reason(environ={})
    python = _fake_venv(default, marker=False)
    assert real_engine_python(environ={}) is None  # an unfinished install is not used
    assert "unfinished" in real_engine_missing_reason(environ={})
    (default / REAL_ENGINE_MARKER).write_text("sglang=0.5.23\n")
    assert real_engine_python(environ={}) == python


# --- the tiny model builder --------------------------------------------------------------------------------


def test_tiny_model_script_is_standalone() -> None:
    tree = ast.parse(TINY_MODEL_SCRIPT.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("pytest_sglworker"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("pytest_sglworker") for a in node.names)


def test_tiny_model_usage_without_torch(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(TINY_MODEL_SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_build_tiny_model_failure_carries_the_output(tmp_path: Path) -> None:
    python = _script(tmp_path / "python", "echo 'Traceback: no torch here'\nexit 3\n")
    with pytest.raises(TinyModelError) as info:
        build_tiny_model(python, tmp_path / "model")
    assert isinstance(info.value, SglWorkerError)
    assert "exit code 3" in str(info.value) and "no torch here" in str(info.value)
    assert str(tmp_path / "model") in str(info.value)


def test_build_tiny_model_success_without_config_is_a_failure(tmp_path: Path) -> None:
    python = _script(tmp_path / "python", "exit 0\n")
    with pytest.raises(TinyModelError, match="exit code 0"):
        build_tiny_model(python, tmp_path / "model")


def test_build_tiny_model_timeout(tmp_path: Path) -> None:
    python = _script(tmp_path / "python", "echo started\nexec sleep 30\n")
    # the 30 s sleep would end with exit 0 ("success without config"): only the 1 s timeout says "longer than 1 s"
    with pytest.raises(TinyModelError, match="longer than 1 s"):
        build_tiny_model(python, tmp_path / "model", timeout=1)


def test_build_tiny_model_missing_python(tmp_path: Path) -> None:
    with pytest.raises(TinyModelError, match="cannot run"):
        build_tiny_model(tmp_path / "nope", tmp_path / "model")


def test_build_tiny_model_passes_arguments_without_a_shell(tmp_path: Path) -> None:
    python = _script(
        tmp_path / "python",
        'printf "%s\\n" "$@" > "$(dirname "$0")/args"\nmkdir -p "$2"\necho "{}" > "$2/config.json"\n',
    )
    out = tmp_path / "a dir with spaces; $(x)"
    assert build_tiny_model(python, out) == out
    assert (tmp_path / "args").read_text().splitlines() == [str(TINY_MODEL_SCRIPT), str(out)]


@pytest.fixture(scope="module")
def real_python() -> Path:
    python = real_engine_python()
    if python is None:
        pytest.skip(f"real-engine tests need the real sglang: {real_engine_missing_reason()}")
    return python


@pytest.fixture(scope="module")
def tiny_model(real_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(real_python, tmp_path_factory.mktemp("tiny") / "model")


RECIPE = Path(__file__).resolve().parents[2] / "pytest_sglworker" / "tools" / "recipes" / "real_engine"


def _names(path: Path) -> dict[str, str]:
    """``{normalized name: line}`` of a requirements or constraints file (PEP 503 names)."""
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            found[re.sub(r"[-_.]+", "-", re.split(r"[=<>~! \[]", line, maxsplit=1)[0]).lower()] = line
    return found


def test_every_package_of_the_engine_recipe_is_pinned_datasets_included() -> None:
    """Each requirement has an exact pin; ``datasets`` is one (``sglang.test.test_utils`` imports it: without it
    every upstream test file of the compat tiers fails to import)."""
    required, pinned = _names(RECIPE / "requirements.txt"), _names(RECIPE / "constraints.txt")
    assert "datasets" in required
    assert not set(required) - set(pinned), set(required) - set(pinned)
    assert all("==" in line for line in pinned.values()), [line for line in pinned.values() if "==" not in line]


_VERSIONS = ("import importlib.metadata as m, json, sys\n"
             "found = {}\n"
             "for name in json.loads(sys.argv[1]):\n"
             "    try:\n"
             "        found[name] = m.version(name)\n"
             "    except m.PackageNotFoundError:\n"
             "        found[name] = None\n"
             "print(json.dumps(found))")


@pytest.mark.real_engine
def test_the_engine_has_every_package_its_recipe_pins(real_python: Path) -> None:
    """The installed engine holds each requirement of the recipe at its pinned version. The compat tiers run upstream
    files that import ``sglang.test.test_utils``, which needs ``datasets``: an install by an older recipe, without it,
    skipped those tiers once; now it fails here, in the default run (a metadata read, not the 10 s import; the
    recipe's own last step imports ``sglang.test.test_utils``)."""
    required, pinned = _names(RECIPE / "requirements.txt"), _names(RECIPE / "constraints.txt")
    wanted = {name: pinned[name].split("==", 1)[1] for name in required}
    probe = subprocess.run([str(real_python), "-c", _VERSIONS, json.dumps(sorted(wanted))], capture_output=True,
                           text=True, timeout=120, check=True)
    found = json.loads(probe.stdout)
    wrong = {name: (found[name], version) for name, version in wanted.items() if found[name] != version}
    assert not wrong, (
        f"the real engine at {real_python} was not installed by this recipe ({{package: (installed, pinned)}}: "
        f"{wrong}); run `sglworker install-real-engine` again")


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.real_engine
def test_tiny_model_is_a_chatml_llama(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 512 and config["num_hidden_layers"] == 2
    assert config["dtype"] == "bfloat16"
    tokenizer = json.loads((tiny_model / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(specials)
    assert config["eos_token_id"] == specials["<|im_end|>"]
    template = (tiny_model / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    assert (tiny_model / "model.safetensors").stat().st_size < 1_000_000
    assert (tiny_model / ".sglworker-tiny-model").is_file()
    assert not [p for p in tiny_model.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.real_engine
def test_tiny_model_is_idempotent(real_python: Path, tiny_model: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()}
    assert build_tiny_model(real_python, tiny_model) == tiny_model
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()} == before
    # The builder's own run with the marker in place imports no torch (Python's import log says what it loaded).
    run = subprocess.run([str(real_python), "-X", "importtime", str(TINY_MODEL_SCRIPT), str(tiny_model)],
                         capture_output=True, text=True, timeout=120, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "tempfile" in imported and "torch" not in imported and "transformers" not in imported, run.stderr[-2000:]


@pytest.mark.real_engine
def test_tiny_model_is_deterministic_and_rebuilds_over_a_stale_marker(
    real_python: Path, tiny_model: Path, tmp_path: Path
) -> None:
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / ".sglworker-tiny-model").write_text("an older recipe\n")
    build_tiny_model(real_python, stale)
    assert _digest(stale) == _digest(tiny_model)  # same recipe, same bytes


def test_cpu_rank_binding_gives_each_rank_its_share_of_the_cores() -> None:
    """sglang's CPU engine refuses more ranks than NUMA nodes unless SGLANG_CPU_OMP_THREADS_BIND names each rank's
    cores: one share per rank, in order, ranges where contiguous; ranks share cores when there are fewer."""
    from pytest_sglworker.engine.cpu_engine import CPU_RANK_BINDING_VAR, cpu_rank_binding

    assert CPU_RANK_BINDING_VAR == "SGLANG_CPU_OMP_THREADS_BIND"
    assert cpu_rank_binding(1, [0, 1]) == {}
    assert cpu_rank_binding(2, [1, 0]) == {CPU_RANK_BINDING_VAR: "0|1"}
    assert cpu_rank_binding(2, [0, 1, 2, 3]) == {CPU_RANK_BINDING_VAR: "0-1|2-3"}
    assert cpu_rank_binding(2, [0, 2, 4, 6]) == {CPU_RANK_BINDING_VAR: "0,2|4,6"}
    assert cpu_rank_binding(2, [5]) == {CPU_RANK_BINDING_VAR: "5|5"}
    assert cpu_rank_binding(3, list(range(8))) == {CPU_RANK_BINDING_VAR: "0-1|2-4|5-7"}


@pytest.mark.parametrize(("argv", "ranks"), [
    ([], 1),
    (["--tp-size", "2"], 2),
    (["--dp-size", "2"], 2),
    (["--dp", "2", "--tp-size", "2"], 4),  # each data-parallel replica runs its own TP ranks
    (["--tp-size", "1", "--pp-size", "2", "--dp-size=2"], 4),
    (["--tp-size", "2", "--tp-size", "1"], 1),  # argparse keeps the last value
    (["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"], 2),  # attention DP groups within the TP ranks
    (["--dp-size", "two", "--tp-size", "2"], 2),  # malformed: sglang's own parser refuses it at launch
])
def test_worker_ranks_counts_what_sglangs_cpu_engine_binds(argv: list[str], ranks: int) -> None:
    """As sglang 0.5.23's ``_bind_threads_if_cpu`` counts them: dp_size x tp_size x pp_size, where DP attention
    sets dp_size back to 1 (the attention-DP groups live inside the TP ranks)."""
    from pytest_sglworker.engine.sglang_facts import worker_ranks

    assert worker_ranks(["python", "-m", "sglang.launch_server", *argv]) == ranks


def test_cpu_rank_env_binds_the_ranks_of_a_cpu_engine_worker_only() -> None:
    """The binding goes to a worker of several ranks whose environment is the CPU engine's, whether the spec or the
    user's environment says so; never to another engine, to one rank, or over a binding named already."""
    from pytest_sglworker.engine.cpu_engine import CPU_RANK_BINDING_VAR, cpu_rank_env

    cpu, dp2 = dict(CPU_ENGINE_ENV), ["--dp-size", "2"]
    assert cpu_rank_env(dp2, cpu, {}, cpus=[0, 1, 2, 3]) == {CPU_RANK_BINDING_VAR: "0-1|2-3"}
    assert cpu_rank_env(["--tp-size", "2", *dp2], {}, cpu, cpus=[0, 1, 2, 3]) == {CPU_RANK_BINDING_VAR: "0|1|2|3"}
    assert cpu_rank_env(["--tp-size", "1"], cpu, {}, cpus=[0, 1]) == {}  # one rank
    assert cpu_rank_env(dp2, {}, {"CUDA_VISIBLE_DEVICES": "0,1"}, cpus=[0, 1]) == {}  # a GPU worker
    assert cpu_rank_env(dp2, {"SGLANG_USE_CPU_ENGINE": "0"}, cpu, cpus=[0, 1]) == {}  # the worker's own env wins
    assert cpu_rank_env(dp2, cpu, {CPU_RANK_BINDING_VAR: "0|0"}, cpus=[0, 1]) == {}  # the user's binding
    assert cpu_rank_env(dp2, {**cpu, CPU_RANK_BINDING_VAR: "1|1"}, {}, cpus=[0, 1]) == {}  # the spec's binding
