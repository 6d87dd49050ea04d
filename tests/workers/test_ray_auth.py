"""``--sgl-cluster`` against a Ray cluster with token authentication on (issue 44), on a CPU.

The module's cluster (tests/ray_local.py) runs with ``RAY_AUTH_MODE=token`` and a token of its own in a file under
its temp dir (``RAY_AUTH_TOKEN_PATH``): the user's ``~/.ray`` is neither read nor written. An inner session with the
cluster's mode and token joins it and runs its workers there, through a GCS address and through Ray Client; one
without them (or with another token) stops at once with a usage error that names ``RAY_AUTH_MODE`` and the token
file: the plugin's check of the credentials, made before ``ray.init`` (whose retries would end in ``Failed to
connect to Ray cluster`` or ``ray client connection timeout``, tens of seconds later). The cluster's stop checks
that none of its processes is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_local import DROPPED, LocalCluster, local_cluster
from worker_lives import assert_exclusive, lifetimes

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray")]  # one local cluster at a time

pytest.importorskip("ray", reason="Ray is not installed: pip install 'pytest-sglworker[ray]'")

GPUS = 2
BASE = ("-p", "no:cacheprovider", "--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b")
TESTS = """
    import pytest

    @pytest.mark.parametrize("i", range(2))
    def test_default(sgl_worker, i):
        assert sgl_worker.client.get("/health").status_code == 200
        assert "Ray node" in sgl_worker.describe()
"""


@pytest.fixture(scope="module")
def token_cluster() -> Iterator[LocalCluster]:
    with local_cluster(gpus=GPUS, token=True) as cluster:
        yield cluster


@pytest.fixture
def inner_env(token_cluster: LocalCluster, sim_env: dict[str, str], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Path:
    """The inner sessions' environment: nothing of Ray's from this process; the simulated engine's record file."""
    for key in DROPPED:
        if key != "SGLWORKER_TEST_MARK":
            monkeypatch.delenv(key, raising=False)
    for key, value in token_cluster.auth.items():
        if not key.startswith("RAY_AUTH_"):
            monkeypatch.setenv(key, value)  # loopback, the temp dir
    record = tmp_path / "sim-record.jsonl"
    monkeypatch.setenv("SGLSIM_RECORD", str(record))
    return record


def _with_token(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in cluster.auth.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("how", ["gcs-xdist", "ray-client"])
def test_the_plugin_runs_its_workers_on_a_token_cluster(pytester: pytest.Pytester, token_cluster: LocalCluster,
                                                        inner_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                        how: str) -> None:
    # RAY_AUTH_MODE=token and the cluster's token file, as a user sets them: the plugin's driver joins (under -n 2:
    # the controller, which starts hosts ahead, and each xdist worker), its actors start the engines
    _with_token(token_cluster, monkeypatch)
    pytester.makepyfile(TESTS)
    if how == "gcs-xdist":
        args = ["--sgl-cluster", f"ray:{token_cluster.address}", "-n", "2", "--dist", "load"]
    else:
        args = ["--sgl-cluster", f"ray://127.0.0.1:{token_cluster.client_port}", "-p", "no:xdist"]
    result = pytester.runpytest_subprocess(*BASE, *args, timeout=180)
    assert result.ret == 0, "\n".join(result.outlines[-30:] + result.errlines[-20:])
    result.assert_outcomes(passed=2)
    lives = lifetimes(inner_env)
    assert lives
    assert_exclusive(lives, gpu_count=GPUS)


@pytest.mark.parametrize("how", ["gcs", "ray-client", "ray-address", "wrong-token"])
def test_a_client_without_the_token_is_told_at_once(pytester: pytest.Pytester, token_cluster: LocalCluster,
                                                    inner_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path, how: str) -> None:
    # RAY_AUTH_MODE unset (so Ray sends no token to an address given explicitly, whatever ~/.ray holds), or the
    # mode on with a token the cluster does not know: the plugin's check of the credentials says so before
    # ray.init; the message names the mode, the token file and the fix. No worker is started.
    home = tmp_path / "home"  # an empty HOME: the message names its ~/.ray/auth_token
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    args = ["--sgl-cluster", f"ray:{token_cluster.address}"]
    if how == "ray-client":
        args = ["--sgl-cluster", f"ray://127.0.0.1:{token_cluster.client_port}"]
    elif how == "ray-address":
        monkeypatch.setenv("RAY_ADDRESS", token_cluster.address)
        args = ["--sgl-cluster", "ray"]
    elif how == "wrong-token":
        wrong = tmp_path / "other_token"
        wrong.write_text("0" * 64)
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(wrong))
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess(*BASE, "-p", "no:xdist", *args, timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-3000:]
    shown = args[1]
    if how == "wrong-token":
        said = (f"the Ray cluster at {token_cluster.address} refused the token this process sends "
                f"(RAY_AUTH_MODE=token, the token from RAY_AUTH_TOKEN_PATH={wrong})")
    else:
        target = (f"ray://127.0.0.1:{token_cluster.client_port}" if how == "ray-client" else token_cluster.address)
        said = f"the Ray cluster at {target} requires token authentication (RAY_AUTH_MODE unset: no token sent)"
    result.stderr.fnmatch_lines([
        f"ERROR: --sgl-cluster: {shown!r}: {said}; run pytest with RAY_AUTH_MODE=token and the cluster's token in "
        f"{home}/.ray/auth_token (or in the file RAY_AUTH_TOKEN_PATH names, or in RAY_AUTH_TOKEN)"])
    assert lifetimes(inner_env) == []


def test_token_mode_without_a_token_is_told_at_once(pytester: pytest.Pytester, token_cluster: LocalCluster,
                                                     inner_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess(*BASE, "-p", "no:xdist", "--sgl-cluster", f"ray:{token_cluster.address}",
                                           timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-3000:]
    result.stderr.fnmatch_lines([
        f"ERROR: --sgl-cluster: 'ray:{token_cluster.address}': RAY_AUTH_MODE=token but Ray finds no token to send: "
        f"RAY_AUTH_TOKEN unset, {home}/.ray/auth_token: No such file or directory; run pytest with "
        "RAY_AUTH_MODE=token*"])


def test_the_credentials_are_read_as_ray_reads_them(tmp_path: Path) -> None:
    # Ray's order: RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names (no fallback when it is missing), else
    # ~/.ray/auth_token; a token is sent only with RAY_AUTH_MODE=token. The token never shows in what is said.
    from pytest_sglworker.workers.sources.ray_connect import ray_auth

    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("default-token\n")
    named = tmp_path / "named"
    named.write_text("named-token")
    base = {"HOME": str(home)}
    unset = ray_auth(base)
    assert (unset.mode, unset.token, unset.sends_token, unset.metadata()) == (None, "default-token", False, ())
    assert unset.describe() == "RAY_AUTH_MODE unset: no token sent"
    default = ray_auth({**base, "RAY_AUTH_MODE": "Token"})
    assert default.metadata() == (("authorization", "Bearer default-token"),)
    assert default.describe() == f"RAY_AUTH_MODE=token, the token from {home}/.ray/auth_token"
    by_path = ray_auth({**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(named)})
    assert by_path.token == "named-token" and by_path.source == f"RAY_AUTH_TOKEN_PATH={named}"
    by_env = ray_auth({**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(named), "RAY_AUTH_TOKEN": "env"})
    assert by_env.token == "env" and by_env.source == "RAY_AUTH_TOKEN"
    missing = ray_auth({**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "gone")})
    assert missing.token is None and not missing.sends_token
    assert missing.describe() == (f"RAY_AUTH_MODE=token but no token found (RAY_AUTH_TOKEN_PATH={tmp_path}/gone: "
                                  "No such file or directory)")
    disabled = ray_auth({**base, "RAY_AUTH_MODE": "disabled"})
    assert not disabled.sends_token and "default-token" not in repr(disabled)
