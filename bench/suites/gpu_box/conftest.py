"""The GPU-box suite of bench/bound.py: worker configurations read from the plan that ``BENCH_BOX_PLAN`` names.

The plan is JSON: ``{"configurations": [{"name": "c00", "kind": "tp1" | "tp2" | "pd", "startup": S,
"tests": [D, ...], "declared": S'}, ...]}`` (``declared``, optional: the spec's ``startup_seconds``). Each
configuration is a model spec of its own (``tp=2`` for ``tp2``; ``pd`` is a 1 prefill + 1 decode group of a
``tp=1`` spec) whose simulated engine starts in ``S`` seconds (``SGLSIM_STARTUP_SECONDS`` in the spec's env), and
has one test per ``D``, which holds its worker for ``D`` seconds (the work a GPU would do). Run with
``--sgl-model`` naming every configuration (bench/bound.py does); the test functions are parametrized over all of
them and every item that the plan does not hold is deselected.
"""

from __future__ import annotations

import json
import os

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

PLAN = json.loads(open(os.environ["BENCH_BOX_PLAN"], encoding="utf-8").read()) \
    if os.environ.get("BENCH_BOX_PLAN") else {"configurations": []}
CONFIGS = {c["name"]: c for c in PLAN["configurations"]}


def pytest_sglworker_register_specs(registry):  # type: ignore[no-untyped-def]
    for c in CONFIGS.values():
        registry.add(ModelSpec(
            name=c["name"], model=f"bench/box-{c['name']}", memory_gb=4, tp=2 if c["kind"] == "tp2" else 1,
            features={"chat"}, worker_args=CI_WORKER_ARGS, env={"SGLSIM_STARTUP_SECONDS": str(c["startup"])},
            startup_seconds=c.get("declared"),
            description=f"bench/bound.py configuration ({c['kind']})",
        ))


def _wanted(item) -> bool:  # type: ignore[no-untyped-def]
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return True
    config = CONFIGS.get(getattr(callspec.params.get("sgl_model"), "name", ""))
    if config is None:
        return False
    kind_matches = (item.originalname == "test_pd") == (config["kind"] == "pd")
    return kind_matches and callspec.params.get("i", 0) < len(config["tests"])


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    keep = [item for item in items if _wanted(item)]
    dropped = [item for item in items if not _wanted(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
