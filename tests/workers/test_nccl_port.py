"""The NCCL port the launcher pins (from the worker's reserved port block) and the one case where it must not:
sglang 0.5.23's data-parallel controller (``--dp-size N`` > 1 without DP attention) gives a pinned ``--nccl-port``
to every rank and each rank binds it, so the second rank died with ``EADDRINUSE`` (found running upstream's
gateway e2e ``test_regular_router.py``, whose workers are ``--dp-size 2``, on the real CPU engine)."""

from __future__ import annotations

import pytest

from pytest_sglworker.engine.sglang_facts import dp_ranks_bind_one_nccl_port
from pytest_sglworker.engine.specs import CI_WORKER_ARGS, ModelSpec
from pytest_sglworker.workers.launcher import build_argv

SPEC = ModelSpec(name="m", model="/models/m", memory_gb=1, worker_args=CI_WORKER_ARGS)


@pytest.mark.parametrize(("extra", "pinned"), [
    ((), True),
    (("--dp-size", "1"), True),
    (("--dp-size", "2"), False),
    (("--dp-size=4",), False),
    (("--data-parallel-size", "2"), False),
    (("--dp-size", "2", "--enable-dp-attention"), True),  # the ranks share one TP group and its port
    (("--attn-dp-size", "2", "--dp-size", "2"), True),
    (("--dp-size", "two"), True),  # malformed: sglang's own parser refuses it at launch, with its message
])
def test_the_nccl_port_is_pinned_unless_data_parallel_ranks_would_each_bind_it(extra: tuple[str, ...],
                                                                               pinned: bool) -> None:
    argv = build_argv(SPEC, port=30000, nccl_port=30001, launcher=(), extra_args=extra)
    assert ("--nccl-port" in argv) is pinned, argv
    assert argv[argv.index("--port") + 1] == "30000"
    if pinned:
        assert argv[argv.index("--nccl-port") + 1] == "30001"


def test_spec_args_count_as_much_as_a_test_s_own() -> None:
    dp_spec = ModelSpec(name="dp", model="/models/m", memory_gb=1, worker_args=(*CI_WORKER_ARGS, "--dp-size", "2"))
    assert "--nccl-port" not in build_argv(dp_spec, port=30000, nccl_port=30001, launcher=())
    assert dp_ranks_bind_one_nccl_port(["--dp", "2"])  # sglang's short alias
    assert not dp_ranks_bind_one_nccl_port([])
