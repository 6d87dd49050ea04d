"""``--sgl-cluster ray`` (issue 13, the Ray part), proven on a CPU with one local Ray cluster per module.

The cluster (``ray start --head --block --num-gpus 4 --num-cpus 4``, a free port, tests/ray_local.py: hermetic
whatever the user's ``~/.ray`` holds, loopback only, a private temp dir) is started once for the module, without the
per-test leftover mark (it outlives single tests), and stopped at the end, checked gone. Every inner session runs
the simulated engine on it; the engine records its lifetimes and its ``CUDA_VISIBLE_DEVICES`` (``SGLSIM_RECORD``),
so that a GPU held by two live workers at once shows as a double booking, as in tests/plugin/test_xdist_gpus.py.
The actors and the engines they start carry the test's leftover mark (the plugin forwards ``SGL*`` variables to
them), so the leftover check of tests/conftest.py covers them too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ray_local import DROPPED, LocalCluster, local_cluster
from worker_lives import assert_exclusive, lifetimes, max_concurrency

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray")]  # one local cluster at a time

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'pytest-sglworker[ray]'")

SIM = ("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "--sgl-cluster", "ray")
GPUS = 4
#: the Ray Client server's port of the module's cluster
CLIENT_PORT = [0]
#: The module cluster's --temp-dir (Ray's session logs are under it until the cluster's teardown removes it).
RAY_TEMP = [""]
#: the module's cluster (what a client of it sets)
CLUSTER: list[LocalCluster | None] = [None]


def ray_client_logs(limit: int = 3000) -> str:
    """The tails of the Ray Client server's own logs (proxier and each client's server), for a failure message."""
    logs = Path(RAY_TEMP[0]) / "session_latest" / "logs"
    parts = []
    for path in sorted(logs.glob("ray_client_server*")):
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace").strip()
            if text:
                parts.append(f"--- {path.name}\n{text[-limit:]}")
    return "\n".join(parts) or f"(no ray_client_server logs under {logs})"


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """One local Ray cluster for the module (tests/ray_local.py: hermetic, loopback only, its own temp dir, token
    authentication off explicitly); its GCS address."""
    with local_cluster(gpus=GPUS) as cluster:
        CLUSTER[0] = cluster
        CLIENT_PORT[0] = cluster.client_port
        RAY_TEMP[0] = str(cluster.temp)
        yield cluster.address
        # Nothing of the plugin's is left on the cluster: every GPU is back, no placement group of ours lives.
        check = ("import ray, sys, time; ray.init(address=sys.argv[1], log_to_driver=False)\n"
                 "deadline = time.monotonic() + 20\n"
                 "while True:\n"
                 "    live = [i['name'] for i in ray.util.placement_group_table().values()\n"
                 "            if i['state'] != 'REMOVED' and i['name'].startswith('sglworker-')]\n"
                 "    free = ray.available_resources().get('GPU', 0)\n"
                 f"    if (free == {GPUS} and not live) or time.monotonic() > deadline: break\n"
                 "    time.sleep(0.5)\n"
                 "print(free, live)\n")
        out = subprocess.run([sys.executable, "-c", check, cluster.address], env=cluster.client_env(),
                             capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
        assert out and out[-1] == f"{float(GPUS)} []", f"left on the Ray cluster (free GPUs, placement groups): {out}"


@pytest.fixture
def on_ray(ray_address: str, sim_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The inner sessions' environment: the cluster's address and what its clients set (tests/ray_local.py), and
    the simulated engine's record file."""
    cluster = CLUSTER[0]
    assert cluster is not None
    for key in DROPPED:
        if key != "SGLWORKER_TEST_MARK":
            monkeypatch.delenv(key, raising=False)
    for key, value in cluster.auth.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RAY_ADDRESS", ray_address)
    record = tmp_path / "sim-record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    return record


NODES = """
import json, ray, sys
ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps([{"address": n["NodeManagerAddress"], "alive": n["Alive"],
                   "node": sorted(k for k in n["Resources"] if k.startswith("node:") and k != "node:__internal_head__")}
                  for n in ray.nodes()]))
"""


def test_the_cluster_advertises_and_binds_loopback_only(ray_address: str) -> None:
    """Its node's address is 127.0.0.1 (Ray's node list and its ``node:<ip>`` resource: what clients are sent to),
    and every port its processes listen on is a loopback one."""
    cluster = CLUSTER[0]
    assert cluster is not None
    out = subprocess.run([sys.executable, "-c", NODES, ray_address], env=cluster.client_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    nodes = json.loads(out.stdout.strip().splitlines()[-1])
    assert nodes == [{"address": "127.0.0.1", "alive": True, "node": ["node:127.0.0.1"]}], nodes
    listening = []
    for proc in cluster.processes():
        with contextlib.suppress(psutil.Error):
            listening += [(proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
    assert listening, "no listening socket found among the cluster's processes"
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for _, ip, _ in listening), listening


def _run(pytester: pytest.Pytester, *args: str, timeout: float = 120) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*SIM, *args, timeout=timeout)


TWO_CONFIGS = """
    import time
    import pytest

    SMALL = ["--mem-fraction-static", "0.5", "--max-total-tokens", "4096"]

    @pytest.mark.parametrize("i", range(3))
    def test_default(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200
        assert sgl_worker.url.startswith("http://127.0.0.1:")
        time.sleep(0.1)

    @pytest.mark.sgl_worker(args=SMALL)
    @pytest.mark.parametrize("i", range(3))
    def test_small(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200
        time.sleep(0.1)

    @pytest.mark.sgl_worker(fresh=True)
    @pytest.mark.parametrize("i", range(2))
    def test_fresh(sgl_worker, i):
        assert "Ray node" in sgl_worker.describe()
"""


def test_workers_run_as_ray_actors_with_ray_gpus(pytester: pytest.Pytester, on_ray: Path, tmp_path: Path) -> None:
    pytester.makepyfile(TWO_CONFIGS)
    report = tmp_path / "report.json"
    result = _run(pytester, "-p", "no:xdist", "--sgl-report", str(report))
    result.assert_outcomes(passed=8)
    lives = lifetimes(on_ray)
    assert_exclusive(lives, gpu_count=GPUS)
    assert len(lives) == 4  # default and small reused, two fresh ones
    assert report.exists()


HOSTS = """
    import os
    import psutil
    import pytest

    @pytest.mark.sgl_worker(fresh=True)
    @pytest.mark.parametrize("i", range(3))
    def test_fresh(sgl_worker, i):
        with open(os.environ["HOSTS_FILE"], "a") as out:
            out.write(f"{psutil.Process(sgl_worker.pid).ppid()}\\n")
"""


def test_a_host_actor_serves_the_next_lease(pytester: pytest.Pytester, on_ray: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # three fresh workers one after the other, each on its own lease: the actor that started an engine (its parent
    # process) starts a later one too, instead of a new actor for every lease; the leftover check of
    # tests/conftest.py sees that none outlives the session
    hosts = tmp_path / "hosts"
    monkeypatch.setenv("HOSTS_FILE", str(hosts))
    pytester.makepyfile(HOSTS)
    _run(pytester, "-p", "no:xdist").assert_outcomes(passed=3)
    parents = hosts.read_text().split()
    assert len(parents) == 3 and len(set(parents)) < 3, parents
    lives = lifetimes(on_ray)
    assert_exclusive(lives, gpu_count=GPUS)
    assert len(lives) == 3


AHEAD = """
    import os
    import psutil
    import pytest
    import ray

    @pytest.mark.sgl_worker(fresh=True)
    @pytest.mark.parametrize("i", range(4))
    def test_fresh(sgl_worker, i):
        me = os.environ["PYTEST_XDIST_WORKER"]
        ahead = []  # the pids of the hosts a controller started ahead for this xdist worker
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["name"].startswith("sglworker-host-") and entry["name"].endswith(f"-{me}"):
                actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
                ahead.append(str(ray.get(actor.node.remote(), timeout=60)["pid"]))
        with open(os.environ["HOSTS_FILE"], "a") as out:
            out.write(f"{me} {psutil.Process(sgl_worker.pid).ppid()} {','.join(ahead) or 'none'}\\n")
"""


def test_the_xdist_controller_starts_each_workers_first_host(pytester: pytest.Pytester, on_ray: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under -n 2 the controller starts a named host for each xdist worker as it starts it; the worker's first
    # engine runs in that host (its parent process), not in one the worker started at its collection, shortly
    # before its first lease. The leftover check of tests/conftest.py sees that none outlives the session.
    hosts = tmp_path / "hosts"
    monkeypatch.setenv("HOSTS_FILE", str(hosts))
    pytester.makepyfile(AHEAD)
    _run(pytester, "-n", "2", "--dist", "load").assert_outcomes(passed=4)
    first: dict[str, tuple[str, str]] = {}
    for line in hosts.read_text().splitlines():
        worker, parent, ahead = line.split()
        first.setdefault(worker, (parent, ahead))
    assert len(first) == 2, hosts.read_text()
    for worker, (parent, ahead) in first.items():
        assert ahead != "none", f"no host started ahead for {worker}"
        assert parent in ahead.split(","), (f"{worker}'s first engine ran in {parent}, not in its host started "
                                            f"ahead ({ahead})")
    assert_exclusive(lifetimes(on_ray), gpu_count=GPUS)


CRASH = """
    import os
    import time
    from pathlib import Path

    def test_hang(sgl_worker):
        Path(os.environ["UP_FILE"]).write_text(f"{os.getpid()} {sgl_worker.pid}")
        time.sleep(600)

    def test_wait_for_the_check():
        deadline = time.monotonic() + 120
        while not Path(os.environ["DONE_FILE"]).exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
"""


def test_a_crashed_xdist_worker_leaves_no_engine_on_the_controllers_host(pytester: pytest.Pytester, on_ray: Path,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A host the controller started runs the engine of the xdist worker that took it; when that worker dies (its
    placement group goes with it), the engine ends while the controller still runs (it holds the host)."""
    up, done = tmp_path / "up", tmp_path / "done"
    monkeypatch.setenv("UP_FILE", str(up))
    monkeypatch.setenv("DONE_FILE", str(done))
    pytester.makepyfile(CRASH)
    inner = subprocess.Popen([sys.executable, "-m", "pytest", *SIM, "-n", "1", "--dist", "load", str(pytester.path)],
                             cwd=pytester.path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not up.exists() or len(up.read_text().split()) < 2:
            assert inner.poll() is None, "the inner pytest ended before its worker was up"
            assert time.monotonic() < deadline, "the worker did not come up within 90 s"
            time.sleep(0.1)
        xdist_worker, engine = map(int, up.read_text().split())
        os.kill(xdist_worker, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while psutil.pid_exists(engine) and psutil.Process(engine).status() != psutil.STATUS_ZOMBIE:
            assert inner.poll() is None, "the controller ended first: it cannot tell who ended the engine"
            assert time.monotonic() < deadline, f"the engine {engine} of the crashed xdist worker still runs"
            time.sleep(0.2)
        done.touch()
        out, _ = inner.communicate(timeout=120)
    finally:
        done.touch()
        if inner.poll() is None:
            inner.kill()
            inner.wait(10)
    assert "1 passed" in out, out
    assert len(lifetimes(on_ray)) == 1


def test_ray_client_address(pytester: pytest.Pytester, on_ray: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--sgl-cluster ray://HOST:PORT`` joins through the Ray Client server."""
    monkeypatch.delenv("RAY_ADDRESS")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(2))
        def test_default(sgl_worker, i):
            assert sgl_worker.client.get("/health").status_code == 200
            assert "Ray node" in sgl_worker.describe()
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-model", "qwen3-0.6b",
                                           "--sgl-cluster", f"ray://127.0.0.1:{CLIENT_PORT[0]}", timeout=120)
    assert result.ret == 0, "\n".join(result.errlines[-20:]) + "\n" + ray_client_logs()
    result.assert_outcomes(passed=2)
    lives = lifetimes(on_ray)
    assert len(lives) == 1
    assert_exclusive(lives, gpu_count=GPUS)


def test_xdist_sessions_never_share_a_ray_gpu(pytester: pytest.Pytester, on_ray: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two xdist workers, each a Ray driver, with tp=2 workers on 4 GPUs, six fresh workers (three times what fits).

    The two drivers meet once while each holds a worker (a rendezvous, with a deadline), so that their workers are
    certainly alive side by side: left to timing, a loaded machine started one xdist worker's workers only after the
    other's had ended (each lives 0.3 s, a launch through Ray takes seconds), and the exclusivity checked below
    would have been checked on workers that never overlapped."""
    pytester.makeconftest("""
        from pytest_sglworker import ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("tp2", "org/tp2", 4, tp=2))
    """)
    pytester.makepyfile("""
        import os
        import time
        from pathlib import Path

        import pytest

        MEET = Path(os.environ["RAY_TEST_RENDEZVOUS"])

        @pytest.mark.sgl_worker(fresh=True)
        @pytest.mark.parametrize("i", range(6))
        def test_hold(sgl_worker, i):
            me = os.environ["PYTEST_XDIST_WORKER"]
            (MEET / me).touch()  # while this test holds its worker
            deadline = time.monotonic() + 90
            while not [p for p in MEET.iterdir() if p.name != me]:
                assert time.monotonic() < deadline, "the other xdist worker never held a worker within 90 s"
                time.sleep(0.05)
            time.sleep(0.3)
    """)
    meet = pytester.path / "rendezvous"
    meet.mkdir()
    monkeypatch.setenv("RAY_TEST_RENDEZVOUS", str(meet))
    # --dist load: xdist's first batch gives each of the two workers tests (configuration affinity could give one all)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-cluster", "ray",
                                           "--sgl-model", "tp2", "-n", "2", "--dist", "load", timeout=180)
    result.assert_outcomes(passed=6)
    lives = lifetimes(on_ray)
    assert len(lives) == 6
    assert_exclusive(lives, gpu_count=GPUS)
    assert max_concurrency(lives) >= 2, "the two xdist workers' workers were never alive side by side"


HAND_OVER = """
    import os
    import pytest

    def _one(i):  # a configuration of one GPU
        @pytest.mark.sgl_worker(args=["--max-total-tokens", str(4096 + i)])
        def test(sgl_worker):
            assert sgl_worker.gpus
        return test

    for n, i in enumerate(os.environ["ORDER"].split()):  # the configurations' tests, in this order
        globals()[f"test_{n:02d}_config_{i}"] = _one(int(i))

    @pytest.mark.sgl_workers(count=2)
    def test_98_pair(sgl_workers):  # two bundles of one GPU: not the shape of a one-GPU group's lease
        assert len({w.gpus for w in sgl_workers}) == 2

    def test_99_placement_groups():
        import ray
        from pytest_sglworker.resources.processes import SESSION_ID

        mine = [i["name"] for i in ray.util.placement_group_table().values()
                if i["name"].startswith(f"sglworker-{SESSION_ID}-")]
        with open(os.environ["PGS_FILE"], "w") as out:
            out.write(f"{len(mine)}\\n")
"""


@pytest.mark.parametrize(("order", "groups", "placement_groups"), [
    # each configuration's last test: its group is stopped, and its placement group kept for the next test's
    ("0 1 2 3 4", 7, 2),
    # configurations used again later stay idle in the pool: four fill the cluster; the fifth evicts the oldest
    # and takes its placement group, then keeps it for the first's second test (the others' groups are pooled:
    # they need none, and the pair gets one of its own)
    ("0 1 2 3 4 0 1 2 3", 8, 5),
], ids=["retired", "evicted"])
def test_a_stopped_groups_placement_group_serves_the_next_lease_of_its_shape(
        pytester: pytest.Pytester, on_ray: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str,
        groups: int, placement_groups: int) -> None:
    # A placement group removed and made again waited 0.4-0.8 s for the cluster to place it; one handed on as it is
    # does not. The pair (two one-GPU bundles) is another shape: what it evicts is given back, and it gets a
    # placement group of its own. No GPU ever ran two engines at once; none is left held (the module's check).
    pgs = tmp_path / "pgs"
    monkeypatch.setenv("PGS_FILE", str(pgs))
    monkeypatch.setenv("ORDER", order)
    pytester.makepyfile(HAND_OVER)
    result = _run(pytester, "-p", "no:xdist", "-p", "no:randomly", "--sgl-launch-ahead", "0", "--sgl-reorder", "off")
    result.assert_outcomes(passed=len(order.split()) + 2)
    lives = lifetimes(on_ray)
    # the whole record and the run's output when it fails: once, in a full run, an eighth engine lived 0.84 s
    assert len(lives) == groups, f"{on_ray.read_text()}\n{result.stdout.str()[-4000:]}"
    assert_exclusive(lives, gpu_count=GPUS)
    assert pgs.read_text().split() == [str(placement_groups)], result.stdout.str()[-3000:]


def test_a_group_is_placed_at_once(pytester: pytest.Pytester, on_ray: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(count=2)
        @pytest.mark.parametrize("i", range(2))
        def test_group(sgl_workers, i):
            assert len(sgl_workers) == 2
            assert len(set(w.url for w in sgl_workers)) == 2
            assert len({w.gpus for w in sgl_workers}) == 2, [w.gpus for w in sgl_workers]
            for w in sgl_workers:
                assert w.client.get("/health").status_code == 200
    """)
    result = _run(pytester, "-p", "no:xdist")
    result.assert_outcomes(passed=2)
    lives = lifetimes(on_ray)
    assert len(lives) == 2  # one group, reused by the second test
    assert_exclusive(lives, gpu_count=GPUS)


def test_startup_failure_reports_the_log_tail(pytester: pytest.Pytester, on_ray: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_worker(env={"SGLSIM_FAULT": "crash_oom"})
        def test_crash(sgl_worker):
            raise AssertionError("must not run")
    """)
    result = _run(pytester, "-p", "no:xdist")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "exited during startup" in out, out
    assert "out of memory" in out.lower(), out  # the tail of the log written on the node
    assert "Ray node" in out


def test_a_cluster_too_small_skips_at_collection(pytester: pytest.Pytester, on_ray: Path) -> None:
    pytester.makeconftest("""
        from pytest_sglworker import ModelSpec

        def pytest_sglworker_register_specs(registry):
            registry.add(ModelSpec("tp8", "org/tp8", 4, tp=8))
    """)
    pytester.makepyfile("""
        def test_needs_eight(sgl_worker):
            raise AssertionError("must never run")

        def test_without_worker():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-cluster", "ray", "--sgl-model", "tp8", "-rs", timeout=120)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*tp8: tp=8 needs 8 GPUs but the inventory has 4 (Ray cluster at*"])
    assert lifetimes(on_ray) == []


def test_missing_ray_is_a_usage_error(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    shim = pytester.path / "shim" / "ray"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named ray (test shim)')\n")
    pytester.makepyfile("def test_x(sgl_worker): pass")
    env_path = os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = env_path
    try:
        result = _run(pytester, "-p", "no:xdist", timeout=60)
    finally:
        os.environ["PYTHONPATH"] = env_path.split(os.pathsep, 1)[1]
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines(["ERROR: --sgl-cluster: Ray is needed*not installed*"
                                 "pip install 'pytest-sglworker[[]ray]'"])


def test_an_unreachable_cluster_is_a_usage_error_fast(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-model", "qwen3-0.6b", "--sgl-cluster", "ray://127.0.0.1:1",
                                           timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines(["ERROR: --sgl-cluster: 'ray://127.0.0.1:1': the Ray cluster is unreachable: "
                                  "cannot connect to 127.0.0.1:1*"])


def test_a_bad_cluster_value_is_a_usage_error(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-model", "qwen3-0.6b", "--sgl-cluster", "ray://nohost", timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sgl-cluster: invalid value 'ray://nohost'*give the cluster as ray://HOST:PORT*"])


def test_a_sigkilled_pytest_leaves_no_actor_and_no_worker(pytester: pytest.Pytester, on_ray: Path,
                                                          tmp_path: Path) -> None:
    up = tmp_path / "up"
    pytester.makepyfile(f"""
        import time

        def test_hang(sgl_worker):
            open({str(up)!r}, "w").write(str(sgl_worker.pid))
            time.sleep(600)
    """)
    mark = os.environ["SGLWORKER_TEST_MARK"]
    inner = subprocess.Popen([sys.executable, "-m", "pytest", *SIM, "-p", "no:xdist", str(pytester.path)],
                             cwd=pytester.path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not up.exists():
            assert inner.poll() is None, "the inner pytest ended before its worker was up"
            assert time.monotonic() < deadline, "the worker did not come up within 90 s"
            time.sleep(0.1)
        worker_pid = int(up.read_text())
        assert psutil.pid_exists(worker_pid)
        ours = [p for p in psutil.process_iter() if _has_mark(p, mark) and p.pid != inner.pid]
        assert any(p.pid == worker_pid for p in ours)
        assert len(ours) >= 2, "no actor process carries the test's mark"  # the actor, its watchdog, the engine
        inner.send_signal(signal.SIGKILL)
        inner.wait(10)
        deadline = time.monotonic() + 60
        while True:
            left = [p.pid for p in psutil.process_iter() if _has_mark(p, mark) and p.pid != os.getpid()]
            if not left:
                break
            assert time.monotonic() < deadline, f"left after the SIGKILL of pytest: {left}"
            time.sleep(0.2)
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait(10)
    lives = lifetimes(on_ray)
    assert len(lives) == 1


def _has_mark(proc: psutil.Process, mark: str) -> bool:
    try:
        return proc.environ().get("SGLWORKER_TEST_MARK") == mark and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


HOLDER = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], log_to_driver=False)
pg = placement_group([{"GPU": 4.0}], name="outside-holder")
assert pg.wait(timeout_seconds=60)
print("held", flush=True)
sys.stdin.readline()
table = ray.util.placement_group_table()
pending = [i["name"] for i in table.values() if i["state"] == "PENDING" and i["name"].startswith("sglworker-")]
print("pending", len(pending), flush=True)
"""


def test_a_full_cluster_waits_then_times_out_as_local_leases_do(pytester: pytest.Pytester, on_ray: Path,
                                                                 ray_address: str) -> None:
    """Every GPU held by other Ray work: the lease waits --sgl-lease-timeout, says what it waits for, fails
    with the local lease's message, and leaves no pending placement group behind."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, ray_address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        pytester.makepyfile("def test_x(sgl_worker): pass")
        result = _run(pytester, "-p", "no:xdist", "--sgl-lease-timeout", "3", timeout=60)
        result.assert_outcomes(errors=1)
        out = result.stdout.str()
        assert "no lease of 1 GPU(s) with" in out and "within 3 s (Ray cluster at" in out, out
        assert "0 free now" in out and "in use by other Ray work" in out, out
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split() == ["pending", "0"]
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(30)
    assert lifetimes(on_ray) == []


@pytest.mark.real_engine
@pytest.mark.slow  # one more real engine startup (about 2 min on 2 CPUs): -m real_engine or -m slow selects it
def test_the_real_cpu_engine_runs_as_a_ray_actor(pytester: pytest.Pytester, on_ray: Path,
                                                 tmp_path_factory: pytest.TempPathFactory,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex

    from pytest_sglworker.engine.cpu_engine import (
        build_tiny_model,
        real_engine_launcher,
        real_engine_missing_reason,
        real_engine_python,
    )

    python = real_engine_python()
    if python is None:
        pytest.skip(real_engine_missing_reason())
    model = build_tiny_model(python, tmp_path_factory.mktemp("ray-real") / "tiny-model")
    pytester.makeconftest(f"""
        from pytest_sglworker.engine.cpu_engine import cpu_engine_spec

        def pytest_sglworker_register_specs(registry):
            registry.add(cpu_engine_spec("tiny-cpu", {str(model)!r}))
    """)
    pytester.makepyfile("""
        def test_generate(sgl_worker):
            assert "Ray node" in sgl_worker.describe()
            assert "The server is fired up and ready to roll!" in sgl_worker.log_text()
            resp = sgl_worker.client.post("/generate", json={"text": "Hello",
                                          "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                              "ignore_eos": True}})
            assert resp.status_code == 200, resp.text
            assert len(resp.json()["output_ids"]) == 4
    """)
    for key in ("SGLWORKER_ENGINE", "SGLWORKER_LAUNCHER", "SGLWORKER_GPUS", "SGLWORKER_MODELS"):
        monkeypatch.delenv(key, raising=False)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-model", "tiny-cpu", "--sgl-cluster", "ray",
        "--sgl-launcher", shlex.join(real_engine_launcher(python)), "--sgl-startup-timeout", "300", timeout=600)
    result.assert_outcomes(passed=1)


EXAMPLES = Path(__file__).resolve().parents[2] / "conftest_examples"


def test_example_xdist_sharding_unchanged_on_ray(pytester: pytest.Pytester, on_ray: Path, tmp_path: Path) -> None:
    """The example suite as it is, under -n 2, on the Ray cluster instead of local leases."""
    shutil.copytree(EXAMPLES / "xdist_sharding", pytester.path / "xdist_sharding")
    report = tmp_path / "report.json"
    result = _run(pytester, "xdist_sharding", "-n", "2", "--dist", "loadgroup", "--sgl-report", str(report),
                  timeout=180)
    result.assert_outcomes(passed=8)
    workers = json.loads(report.read_text())["workers"]
    assert len(workers) == 3 and all(w["launches"] == 1 for w in workers.values()), workers
    assert_exclusive(lifetimes(on_ray), gpu_count=GPUS)


def test_example_other_repo_gpu_tests_unchanged_on_ray(pytester: pytest.Pytester, on_ray: Path) -> None:
    shutil.copytree(EXAMPLES / "other_repo_gpu_tests", pytester.path / "other_repo_gpu_tests")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-cluster", "ray",
                                           "other_repo_gpu_tests", "--sgl-model", "gateway-qwen3", timeout=180)
    result.assert_outcomes(passed=5)
    assert_exclusive(lifetimes(on_ray), gpu_count=GPUS)


def test_a_gpu_selection_with_a_cluster_is_a_usage_error(pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    pytester.makepyfile("def test_x(sgl_worker): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "sim",
                                           "--sgl-model", "qwen3-0.6b", "--sgl-gpus", "sim:2",
                                           "--sgl-cluster", "ray", timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sgl-gpus and --sgl-cluster exclude each other*"])


def test_a_ray_client_init_failure_names_the_servers_reason() -> None:
    from pytest_sglworker.workers.sources.ray_connect import _why

    error = ConnectionAbortedError("Initialization failure from server:\nTraceback (most recent call last):\n"
                                   '  File "proxier.py", line 780, in Datapath\n'
                                   "RuntimeError: Proxy failed to Connect to backend! Check the logs.\n")
    assert _why(error) == ("Initialization failure from server: RuntimeError: Proxy failed to Connect to backend! "
                           "Check the logs.")
    assert _why(ConnectionError("refused\nmore")) == "refused"
    assert _why(TimeoutError()) == "TimeoutError"
