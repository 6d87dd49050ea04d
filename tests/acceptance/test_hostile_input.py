"""Hostile and absurd input gets a clear error naming the thing and the fix, never a traceback, an INTERNALERROR,
a hang or a pass it should not get (issue #28, item 4): an unsafe lock directory given to ``--sgl-warm list|stop``,
a TTL below what a warm record holds, a router marker naming one worker twice, a group of a billion workers, a
spec of 1e308 GiB, and an attached worker whose ``/server_info`` is nested too deep or reports a NaN budget.

Each scenario is a real pytest session (``runpytest_subprocess``) against the simulated engine or a loopback server
that answers as a hostile worker would, with private lock and log directories (``sim_env``).
"""

from __future__ import annotations

import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopback_server import LoopbackServer

from pytest_sglworker.engine.specs import MAX_MEMORY_GB, MAX_TP
from pytest_sglworker.plugin.markers import MAX_GROUP_MEMBERS
from pytest_sglworker.resources.warm_records import MAX_TTL, MIN_TTL

SIM = ["--sgl-engine", "sim", "--sgl-model", "qwen3-0.6b", "-p", "no:cacheprovider", "-p", "no:xdist"]


def _no_crash(result: pytest.RunResult) -> str:
    """The session's whole output, checked for a raw traceback or an INTERNALERROR."""
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    return out


# --------------------------------------------------------------------------------------------------------
# --sgl-warm list|stop with an unsafe lock directory: the usage error a session gives, not a traceback
# --------------------------------------------------------------------------------------------------------


def test_warm_list_and_stop_refuse_an_unsafe_lock_dir_as_a_session_does(pytester: pytest.Pytester,
                                                                        sim_env: dict[str, str],
                                                                        tmp_path: Path) -> None:
    real = tmp_path / "real-locks"
    real.mkdir(mode=0o700)
    link = tmp_path / "linked-locks"
    link.symlink_to(real)
    open_dir = tmp_path / "open-locks"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # writable by everyone, no sticky bit: another user could swap its files
    dangling = tmp_path / "dangling-locks"
    dangling.symlink_to(tmp_path / "nowhere")
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    for lock_dir, message in [
        (link, f"lock directory {link} is a symlink; refusing to follow it (remove it or choose another path)"),
        (open_dir, f"lock directory {open_dir} is writable by other users (mode 777); run 'chmod go-w {open_dir}' "
                   "or choose another path"),
        (dangling, f"lock directory {dangling} is a symlink; refusing to follow it"),  # not "none (no lock dir...)"
    ]:
        for action in ("list", "stop"):
            result = pytester.runpytest_subprocess("--sgl-warm", action, "--sgl-lock-dir", str(lock_dir),
                                                   "-p", "no:cacheprovider", timeout=60)
            _no_crash(result)
            assert result.ret == pytest.ExitCode.USAGE_ERROR, (action, lock_dir, result.stdout.str())
            result.stderr.fnmatch_lines([f"ERROR: {message}*"])
        # a session that needs the lock directory says the same
        result = pytester.runpytest_subprocess(*SIM, "--sgl-lock-dir", str(lock_dir), timeout=60)
        assert message in _no_crash(result)
        result.assert_outcomes(errors=1)
    assert list(real.iterdir()) == [] and list(open_dir.iterdir()) == [] and not (tmp_path / "nowhere").exists()


# --------------------------------------------------------------------------------------------------------
# --sgl-keep-warm below the shortest TTL a warm record holds: one range, one usage error
# --------------------------------------------------------------------------------------------------------


def test_keep_warm_ttl_out_of_range_is_one_usage_error_from_each_source(pytester: pytest.Pytester,
                                                                        sim_env: dict[str, str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: 0.0001 and 1e-320 were taken, the worker kept warm, and its keeper refused the record it wrote
    ("its warm record the record: 'ttl' is not a number in 0.001..604800")."""
    assert (MIN_TTL, MAX_TTL) == (1.0, 7 * 86400.0)
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    fix = "is not a TTL between 1 s and 7 days: give one such as 90s, 15m or 1h, or 'off'"
    for value in ("0.0001", "1e-320", "0.5s", "nan", "inf", "1e999", "-1m"):
        result = pytester.runpytest_subprocess(*SIM, f"--sgl-keep-warm={value}", timeout=60)
        _no_crash(result)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, (value, result.stdout.str())
        result.stderr.fnmatch_lines([f"ERROR: --sgl-keep-warm: invalid value '{value}': '{value}' {fix}"])
    monkeypatch.setenv("SGLWORKER_KEEP_WARM", "0.0001")
    result = pytester.runpytest_subprocess(*SIM, timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: SGLWORKER_KEEP_WARM: invalid value '0.0001': '0.0001' {fix}"])
    monkeypatch.delenv("SGLWORKER_KEEP_WARM")
    pytester.makeini("[pytest]\nsgl_keep_warm = 1e-320\n")
    result = pytester.runpytest_subprocess(*SIM, timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: ini sgl_keep_warm: invalid value '1e-320': '1e-320' {fix}"])


# --------------------------------------------------------------------------------------------------------
# sgl_router(workers=[0, 0]) and out-of-range members: an error of that test at collection, nothing launched
# --------------------------------------------------------------------------------------------------------


def test_router_marker_naming_a_worker_twice_or_beyond_the_group_fails_that_test_at_once(
        pytester: pytest.Pytester, sim_env: dict[str, str]) -> None:
    """Before: workers=[0, 0] was accepted, two workers and a router started, and the test failed 120 s later,
    blaming a Hugging Face download."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(count=2)
        @pytest.mark.sgl_router(workers=[0, 0])
        def test_twice(sgl_router): pass

        @pytest.mark.sgl_workers(prefill=1, decode=1)
        @pytest.mark.sgl_router(workers=[1, 0, 1, 2])
        def test_twice_of_a_pd_group(sgl_router): pass

        @pytest.mark.sgl_workers(count=2)
        @pytest.mark.sgl_router(workers=[0, 2])
        def test_beyond(sgl_router, sgl_workers): pass

        @pytest.mark.sgl_router(workers=2)
        def test_two_of_one(sgl_router, sgl_worker): pass

        def test_plain(): pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-gpus", "sim:4", timeout=60)
    out = _no_crash(result)
    result.assert_outcomes(passed=1, errors=4)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_twice*",
        "sgl_router(workers=[[]0, 0[]]) names member(s) [[]0[]] more than once: the router takes each worker once; "
        "list each index once",
        "*ERROR at setup of test_twice_of_a_pd_group*",
        "sgl_router(workers=[[]1, 0, 1, 2[]]) names member(s) [[]1[]] more than once*",
        "*ERROR at setup of test_beyond*",
        "sgl_router(workers=...) names member(s) [[]2[]] of a group of 2: give indices 0 to 1 (in launch order: "
        "prefill members first)",
        "*ERROR at setup of test_two_of_one*",
        "sgl_router(workers=...) names member(s) [[]1[]] of a group of 1: give indices 0",
    ])
    assert "launched" not in out  # refused at collection: no worker, no router started
    assert not list(Path(sim_env["SGLWORKER_LOG_DIR"]).rglob("*.log"))


# --------------------------------------------------------------------------------------------------------
# sgl_workers(count=10**9): refused at collection without a step per member
# --------------------------------------------------------------------------------------------------------


def test_a_group_beyond_any_inventory_is_refused_without_planning_its_members(pytester: pytest.Pytester,
                                                                             sim_env: dict[str, str]) -> None:
    """Before: count=10**9 never finished collection (each member's argv was checked, 1e5 took 5.5 s)."""
    assert MAX_GROUP_MEMBERS == 1024
    pytester.makepyfile("""
        import pytest

        @pytest.mark.sgl_workers(count=10**9)
        def test_a_billion(sgl_workers): pass

        @pytest.mark.sgl_workers(prefill=10**9, decode=1)
        def test_a_billion_prefill(sgl_workers): pass

        @pytest.mark.sgl_workers(prefill=600, decode=600)
        def test_too_many_together(sgl_workers): pass

        @pytest.mark.sgl_workers(count=1024)
        def test_more_than_the_inventory(sgl_workers): pass

        @pytest.mark.sgl_workers(count=2)
        def test_fits(sgl_workers): pass
    """)
    result = pytester.runpytest_subprocess(*SIM, "--sgl-gpus", "sim:2", "-rs", timeout=60)
    _no_crash(result)
    result.assert_outcomes(errors=3, skipped=1, passed=1)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_a_billion*",
        "sgl_workers(count=1000000000) asks for more than 1024 workers, the most one group may have (each member is a "
        "process with GPUs of its own): give a smaller number",
        "*ERROR at setup of test_a_billion_prefill*",
        "sgl_workers(prefill=1000000000) asks for more than 1024 workers*",
        "*ERROR at setup of test_too_many_together*",
        "sgl_workers(prefill=600, decode=600) asks for more than 1024 workers, the most one group may have: give "
        "smaller numbers",
    ])
    # the inventory's bound, said before the group's 1024 members are planned (the source's own refusal, which
    # plans them, words it "the group 1024x leases 1024 GPU(s) at once: tp=1024 needs ...")
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: qwen3-0.6b: the group of 1024 workers leases at least 1024 "
                                 "GPU(s) at once (one or more per member), but the inventory has 2"])


# --------------------------------------------------------------------------------------------------------
# a registry dict with memory_gb=1e308 (or tp=10**30): a spec error naming the model and the field
# --------------------------------------------------------------------------------------------------------


def test_absurd_numbers_in_a_registry_dict_are_a_spec_error(pytester: pytest.Pytester,
                                                            sim_env: dict[str, str]) -> None:
    """Before: memory_gb=1e308 was an INTERNALERROR (OverflowError in round(memory_gb * 1024)), 10**400 too;
    tp=10**30 was taken and every test skipped with a 31-digit GPU count."""
    assert (MAX_MEMORY_GB, MAX_TP) == (1048576.0, 4096)
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    for field, value, said in [
        ("memory_gb", "1e308", "'memory_gb' (GiB of memory on each GPU) must be at most 1048576, got 1e+308"),
        ("memory_gb", "10**400", "'memory_gb' (GiB of memory on each GPU) must be at most 1048576, got "
                                 "10000000000000000000...00000000 (401 characters)"),
        ("memory_gb", "-10**400", "'memory_gb' must be a positive number (finite, in GiB), got "
                                  "-1000000000000000000...00000000 (402 characters)"),
        ("memory_gb", "float('1e999')", "'memory_gb' must be a positive number (finite, in GiB), got inf"),
        ("tp", "10**30", "'tp' must be an integer from 1 to 4096 (GPUs per worker), got "
                         "1000000000000000000000000000000"),
        ("tp", "float('nan')", "'tp' must be an integer from 1 to 4096 (GPUs per worker), got nan"),
    ]:
        spec = {"model": "org/huge", "memory_gb": 4, "worker_args": ["--mem-fraction-static=0.6",
                                                                     "--cuda-graph-backend-prefill=disabled"]}
        pytester.makeconftest(textwrap.dedent(f"""
            def pytest_sglworker_register_specs(registry):
                registry.update({{"huge": {{**{spec!r}, {field!r}: {value}}}}})
        """))
        for args in ([*SIM, "--sgl-model", "huge"], ["--sgl-list-models", "-p", "no:cacheprovider"]):
            result = pytester.runpytest_subprocess(*args, timeout=60)
            _no_crash(result)
            assert result.ret == pytest.ExitCode.USAGE_ERROR, (field, value, result.stdout.str())
            result.stderr.fnmatch_lines([f"ERROR: pytest_sglworker_register_specs in *conftest.py: model spec 'huge': "
                                         f"{said}"])


# --------------------------------------------------------------------------------------------------------
# an attached worker's hostile /server_info: nested too deep, or a NaN budget
# --------------------------------------------------------------------------------------------------------


def _request_path(conn: socket.socket) -> str | None:
    """The path of the HTTP request on ``conn`` once its head has arrived; None when the client closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return data.split(b" ", 2)[1].decode("latin-1")


class HostileWorker(LoopbackServer):
    """Answers as a healthy sglang worker would, except that ``/server_info`` is the body it is given."""

    timeout = 5.0

    def __init__(self, server_info: bytes) -> None:
        self.server_info = server_info
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        path = _request_path(conn)
        if path is None:
            return
        status, body = {"/health_generate": ("200 OK", b"ok"), "/health": ("200 OK", b"ok"),
                        "/server_info": ("200 OK", self.server_info)}.get(path, ("404 Not Found", b"{}"))
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)


@pytest.fixture
def hostile_worker(request: pytest.FixtureRequest) -> Iterator[HostileWorker]:
    server = HostileWorker(request.param)
    yield server
    server.close()


NESTED = b"[" * 100_000 + b"]" * 100_000
NAN_BUDGET = (b'{"model_path": "Qwen/Qwen3-0.6B", "mem_fraction_static": NaN, '
              b'"cuda_graph_backend_prefill": "disabled"}')


@pytest.mark.parametrize(("hostile_worker", "said"), [
    (NESTED, "{url}: /server_info answers with JSON nested too deeply to read, not server info; is this an sglang "
             "worker?"),
    (NAN_BUDGET, "attached worker {url} (qwen3-0.6b, --sgl-worker-url) breaks the mandatory worker budget:"),
], indirect=["hostile_worker"], ids=["nested", "nan-budget"])
def test_an_attached_worker_with_hostile_server_info_is_refused_by_name(pytester: pytest.Pytester,
                                                                        sim_env: dict[str, str],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        hostile_worker: HostileWorker,
                                                                        said: str) -> None:
    """Before: the nested one was an INTERNALERROR (RecursionError in json.loads); the NaN one PASSED the budget
    check (NaN > 0.6 is false) and the test ran against it."""
    monkeypatch.delenv("SGLWORKER_GPUS", raising=False)  # nothing to launch: only the attached worker
    url = f"http://127.0.0.1:{hostile_worker.port}"
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "real",
                                           "--sgl-worker-url", f"qwen3-0.6b={url}", timeout=60)
    _no_crash(result)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([f"ERROR: *{said.format(url=url)}*"])
    if b"NaN" in hostile_worker.server_info:
        result.stderr.fnmatch_lines(["*--mem-fraction-static: the worker runs with nan, not in (0, 0.6]",
                                     "*fix: restart it with CI_WORKER_ARGS*"])
    assert hostile_worker.connections >= 2  # it was asked: /health_generate, then /server_info


# --------------------------------------------------------------------------------------------------------
# an attached worker that answers with a malformed chunked body (issue #38, finding 4)
# --------------------------------------------------------------------------------------------------------

#: A chunked answer whose chunk size is not hex, complete as far as a reader can tell (it ends like a last chunk).
MALFORMED_CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"zz\r\nok\r\n0\r\n\r\n")
GOOD_INFO = (b'{"model_path": "Qwen/Qwen3-0.6B", "mem_fraction_static": 0.5, '
             b'"cuda_graph_backend_prefill": "disabled"}')


class ChunkedWorker(LoopbackServer):
    """A healthy sglang worker, except that ``malformed`` (a path) is answered with a malformed chunked body from
    its ``after``-th request of that path on (0: from the first)."""

    timeout = 5.0

    def __init__(self, malformed: str, after: int) -> None:
        self.malformed, self.after = malformed, after
        self.asked: dict[str, int] = {}
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        path = _request_path(conn)
        if path is None:
            return
        seen = self.asked[path] = self.asked.get(path, 0) + 1
        if path == self.malformed and seen > self.after:
            conn.sendall(MALFORMED_CHUNKED)
            return
        status, body = {"/health_generate": ("200 OK", b"ok"), "/health": ("200 OK", b"ok"),
                        "/server_info": ("200 OK", GOOD_INFO)}.get(path, ("404 Not Found", b"{}"))
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)


@pytest.fixture
def chunked_worker(request: pytest.FixtureRequest) -> Iterator[ChunkedWorker]:
    server = ChunkedWorker(*request.param)
    yield server
    server.close()


def _attached_session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, url: str) -> pytest.RunResult:
    monkeypatch.delenv("SGLWORKER_GPUS", raising=False)  # nothing to launch: only the attached worker
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "--sgl-engine", "real",
                                         "--sgl-worker-url", f"qwen3-0.6b={url}", timeout=60)


@pytest.mark.parametrize("chunked_worker", [("/server_info", 0)], indirect=True)
def test_an_attached_worker_whose_server_info_is_malformed_http_is_a_usage_error_naming_it(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        chunked_worker: ChunkedWorker) -> None:
    """Before: a raw ``ValueError: invalid literal for int() with base 16`` from the chunked body's reader."""
    url = f"http://127.0.0.1:{chunked_worker.port}"
    result = _attached_session(pytester, monkeypatch, url)
    _no_crash(result)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines([f"ERROR: --sgl-worker-url qwen3-0.6b={url}: /server_info answers with malformed "
                                 "HTTP (malformed chunked body: chunk size b'zz' is not a hex number); is this an "
                                 "sglang worker?"])


@pytest.mark.parametrize("chunked_worker", [("/health_generate", 1)], indirect=True)
def test_an_attached_worker_that_turns_to_malformed_http_fails_the_test_it_served(
        pytester: pytest.Pytester, sim_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        chunked_worker: ChunkedWorker) -> None:
    """Healthy when attached, then a malformed answer to the health check after a passing test: that test fails,
    naming the worker and what it answered. Before: an INTERNALERROR (the ``ValueError`` escaped the check)."""
    url = f"http://127.0.0.1:{chunked_worker.port}"
    result = _attached_session(pytester, monkeypatch, url)
    out = _no_crash(result)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out
    result.stdout.fnmatch_lines([f"attached worker qwen3-0.6b at {url} stopped answering its health check during "
                                 "the test (malformed chunked body: chunk size b'zz' is not a hex number)",
                                 "*= 1 passed, 1 error in *"])
    assert chunked_worker.asked["/health_generate"] >= 2


# --------------------------------------------------------------------------------------------------------
# warm record file names that hold terminal escapes or newlines (issue #38, finding 5)
# --------------------------------------------------------------------------------------------------------

#: Clears the screen, homes the cursor, and forges a line of ``--sgl-warm stop``'s own.
FORGING = "warm-\x1b[2J\x1b[H\rx\nended warm w (pid 1, port 2)\u202e.json"


def test_warm_list_and_stop_print_no_name_of_the_lock_directory_raw(pytester: pytest.Pytester,
                                                                    sim_env: dict[str, str]) -> None:
    """A warm record's file name chosen by another user (or planted in your own directory) is printed escaped: no
    terminal escape reaches the terminal, no line of the plugin's is forged. Before: printed raw by both."""
    import os

    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    lock_dir.mkdir(mode=0o700, parents=True)
    (lock_dir / FORGING).write_text("not a record")
    theirs = None
    if os.geteuid() == 0:  # as root: the same name under another user's ownership too
        theirs = lock_dir / FORGING.replace("warm-", "warm-theirs-")
        theirs.write_text("not a record")
        os.chown(theirs, 65534, 65534)
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    escaped = r"warm-\x1b[2J\x1b[H\rx\nended warm w (pid 1, port 2)\u202e.json"
    for action, said in (("list", f"  {escaped}: untrusted ("), ("stop", f"  left {escaped}: untrusted (")):
        result = pytester.runpytest_subprocess("--sgl-warm", action, "-p", "no:cacheprovider", timeout=60)
        out = _no_crash(result)
        assert not any(c in out for c in "\x1b\r\u202e"), (action, out)
        assert [line for line in out.splitlines() if line.startswith(("ended", "  ended"))] == [], (action, out)
        assert said in out, (action, out)
        if theirs is not None:
            assert escaped.replace("warm-", "warm-theirs-") + ": belongs to uid 65534" in out, (action, out)
    assert (lock_dir / FORGING).exists()  # a name no record of the plugin has: left where it is, said so


def test_a_session_prints_no_name_of_the_lock_directory_raw(pytester: pytest.Pytester,
                                                            sim_env: dict[str, str]) -> None:
    """The session's own messages (here the janitor's about an untrusted GPU holder record it removed) show a file
    name of the lock directory escaped, whatever module wrote the message."""
    lock_dir = Path(sim_env["SGLWORKER_LOCK_DIR"])
    lock_dir.mkdir(mode=0o700, parents=True)
    (lock_dir / "gpu-\x1b[2J\x1b[H-0.json").write_text("not a record")
    (lock_dir / "gpu-\nsglworker: ended-1.json").write_text("not a record")  # a forged line of the plugin's
    pytester.makepyfile("def test_a(sgl_worker): pass\n")
    result = pytester.runpytest_subprocess(*SIM, timeout=120)
    out = _no_crash(result)
    assert result.ret == pytest.ExitCode.OK, out
    assert "\x1b" not in out, out
    assert not any(line.startswith("sglworker: ended") for line in result.stdout.lines), out
    result.stdout.fnmatch_lines([r"*ignored 2 untrusted GPU holder record(s) in *: *gpu-\x1b[[]2J\x1b[[]H-0.json (*"])
    result.stdout.fnmatch_lines([r"*gpu-\nsglworker: ended-1.json (*"])
