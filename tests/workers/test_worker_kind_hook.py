"""The seam for new worker kinds: a conftest's ``pytest_sglworker_worker_kind`` hook returns a
:class:`~pytest_sglworker.workers.kinds.WorkerKind` subclass, and the worker is launched as that kind (its pinned port
reserved from the block, its role args in the argv, the engine told them), through a real pytest session
against the simulated engine."""

from __future__ import annotations

import pytest

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:1", "-p", "no:cacheprovider"]


def test_a_kind_from_the_hook_is_the_kind_the_worker_is_made_with(pytester: pytest.Pytester,
                                                                  sim_env: dict[str, str]) -> None:
    pytester.makeconftest("""
        from pytest_sglworker.workers.kinds import HttpWorker


        class PinnedExtraPort(HttpWorker):
            name = "pinned-extra"
            port_names = ("http", "nccl", "extra")

            def role_args(self, ports):
                return ["--disaggregation-bootstrap-port", str(ports["extra"])]


        ASKED = []


        def pytest_sglworker_worker_kind(role, args):
            ASKED.append((role, args))
            return PinnedExtraPort() if role == "worker" else None
    """)
    pytester.makepyfile("""
        from conftest import ASKED, PinnedExtraPort


        def test_worker(sgl_worker):
            assert isinstance(sgl_worker.kind, PinnedExtraPort)
            assert ASKED and all(role == "worker" for role, _ in ASKED)
            extra = sgl_worker.ports["extra"]
            assert extra not in (sgl_worker.port, sgl_worker.ports["nccl"])
            i = sgl_worker.argv.index("--disaggregation-bootstrap-port")
            assert sgl_worker.argv[i + 1] == str(extra)
            info = sgl_worker.client.get("/server_info").json()
            assert info["disaggregation_bootstrap_port"] == extra  # the engine got the kind's arg
    """)
    result = pytester.runpytest_subprocess(*SIM, timeout=120)
    result.assert_outcomes(passed=1)
