"""The older ``e2e_grpc/`` suite through the gateway drop-in, as that suite meets it (``runpytest_subprocess``,
``--sgl-engine sim``, the real router): unittest classes written as upstream's ``e2e_grpc/`` files are (their folder's
parent put on ``sys.path``, ``from fixtures import popen_launch_workers_and_router``, ``from util import ...``, a
cluster started in ``setUpClass`` and ended by ``kill_process_tree`` in ``tearDownClass``), with upstream's own
``fixtures.py`` and ``util.py`` left beside them, and a file elsewhere in the same run that imports a ``util`` and a
``fixtures`` of the user's own.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from port_grab import free_port_block

from pytest_sglworker.compat import models as compat_models
from pytest_sglworker.compat.gateway.scoped_modules import serving_e2e_grpc

TINY = str(Path(__file__).resolve().parents[1] / "data" / "sim" / "tiny-llama")

pytestmark = [pytest.mark.router, pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None or importlib.util.find_spec("openai") is None,
    reason="the gateway drop-in's tier needs the sglang router and openai: pip install 'pytest-sglworker[test]'")]

CONFTEST = f'''
import sys
from pathlib import Path

pytest_plugins = ["pytest_sglworker.compat.gateway"]

from pytest_sglworker import CI_WORKER_ARGS, ModelSpec

# the user's own util, imported before any e2e_grpc file: it is theirs again after those files are imported
sys.path.insert(0, str(Path(__file__).parent / "mine"))
import util as users_util  # noqa: E402


def pytest_sglworker_register_specs(registry):
    registry.add(ModelSpec(name="tiny", model={TINY!r}, memory_gb=1, worker_args=(*CI_WORKER_ARGS,
                                                                                  "--skip-server-warmup")))
'''

#: Written as upstream's e2e_grpc files are; BASE_URL is a free port of the outer test (upstream passes sglang's
#: DEFAULT_URL_FOR_TEST, a fixed port that tests running at once on this machine would share).
CLUSTER_TESTS = '''
import sys
import unittest
from pathlib import Path

import openai
import requests

_TEST_DIR = Path(__file__).parent
sys.path.insert(0, str(_TEST_DIR.parent))
from fixtures import popen_launch_workers_and_router
import fixtures as FIXTURES
from util import (
    DEFAULT_MODEL_PATH,
    DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
    DEFAULT_URL_FOR_TEST,
    CustomTestCase,
    get_tokenizer,
    kill_process_tree,
)

BASE_URL = "{base_url}"


class TestA_Cluster(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = DEFAULT_MODEL_PATH
        cls.api_key = "sk-123456"
        cls.cluster = popen_launch_workers_and_router(
            cls.model, BASE_URL, timeout=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH, api_key=cls.api_key, num_workers=2,
            router_args=["--tool-call-parser", "llama"])
        cls.base_url = BASE_URL + "/v1"
        cls.tokenizer = get_tokenizer(cls.model)

    @classmethod
    def tearDownClass(cls):
        kill_process_tree(cls.cluster["router"].pid)
        for worker in cls.cluster.get("workers", []):
            kill_process_tree(worker.pid)

    def test_the_drop_ins_are_served(self):
        assert popen_launch_workers_and_router.__module__ == "pytest_sglworker.compat.gateway.e2e_grpc"
        assert kill_process_tree.__module__ == "pytest_sglworker.compat.gateway.e2e_grpc"
        assert DEFAULT_MODEL_PATH.endswith("tiny-llama") and DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH == 600
        assert DEFAULT_URL_FOR_TEST == "http://127.0.0.1:21000"
        assert not hasattr(CustomTestCase, "_callTestMethod") or CustomTestCase.__mro__[1] is unittest.TestCase
        assert len(self.tokenizer.encode("hello")) > 0

    def test_the_cluster_is_what_upstream_returns(self):
        cluster = self.cluster
        assert cluster["base_url"] == BASE_URL
        assert len(cluster["workers"]) == 2 and len(set(w.pid for w in cluster["workers"])) == 2
        assert all(w.poll() is None for w in cluster["workers"]) and cluster["router"].poll() is None
        assert all(url.startswith("grpc://127.0.0.1:") for url in cluster["worker_urls"])
        router_argv = " ".join(cluster["router"].args)
        assert "--api-key" in router_argv and "--tool-call-parser llama" in router_argv
        assert all("--grpc-mode" in w.args for w in cluster["workers"])
        listed = requests.get(f"{{BASE_URL}}/workers", headers={{"Authorization": "Bearer sk-123456"}}, timeout=10)
        assert sorted(w["url"] for w in listed.json()["workers"]) == sorted(cluster["worker_urls"])

    def test_chat_through_the_router(self):
        client = openai.Client(api_key=self.api_key, base_url=self.base_url)
        resp = client.chat.completions.create(model=self.model, messages=[{{"role": "user", "content": "hi"}}],
                                              max_tokens=3)
        assert resp.usage.completion_tokens == 3


class TestB_SameUrlAgain(CustomTestCase):
    """The next class on the same URL: the first router's port is free again; the pool's workers serve it."""

    @classmethod
    def setUpClass(cls):
        cls.cluster = popen_launch_workers_and_router(DEFAULT_MODEL_PATH, BASE_URL, num_workers=2)

    def test_served_again(self):
        assert requests.get(f"{{BASE_URL}}/health", timeout=10).status_code == 200

    # no tearDownClass: the drop-in ends what the class left running, and says so


def test_c_what_is_refused_says_why():
    import pytest
    from pytest_sglworker.compat import CompatError

    with pytest.raises(CompatError, match=r"env=\\['X'\\]\\): workers from the plugin's pool share"):
        popen_launch_workers_and_router(DEFAULT_MODEL_PATH, BASE_URL, env={{"X": "1"}})
    with pytest.raises(CompatError, match="popen_launch_workers_and_router: base_url 'http://10.0.0.1:8000' names"):
        popen_launch_workers_and_router(DEFAULT_MODEL_PATH, "http://10.0.0.1:8000")
    with pytest.raises(CompatError, match="router_args=...\\) is a list of arguments"):
        popen_launch_workers_and_router(DEFAULT_MODEL_PATH, BASE_URL, router_args="--x")
    with pytest.raises(ImportError, match="fixtures.find_free_port is upstream's own"):
        FIXTURES.find_free_port  # what `from fixtures import find_free_port` at the file's top meets
'''

UPSTREAMS_OWN = "raise RuntimeError('upstream\\'s own {name} was imported')\n"

MINE = '''
import sys


def test_my_own_modules_are_mine():
    import fixtures
    import util

    assert util.MINE == "util" and fixtures.MINE == "fixtures"
    assert sys.modules["util"] is sys.modules["conftest"].users_util
'''


def _free_block() -> int:
    """A port of 4 free consecutive ports, 4-aligned, in 38000-39999 (above the plugin's default range's start), and
    claimed by no other test of this run (two tests at once picked the same first free block: the second one's router
    waited for the first one's port)."""
    return free_port_block(38000, 39999)


def test_only_files_under_an_e2e_grpc_folder_are_served() -> None:
    assert serving_e2e_grpc(Path("/x/e2e_test/e2e_grpc/function_call/test_f.py"))
    assert serving_e2e_grpc(Path("/x/e2e_grpc/test_f.py"))
    assert not serving_e2e_grpc(Path("/x/e2e_test/router/test_f.py"))
    assert not serving_e2e_grpc(Path("/x/e2e_grpc.py"))  # the folder, not a file of that name


def test_an_e2e_grpc_file_runs_unchanged_and_other_files_keep_their_own_modules(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``from fixtures import ...`` and ``from util import ...`` in files under ``e2e_grpc/`` are the drop-in's, not
    upstream's own ``fixtures.py``/``util.py`` beside them; a cluster is two gRPC workers of the pool behind the real
    router on the URL's port, with the API key and router args; ``kill_process_tree`` ends it; the next class on the
    same URL starts again there, on the same pooled workers; a class that ends nothing has its router stopped, said.
    A file elsewhere imports the user's own ``util`` and ``fixtures`` (one imported before, one after)."""
    for key in ("SGLWORKER_MODELS", "SGLWORKER_GPUS", "CUDA_VISIBLE_DEVICES", "SGLANG_IS_IN_CI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(compat_models.ENV_MODELS, "llama-8b=tiny")
    base_url = f"http://127.0.0.1:{_free_block()}"
    pytester.makeconftest(CONFTEST)
    suite = pytester.path / "e2e_grpc"
    (suite / "cluster").mkdir(parents=True)
    (suite / "cluster" / "test_cluster.py").write_text(CLUSTER_TESTS.format(base_url=base_url))
    for name in ("fixtures", "util"):  # upstream's own, beside the files: never imported for them
        (suite / f"{name}.py").write_text(UPSTREAMS_OWN.format(name=name))
    mine = pytester.path / "mine"
    mine.mkdir()
    for name in ("fixtures", "util"):
        (mine / f"{name}.py").write_text(f"MINE = {name!r}\n")
    (mine / "test_mine.py").write_text(MINE)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-gpus", "sim:4", "--sgl-report", str(report), timeout=180)
    result.assert_outcomes(passed=6)
    port = base_url.rsplit(":", 1)[1]
    result.stdout.lines = result.outlines + result.errlines  # the run's messages go to stderr
    result.stdout.fnmatch_lines([
        f"*pytest_sglworker.compat.gateway: router (regular round_robin) over tiny [[]2x[]] --grpc-mode on "
        f"127.0.0.1:{port} *, started by e2e_grpc/cluster/test_cluster.py::TestB_SameUrlAgain, was still running "
        "after the teardown of e2e_grpc/cluster/test_cluster.py::TestB_SameUrlAgain; stopped it "
        "(kill_process_tree(cluster[[]'router'[]].pid) in tearDownClass)"])
    assert "died while idle" not in result.stdout.str()  # kill_process_tree gave the workers back to the pool
    workers = {w["label"]: w["launches"] for w in json.loads(report.read_text())["workers"].values()}
    assert workers == {"tiny [2x] --grpc-mode": 1, "router (round_robin) over tiny [2x] --grpc-mode": 2}, workers


#: Two classes as upstream's e2e_grpc files write them, on one URL (upstream's fixed DEFAULT_URL_FOR_TEST; here a free
#: port of the outer test): each test notes which xdist worker ran it.
SAME_URL_CLASSES = '''
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from fixtures import popen_launch_workers_and_router
from util import DEFAULT_MODEL_PATH, CustomTestCase, kill_process_tree

BASE_URL = "{base_url}"


def note(test):
    with open({ran!r}, "a") as f:
        f.write(f"{{type(test).__name__}}.{{test._testMethodName}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")


class _OnTheUrl(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = popen_launch_workers_and_router(DEFAULT_MODEL_PATH, BASE_URL, num_workers=1)

    @classmethod
    def tearDownClass(cls):
        kill_process_tree(cls.cluster["router"].pid)

    def test_one(self):
        note(self)
        assert self.cluster["base_url"] == BASE_URL

    def test_two(self):
        note(self)
        assert self.cluster["router"].poll() is None


class TestFirst(_OnTheUrl):
    pass


class TestSecond(_OnTheUrl):
    pass


del _OnTheUrl
'''


@pytest.mark.parametrize("dist", [[], ["--dist", "loadgroup"]], ids=["sgl-dist", "loadgroup"])
def test_e2e_grpc_classes_on_the_fixed_url_run_on_one_xdist_worker(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, dist: list[str]) -> None:
    """Every test of an e2e_grpc file is in one xdist_group, added at collection (the files unchanged): the plugin's
    scheduler (``-n 2``) and xdist's ``--dist loadgroup`` keep the classes that start their routers on the one fixed
    URL on one xdist worker, one class after the other, where xdist would otherwise split them between the two
    workers. (The autouse fixture checks that nothing is left running.)"""
    for key in ("SGLWORKER_MODELS", "SGLWORKER_GPUS", "CUDA_VISIBLE_DEVICES", "SGLANG_IS_IN_CI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(compat_models.ENV_MODELS, "llama-8b=tiny")
    ran = pytester.path / "ran.txt"
    pytester.makeconftest(CONFTEST.replace("import util as users_util  # noqa: E402", ""))
    suite = pytester.path / "e2e_grpc" / "routing"
    suite.mkdir(parents=True)
    (suite / "test_same_url.py").write_text(SAME_URL_CLASSES.format(base_url=f"http://127.0.0.1:{_free_block()}",
                                                                    ran=str(ran)))
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", "-n", "2", *dist, "--sgl-engine", "sim",
                                           "--sgl-gpus", "sim:2", timeout=180)
    result.assert_outcomes(passed=4)
    if dist:
        # xdist's loadgroup puts the group into the node id
        result.stdout.fnmatch_lines(["*PASSED e2e_grpc/*/test_same_url.py::TestFirst::test_one@e2e_grpc-fixed-url*"])
    lines = sorted(ran.read_text().splitlines())
    assert [line.split()[0] for line in lines] == ["TestFirst.test_one", "TestFirst.test_two", "TestSecond.test_one",
                                                   "TestSecond.test_two"]
    assert len({line.split()[1] for line in lines}) == 1, lines
