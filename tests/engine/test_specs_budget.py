"""Model specs, the registry, and the mandatory budget check (plain Python, no worker)."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec, SpecRegistry, check_argv
from pytest_sglworker.engine.budget import describe_violation, flag_values
from pytest_sglworker.engine.specs import MAX_MEMORY_GB
from pytest_sglworker.errors import SpecError


def test_ci_worker_args_are_the_budget_and_immutable() -> None:
    assert CI_WORKER_ARGS == ("--mem-fraction-static=0.6", "--cuda-graph-backend-prefill=disabled")
    assert isinstance(CI_WORKER_ARGS, tuple)


def test_builtin_specs() -> None:
    registry = SpecRegistry.with_builtins()
    assert registry.names() == ["llama-1b", "llama-8b", "qwen3-0.6b"]
    qwen = registry.get("qwen3-0.6b")
    assert (qwen.model, qwen.memory_gb, qwen.tp) == ("Qwen/Qwen3-0.6B", 4, 1)
    assert {"chat", "streaming"} <= qwen.features
    assert registry.get("llama-8b").memory_gb == 16
    for spec in registry:
        assert set(CI_WORKER_ARGS) <= set(spec.worker_args)
        assert check_argv(spec.worker_args) == []


def test_spec_is_immutable() -> None:
    spec = SpecRegistry.with_builtins().get("llama-1b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tp = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env["X"] = "1"  # type: ignore[index]


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(SpecError, match=r"unknown model spec 'nope'; known: llama-1b, llama-8b, qwen3-0.6b"):
        SpecRegistry.with_builtins().get("nope")


def test_gateway_dict_specs_are_accepted() -> None:
    registry = SpecRegistry()
    registry.update({"mistral": {"model": "mistralai/Mistral-7B", "memory_gb": 16, "tp": 1,
                                 "features": ["chat"], "worker_args": list(CI_WORKER_ARGS)}})
    spec = registry.get("mistral")
    assert spec.features == frozenset({"chat"}) and spec.worker_args == CI_WORKER_ARGS
    assert registry.with_feature("chat") == [spec]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"model": "m"}, "'model' and 'memory_gb' are required"),
        ({"model": "m", "memory_gb": 4, "gpus": 2}, "unknown key"),
        ({"model": "m", "memory_gb": -1}, "'memory_gb' must be a positive number"),
        ({"model": "m", "memory_gb": 4, "tp": 0}, "'tp' must be an integer from 1 to 4096"),
        ({"model": "m", "memory_gb": 4, "worker_args": "--mem-fraction-static=0.6"}, "not one string"),
    ],
)
def test_bad_dict_specs_are_clear_errors(data: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        SpecRegistry().add(data, name="bad")


def test_duplicate_name_needs_replace() -> None:
    registry = SpecRegistry.with_builtins()
    other = ModelSpec("qwen3-0.6b", "my/qwen", 4)
    with pytest.raises(SpecError, match="already registered; pass replace=True"):
        registry.add(other)
    registry.add(other, replace=True)
    assert registry.get("qwen3-0.6b").model == "my/qwen"


def test_local_model_root(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    spec = SpecRegistry.with_builtins().get("qwen3-0.6b")
    monkeypatch.delenv("SGLWORKER_MODEL_ROOT", raising=False)
    monkeypatch.setenv("ROUTER_LOCAL_MODEL_PATH", str(tmp_path))
    assert spec.resolve_model_path() == "Qwen/Qwen3-0.6B"  # no local copy: the hub id
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert spec.resolve_model_path() == str(tmp_path / "Qwen" / "Qwen3-0.6B")
    other = tmp_path / "other"
    (other / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    monkeypatch.setenv("SGLWORKER_MODEL_ROOT", str(other))  # ours comes first
    assert spec.resolve_model_path() == str(other / "Qwen" / "Qwen3-0.6B")


@pytest.mark.parametrize(
    "argv",
    [
        ["--mem-fraction-static=0.6", "--cuda-graph-backend-prefill=disabled"],
        ["--mem-fraction-static", "0.6", "--cuda-graph-backend-prefill", "disabled"],
        ["--mem-fraction-static=0.5", "--cuda-graph-backend-prefill", "disabled", "--max-total-tokens", "512"],
        [*CI_WORKER_ARGS, "--mem-fraction-static", "0.3"],  # tightening is always allowed
    ],
)
def test_budget_accepts(argv: list[str]) -> None:
    assert check_argv(argv) == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--cuda-graph-backend-prefill=disabled"], ["--mem-fraction-static: missing"]),
        (["--mem-fraction-static=0.6"], ["--cuda-graph-backend-prefill: missing"]),
        ([], ["--mem-fraction-static: missing", "--cuda-graph-backend-prefill: missing"]),
        (["--mem-fraction-static", "0.83", "--cuda-graph-backend-prefill", "disabled"],
         ["--mem-fraction-static: 0.83 is above the budget of 0.6"]),
        ([*CI_WORKER_ARGS, "--mem-fraction-static=0.9"], ["--mem-fraction-static: 0.9 is above"]),
        ([*CI_WORKER_ARGS, "--cuda-graph-backend-prefill", "breakable"], ["'breakable' re-enables the prefill"]),
        ([*CI_WORKER_ARGS, "--cuda-graph-backend-prefill=full"], ["'full' re-enables"]),
        ([*CI_WORKER_ARGS, "--mem", "0.9"], ["0.9 is above"]),  # argparse abbreviation, as sglang accepts it
        ([*CI_WORKER_ARGS, "--cuda-graph-backend-p=full"], ["'full' re-enables"]),
        (["--mem-fraction-static=lots", "--cuda-graph-backend-prefill=disabled"], ["'lots' is not a number"]),
        ([*CI_WORKER_ARGS, "--config", "cfg.yaml"], ["--config: a config file"]),
        ([*CI_WORKER_ARGS, "--mem-fraction-static=0"], ["--mem-fraction-static: 0 is not in (0, 0.6]"]),
        ([*CI_WORKER_ARGS, "--mem-fraction-static=-0.1"], ["--mem-fraction-static: -0.1 is not in (0, 0.6]"]),
        # argparse keeps the last value given: the message names it (not the first, nor one in between)
        (["--mem-fraction-static=0.5", "--cuda-graph-backend-prefill=disabled", "--cuda-graph-backend-prefill=full",
          "--cuda-graph-backend-prefill=breakable"], ["--cuda-graph-backend-prefill: 'breakable' re-enables"]),
        (["--cuda-graph-backend-prefill=disabled", "--mem-fraction-static=0.5", "--mem-fraction-static=0.7",
          "--mem-fraction-static=0.9"], ["--mem-fraction-static: 0.9 is above"]),
    ],
)
def test_budget_rejects(argv: list[str], expected: list[str]) -> None:
    problems = [str(p) for p in check_argv(argv)]
    assert len(problems) == len(expected), problems
    for problem, fragment in zip(problems, expected, strict=True):
        assert fragment in problem


def test_flag_values_keeps_order() -> None:
    assert flag_values(["--mem-fraction-static=0.6", "--mem-fraction-static", "0.4"])["--mem-fraction-static"] == [
        "0.6", "0.4"]


def test_violation_message_names_subject_problem_and_fix() -> None:
    message = describe_violation("model spec 'x'", check_argv([]))
    assert message.startswith("model spec 'x' breaks the mandatory worker budget:")
    assert "--mem-fraction-static: missing" in message
    assert "fix: add CI_WORKER_ARGS" in message


def test_specs_are_hashable_and_equal_by_value() -> None:
    a = ModelSpec("x", "m", 1, env={"A": "1"})
    b = ModelSpec("x", "m", 1, env={"A": "1"})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert ModelSpec("x", "m", 1, env={"A": "2"}) != a


def test_nan_fraction_is_refused() -> None:
    problems = [str(p) for p in check_argv(["--mem-fraction-static", "nan", "--cuda-graph-backend-prefill=disabled"])]
    assert problems == ["--mem-fraction-static: nan is not in (0, 0.6]"]


def test_dict_spec_with_one_feature_string() -> None:
    spec = SpecRegistry().add({"model": "m", "memory_gb": 1, "features": "chat"}, name="x")
    assert spec.features == frozenset({"chat"})


# --------------------------------------------------------------------------------------------------
# non-finite and hostile values (issue #12, item 3): refused where the spec is made, never later in round()


@pytest.mark.parametrize("memory", [float("nan"), float("inf"), float("-inf"), 0, -0.0, -4, True, "4", None, 4j])
def test_memory_gb_must_be_positive_and_finite(memory: object) -> None:
    with pytest.raises(SpecError, match=r"'memory_gb' must be a positive number"):
        ModelSpec("bad", "org/bad", memory)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"model spec 'bad': 'memory_gb' must be a positive number"):
        SpecRegistry().add({"model": "org/bad", "memory_gb": memory}, name="bad")


def test_json_loaded_dict_spec_with_nan_is_refused() -> None:
    import json

    data = json.loads('{"model": "org/bad", "memory_gb": NaN}')  # what a gateway's JSON spec file may hold
    with pytest.raises(SpecError, match="got nan"):
        SpecRegistry().update({"bad": data})
    data = json.loads('{"model": "org/bad", "memory_gb": 1e999}')
    with pytest.raises(SpecError, match="got inf"):
        SpecRegistry().update({"bad": data})


def test_large_finite_memory_is_refused_or_never_fits() -> None:
    from pytest_sglworker.resources.gpus import GpuInfo, can_ever_fit

    for memory in (1e300, 1e308, 10**400):  # 1e308 * 1024 overflowed round() in memory_mib: an INTERNALERROR
        with pytest.raises(SpecError, match=r"model spec 'huge': 'memory_gb' \(GiB of memory on each GPU\) must be "
                                            r"at most 1048576, got"):
            ModelSpec("huge", "org/huge", memory)
    spec = ModelSpec("huge", "org/huge", MAX_MEMORY_GB)
    assert spec.memory_mib == 1024**3
    gpu = GpuInfo(index=0, uuid="GPU-0", name="sim", total_mib=81920, free_mib=81920)
    assert "can never fit" in (can_ever_fit([gpu], 1, spec.memory_mib) or "")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"features": 5}, "'features' must be a list of feature names, got 5"),
        ({"features": ["chat", 1]}, "every feature must be a non-empty string"),
        ({"features": [""]}, "every feature must be a non-empty string"),
        ({"model": "org/\0bad"}, "'model' must be a Hugging Face id or a local path"),
        ({"worker_args": (*CI_WORKER_ARGS, "--x\0")}, "holds a NUL character"),
        ({"env": {"A=B": "1"}}, "an 'env' name is empty or holds '=' or NUL"),
        ({"env": {"A": "1\0"}}, "an 'env' name is empty or holds '=' or NUL, or a value holds NUL"),
        ({"env": 5}, "'env' must map strings to strings"),
        ({"description": 5}, "'description' must be a string"),
    ],
)
def test_hostile_fields_are_clear_spec_errors(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"name": "bad", "model": "org/bad", "memory_gb": 4, **kwargs}
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(**fields)  # type: ignore[arg-type]


def test_dict_spec_with_env_not_a_mapping_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="'env' must map strings to strings, got 'A=1'"):
        SpecRegistry().add({"model": "m", "memory_gb": 1, "env": "A=1"}, name="x")


@pytest.mark.parametrize("value", [0, -1.5, float("nan"), float("inf"), True, "30", 10**400])
def test_a_declared_startup_must_be_positive_seconds(value: object) -> None:
    with pytest.raises(SpecError, match=r"model spec 'm': 'startup_seconds' must be a positive number of seconds"):
        ModelSpec("m", "org/m", 4, startup_seconds=value)  # type: ignore[arg-type]


def test_a_declared_startup_is_read_from_a_dict_and_is_no_part_of_the_identity() -> None:
    spec = ModelSpec.from_dict("m", {"model": "org/m", "memory_gb": 4, "startup_seconds": 45})
    assert spec.startup_seconds == 45
    plain = ModelSpec.from_dict("m", {"model": "org/m", "memory_gb": 4})
    assert plain.startup_seconds is None
    assert spec == plain and hash(spec) == hash(plain)  # the same worker: the declaration only schedules it
