"""Unit tests of pytest_sglworker.resources.ports: range parsing, the default range, block reservation within one
process and across processes, ports in use, exhaustion."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from port_grab import bindable

from pytest_sglworker.errors import PortUnavailable
from pytest_sglworker.resources.ports import PortBlock, default_port_range, parse_port_range, reserve_port_block

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_range(blocks: int, size: int = 4) -> tuple[int, int]:
    """An aligned range of ``blocks`` blocks whose ports are all bindable now (below the ephemeral range)."""
    rng = random.Random()
    for _ in range(200):
        low = rng.randrange(20000, 32000 - blocks * size, size)
        high = low + blocks * size - 1
        if all(bindable(p) for p in range(low, high + 1)):
            return low, high
    pytest.skip("no free port range found on this machine")


# --------------------------------------------------------------------------------------------------
# parsing and the default range


def test_parse_port_range() -> None:
    assert parse_port_range("20000-30000") == (20000, 30000)
    assert parse_port_range(" 40000 - 40003 ") == (40000, 40003)
    assert parse_port_range("5-5") == (5, 5)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("20000", "no '-'"),
        ("a-b", "whole numbers"),
        ("20000-", "whole numbers"),
        ("30000-20000", "LOW 30000 is above HIGH 20000"),
        ("0-100", "between 1 and 65535"),
        ("60000-70000", "between 1 and 65535"),
    ],
)
def test_parse_port_range_errors(value: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_port_range(value)
    message = str(info.value)
    assert repr(value) in message and why in message and "LOW-HIGH" in message


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("32768\t60999\n", (20000, 32767)),
        ("40000 60999", (20000, 39999)),
        ("15000 60999", (61000, 65535)),  # too little room below: above the ephemeral range
        ("1024 65535", (20000, 29999)),  # no room anywhere: the documented fallback
        ("garbage", (20000, 32767)),
    ],
)
def test_default_port_range(tmp_path: Path, content: str, expected: tuple[int, int]) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(content)
    assert default_port_range(path) == expected


def test_default_port_range_without_proc(tmp_path: Path) -> None:
    assert default_port_range(tmp_path / "missing") == (20000, 32767)


def test_default_port_range_of_this_machine_is_below_ephemeral() -> None:
    low, high = default_port_range()
    assert 1024 <= low <= high <= 65535
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if path.exists():
        eph_low, eph_high = (int(x) for x in path.read_text().split())
        assert high < eph_low or low > eph_high or (low, high) == (20000, 29999)


# --------------------------------------------------------------------------------------------------
# reservation in one process


def test_block_layout_and_release(tmp_path: Path) -> None:
    low, high = free_range(1, 4)
    block = reserve_port_block(tmp_path, port_range=(low, high))
    assert isinstance(block, PortBlock)
    assert block.ports == (low, low + 1, low + 2, low + 3)
    assert (block.port, block.nccl_port, block.spare) == (low, low + 1, (low + 2, low + 3))
    assert block.lock_path == tmp_path / f"port-{low}.lock"
    assert block.host == "127.0.0.1"
    assert "held" in repr(block)
    assert all(bindable(p) for p in block.ports)  # verified free, and nothing left bound
    block.release()
    block.release()  # idempotent
    assert block.released and "released" in repr(block)
    with reserve_port_block(tmp_path, port_range=(low, high)) as again:
        assert again.ports == block.ports
    assert again.released


def test_release_unlocks_at_once_whoever_still_holds_the_lock_object(tmp_path: Path) -> None:
    """The lock is given back by release itself, not left to garbage collection: a hand-over keeps a reference."""
    low, high = free_range(1, 4)
    block = reserve_port_block(tmp_path, port_range=(low, high))
    lock = block.held_lock()
    assert lock is not None and lock.is_locked
    block.release()
    assert not lock.is_locked
    reserve_port_block(tmp_path, port_range=(low, high)).release()  # the only block: free again


def test_a_released_block_is_forgotten(tmp_path: Path) -> None:
    """A held block is kept alive until released (never freed by garbage collection); a released one is not."""
    import gc
    import weakref

    low, high = free_range(1, 4)
    block = reserve_port_block(tmp_path, port_range=(low, high))
    ref = weakref.ref(block)
    del block
    gc.collect()
    held = ref()
    assert held is not None and not held.released
    held.release()
    del held
    gc.collect()
    assert ref() is None


def test_blocks_named_last_are_taken_only_when_no_other_is_free(tmp_path: Path) -> None:
    """A retry after an engine found a port of its block taken names that block ``last``: another free block comes
    first, whichever this process would look at first; the block itself is taken again when nothing else is free
    (a one-block range)."""
    low, high = free_range(3, 4)
    with reserve_port_block(tmp_path, port_range=(low, high)) as first:
        first_base = first.port  # the block this process looks at first
    with reserve_port_block(tmp_path, port_range=(low, high), last=[first_base]) as other:
        assert other.port != first_base
    bases = [low, low + 4, low + 8]
    with reserve_port_block(tmp_path, port_range=(low, high), last=[b for b in bases if b != first_base]) as kept:
        assert kept.port == first_base  # only the others named: the usual order
    with reserve_port_block(tmp_path, port_range=(first_base, first_base + 3), last=[first_base]) as only:
        assert only.port == first_base  # nothing else to take


def test_reservations_never_overlap_and_exhaust(tmp_path: Path) -> None:
    low, high = free_range(5, 4)
    # an unaligned tail (high + 2) never forms a block of its own
    blocks = [reserve_port_block(tmp_path, size=4, port_range=(low, high + 2)) for _ in range(5)]
    ports = [p for b in blocks for p in b.ports]
    assert len(set(ports)) == 20
    assert sorted(b.port for b in blocks) == [low + 4 * k for k in range(5)]
    with pytest.raises(PortUnavailable) as info:
        reserve_port_block(tmp_path, size=4, port_range=(low, high + 2))
    message = str(info.value)
    assert f"no free block of 4 ports in {low}-{high + 2} on 127.0.0.1" in message
    assert "5 of 5 block(s) reserved by other workers" in message
    blocks[2].release()
    with reserve_port_block(tmp_path, size=4, port_range=(low, high + 2)) as freed:
        assert freed.ports == blocks[2].ports
    for block in blocks:
        block.release()


def test_port_in_use_is_skipped(tmp_path: Path) -> None:
    low, high = free_range(2, 4)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", low + 2))  # someone else's listener in the first block
        squatter.listen(1)
        block = reserve_port_block(tmp_path, port_range=(low, high))
        assert block.ports == (low + 4, low + 5, low + 6, low + 7)
        with pytest.raises(PortUnavailable) as info:
            reserve_port_block(tmp_path, port_range=(low, high))
        message = str(info.value)
        assert (
            "1 of 2 block(s) reserved" in message
            and f"1 with a port already in use (e.g. {low + 2})" in message
        )
        assert not (tmp_path / f"port-{low}.lock").exists() or _lock_is_free(tmp_path / f"port-{low}.lock")
    block.release()


def _closed_connection_on(port: int) -> None:
    """Leave a connection of a server that listened on ``port`` (with ``SO_REUSEADDR``, as uvicorn does) in
    ``TIME_WAIT`` there: the server's side closes first, then the client's, then the listener goes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(1)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()
        client.recv(1)  # the server's FIN has arrived
        client.close()


def test_a_port_with_only_closed_connections_is_free_to_an_engine_that_binds_with_reuse_addr(
        tmp_path: Path) -> None:
    """A port whose earlier server left connections in TIME_WAIT is in use for a plain bind (the pool takes
    another block) but free for the engine's SO_REUSEADDR bind (a pinned port need not wait up to 60 s); a port
    somebody listens on is in use either way."""
    low, high = free_range(1, 4)
    _closed_connection_on(low)
    with pytest.raises(PortUnavailable, match=rf"1 with a port already in use \(e.g. {low}\)"):
        reserve_port_block(tmp_path, port_range=(low, high))
    with reserve_port_block(tmp_path, port_range=(low, high), reuse_addr=True) as block:
        assert block.ports == (low, low + 1, low + 2, low + 3) and block.waited == 0.0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", low + 1))
        listener.listen(1)
        with pytest.raises(PortUnavailable, match=rf"1 with a port already in use \(e.g. {low + 1}\)"):
            reserve_port_block(tmp_path, port_range=(low, high), reuse_addr=True)


def _lock_is_free(path: Path) -> bool:
    from filelock import FileLock, Timeout

    lock = FileLock(path)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return False
    lock.release()
    return True


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 2 ports"):
        reserve_port_block(tmp_path, size=1, port_range=(20000, 20010))
    with pytest.raises(ValueError, match="less than one block of 4"):
        reserve_port_block(tmp_path, port_range=(20000, 20002))
    with pytest.raises(ValueError, match="LOW 20010 is above HIGH 20000"):
        reserve_port_block(tmp_path, port_range=(20010, 20000))


# --------------------------------------------------------------------------------------------------
# across processes

HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from pytest_sglworker.resources.ports import reserve_port_block
    low, high = int(sys.argv[2]), int(sys.argv[3])
    block = reserve_port_block(Path(sys.argv[1]), port_range=(low, high))
    print(" ".join(map(str, block.ports)), flush=True)
    sys.stdin.readline()
    """
)


@pytest.fixture
def holder_procs() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def _hold_block(
    procs: list[subprocess.Popen[str]], lock_dir: Path, low: int, high: int
) -> tuple[subprocess.Popen[str], tuple[int, ...]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(lock_dir), str(low), str(high)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        cwd=REPO_ROOT,
    )
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, tuple(int(p) for p in line.split())


def test_reservations_do_not_overlap_across_processes(
    tmp_path: Path, holder_procs: list[subprocess.Popen[str]]
) -> None:
    low, high = free_range(3, 4)
    _, first = _hold_block(holder_procs, tmp_path, low, high)
    proc, second = _hold_block(holder_procs, tmp_path, low, high)
    assert len(first) == 4 and len(second) == 4 and not set(first) & set(second)
    mine = reserve_port_block(tmp_path, port_range=(low, high))
    assert not set(mine.ports) & (set(first) | set(second))
    with pytest.raises(PortUnavailable, match="3 of 3 block"):
        reserve_port_block(tmp_path, port_range=(low, high))
    os.kill(proc.pid, signal.SIGKILL)  # a dead holder's block is free again
    proc.wait(timeout=10)
    with reserve_port_block(tmp_path, port_range=(low, high)) as reclaimed:
        assert reclaimed.ports == second
    mine.release()


def test_forgotten_block_stays_reserved(tmp_path: Path) -> None:
    import gc

    from pytest_sglworker.resources import ports

    low, high = free_range(1, 4)
    reserve_port_block(tmp_path, port_range=(low, high))  # no reference kept
    gc.collect()
    with pytest.raises(PortUnavailable):
        reserve_port_block(tmp_path, port_range=(low, high))
    for block in [b for b in ports._HELD_BLOCKS if b.port == low]:
        block.release()
    reserve_port_block(tmp_path, port_range=(low, high)).release()


# --------------------------------------------------------------------------------------------------
# waiting for a block (issue #12, item 9): port blocks queue the way GPU leases do


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.001)


def test_no_wait_by_default_and_the_message_says_why(tmp_path: Path) -> None:
    low, high = free_range(1, 4)
    held = reserve_port_block(tmp_path, port_range=(low, high))
    notices: list[str] = []
    with pytest.raises(PortUnavailable) as info:
        reserve_port_block(tmp_path, port_range=(low, high), on_wait=notices.append)
    assert notices == [] and " within " not in str(info.value)
    held.release()


def test_wait_times_out_with_notices_in_the_lease_style(tmp_path: Path) -> None:
    low, high = free_range(1, 4)
    held = reserve_port_block(tmp_path, port_range=(low, high))
    clock = FakeClock()
    notices: list[str] = []
    with pytest.raises(PortUnavailable) as info:
        reserve_port_block(tmp_path, port_range=(low, high), timeout=65, poll_interval=1, on_wait=notices.append,
                           clock=clock, sleep=clock.sleep)
    assert str(info.value) == (
        f"no free block of 4 ports in {low}-{high} on 127.0.0.1 within 65 s: 1 of 1 block(s) reserved by other "
        f"workers (lock files port-*.lock in {tmp_path}), 0 with a port already in use; choose a wider or another "
        "port range")
    assert [n.split(" (", 1)[1].split(")", 1)[0] for n in notices] == ["0 s of 65 s", "30 s of 65 s", "60 s of 65 s"]
    assert notices[0].startswith(f"waiting for a free block of 4 ports in {low}-{high} on 127.0.0.1 (0 s of 65 s): "
                                 "1 of 1 block(s) reserved by other workers")
    assert not list(tmp_path.glob("waiting-*"))  # the flag goes with the wait
    held.release()


def test_a_block_says_how_long_its_reservation_waited(tmp_path: Path) -> None:
    low, high = free_range(1, 4)
    held = reserve_port_block(tmp_path, port_range=(low, high))
    assert held.waited == 0.0
    clock = FakeClock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 2.0:
            held.release()

    block = reserve_port_block(tmp_path, port_range=(low, high), timeout=60, poll_interval=0.5, clock=clock,
                               sleep=sleep)
    assert block.port == low and block.waited == 2.0
    block.release()


WAITER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from pytest_sglworker.resources.ports import reserve_port_block
    low, high = int(sys.argv[2]), int(sys.argv[3])
    block = reserve_port_block(Path(sys.argv[1]), port_range=(low, high), timeout=30, poll_interval=0.05,
                               on_wait=lambda text: print("WAIT", text, flush=True))
    print("GOT", block.port, flush=True)
    block.release()
    """
)


def test_a_waiter_gets_the_block_when_the_holder_gives_it_back_and_holders_see_it_wait(
    tmp_path: Path, holder_procs: list[subprocess.Popen[str]]
) -> None:
    from pytest_sglworker.resources.gpus import DeclaredInventory, LeaseManager
    from pytest_sglworker.resources.ports import others_waiting_for_ports

    low, high = free_range(1, 4)
    held = reserve_port_block(tmp_path, port_range=(low, high))
    waiter = subprocess.Popen([sys.executable, "-c", WAITER_SCRIPT, str(tmp_path), str(low), str(high)],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                              cwd=REPO_ROOT)
    holder_procs.append(waiter)
    assert waiter.stdout is not None
    line = waiter.stdout.readline()
    assert line.startswith(f"WAIT waiting for a free block of 4 ports in {low}-{high}"), line
    # Holders of idle pooled workers see the waiter (through the GPU lease manager too) and give back.
    assert others_waiting_for_ports(tmp_path)
    assert LeaseManager(tmp_path, DeclaredInventory(1, 1024), namespace="sim-1x1").others_waiting()
    held.release()
    assert waiter.stdout.readline().strip() == f"GOT {low}"
    assert waiter.wait(timeout=20) == 0
    assert not others_waiting_for_ports(tmp_path) and not list(tmp_path.glob("waiting-*"))


def test_bad_timeout(tmp_path: Path) -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="the port wait timeout must be 0 or more seconds"):
            reserve_port_block(tmp_path, port_range=(20000, 20003), timeout=bad)


# --------------------------------------------------------------------------------------------------
# quarantine (issue #12, item 6): a block a foreign process still listens on after teardown is never handed
# out again by this process


@pytest.fixture
def clean_quarantine() -> Iterator[None]:
    from pytest_sglworker.resources import ports

    saved = dict(ports._QUARANTINED)
    yield
    ports._QUARANTINED.clear()
    ports._QUARANTINED.update(saved)
    for lock in ports._QUARANTINE_LOCKS:
        lock.release(force=True)
    ports._QUARANTINE_LOCKS.clear()


def test_quarantined_block_is_skipped_and_listed(tmp_path: Path, clean_quarantine: None) -> None:
    from pytest_sglworker.resources.ports import quarantine_port_block, quarantined_port_blocks

    low, high = free_range(2, 4)
    first = reserve_port_block(tmp_path, port_range=(low, low + 3))
    first.release()
    quarantine_port_block(first.port, reason="pid 4242 (not ours) listens on it")
    quarantine_port_block(first.port, reason="a later reason is not kept")
    assert quarantined_port_blocks() == {low: "pid 4242 (not ours) listens on it"}
    for _ in range(5):  # whatever the start block, the quarantined one is never handed out
        with reserve_port_block(tmp_path, port_range=(low, high)) as block:
            assert block.port == low + 4
    with pytest.raises(PortUnavailable) as info:
        reserve_port_block(tmp_path, port_range=(low, low + 3))
    assert "1 quarantined by this process (a process that is not ours kept listening there after a teardown)" \
        in str(info.value)


def test_quarantining_a_held_block_keeps_its_lock_until_exit(
    tmp_path: Path, clean_quarantine: None, holder_procs: list[subprocess.Popen[str]]
) -> None:
    from pytest_sglworker.resources.ports import quarantine_port_block

    low, high = free_range(1, 4)
    block = reserve_port_block(tmp_path, port_range=(low, high))
    quarantine_port_block(block, reason="escaped listener")
    assert block.released  # for its worker, the block is given back ...
    block.release()  # ... idempotently
    assert not _lock_is_free(tmp_path / f"port-{low}.lock")  # ... but no other process gets it while we live
    probe = subprocess.run(
        [sys.executable, "-c", HOLDER_SCRIPT, str(tmp_path), str(low), str(high)], input="", capture_output=True,
        text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT, timeout=60)
    assert probe.returncode != 0 and "1 of 1 block(s) reserved by other workers" in probe.stderr


def test_quarantine_refuses_a_bad_base() -> None:
    from pytest_sglworker.resources.ports import quarantine_port_block

    for bad in (0, 70000, True, "20000"):
        with pytest.raises(ValueError, match="base port lies between 1 and 65535"):
            quarantine_port_block(bad, reason="x")  # type: ignore[arg-type]


def test_a_lock_path_that_is_a_directory_skips_that_block_and_says_so(tmp_path: Path) -> None:
    low, high = free_range(2, 4)
    (tmp_path / f"port-{low}.lock").mkdir()
    for _ in range(3):
        with reserve_port_block(tmp_path, port_range=(low, high)) as block:
            assert block.port == low + 4
    with pytest.raises(PortUnavailable) as info:
        reserve_port_block(tmp_path, port_range=(low, low + 3))
    assert f"1 with an unusable lock file (port-{low}.lock is a directory)" in str(info.value)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_default_range_leaves_ray_clients_server_ports_alone(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Client's server checks a port of 23000-23999 free, then binds it seconds later: a worker reserved there in
    between broke a Ray client. The default range skips those ports; an explicit range is used as given."""
    from pytest_sglworker.resources import ports

    monkeypatch.setattr(ports, "default_port_range", lambda: (22992, 24007))
    held = []
    with pytest.raises(PortUnavailable):
        for _ in range(300):
            held.append(reserve_port_block(tmp_path / "locks"))
    got = sorted(p for block in held for p in block.ports)
    try:
        # at most the 4 blocks outside Ray's ports (fewer when another process listens on one of them)
        assert got and set(got) <= {*range(22992, 23000), *range(24000, 24008)}, got
    finally:
        for block in held:
            block.release()
    explicit = reserve_port_block(tmp_path / "locks", port_range=(23000, 23999))
    try:
        assert 23000 <= explicit.ports[0] <= 23996
    finally:
        explicit.release()


@pytest.mark.parametrize(("avoid", "blocks_left", "skipped"), [
    ((4, 7), 4, {1}),  # exactly block 1
    ((3, 3), 4, {0}),  # block 0's last port
    ((8, 8), 4, {2}),  # block 2's first port
    ((7, 8), 3, {1, 2}),  # across two blocks
    ((20, 30), 5, set()),  # above the range
    ((-10, -1), 5, set()),  # below it
])
def test_a_block_that_touches_an_avoided_range_is_never_looked_at(
        tmp_path: Path, avoid: tuple[int, int], blocks_left: int, skipped: set[int]) -> None:
    from pytest_sglworker.resources.ports import _scan

    low, _ = free_range(5)
    avoided = ((low + avoid[0], low + avoid[1]),)
    held = []
    try:
        for _ in range(blocks_left + 1):
            block, scan = _scan(tmp_path, low, 4, 5, "127.0.0.1", avoid=avoided)
            assert scan.blocks == blocks_left
            if block is None:
                break
            held.append(block)
        taken = {(block.port - low) // 4 for block in held}
        assert taken == set(range(5)) - skipped or scan.in_use, (taken, scan.explain(tmp_path))
    finally:
        for block in held:
            block.release()


def test_a_block_reserved_on_one_thread_is_released_on_another(tmp_path: Path) -> None:
    """A group's members start and stop on threads of their own."""
    import threading

    low, high = free_range(1, 4)
    block = reserve_port_block(tmp_path, port_range=(low, high))
    lock = block.held_lock()  # referenced still: released by release, not by garbage collection
    stopper = threading.Thread(target=block.release)
    stopper.start()
    stopper.join()
    reserve_port_block(tmp_path, port_range=(low, high)).release()  # the only block: free again
    assert lock is not None


def test_a_lock_file_is_never_writable_by_others_whatever_the_umask(tmp_path: Path) -> None:
    low, high = free_range(1, 4)
    old = os.umask(0)
    try:
        block = reserve_port_block(tmp_path, port_range=(low, high))
    finally:
        os.umask(old)
    block.release()
    assert oct(block.lock_path.stat().st_mode & 0o777) == "0o644"


def test_an_unusable_lock_file_skips_that_block_only(tmp_path: Path) -> None:
    from pytest_sglworker.resources.ports import _start_block

    low, high = free_range(2, 4)
    first = low + 4 * _start_block(2)  # the block this process looks at first
    (tmp_path / f"port-{first}.lock").mkdir()
    block = reserve_port_block(tmp_path, port_range=(low, high))
    try:
        assert block.port == low + 4 * (1 - _start_block(2))
    finally:
        block.release()


def test_a_scan_interrupted_while_probing_leaves_no_block_locked(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a port is probed: the block being looked at is unlocked at once, not when the traceback (which
    keeps the scan's frame and its lock) is collected."""
    from pytest_sglworker.resources import ports

    low, high = free_range(1, 4)

    def interrupted(host: str, port: int, *, reuse_addr: bool = False) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(ports, "_port_is_free", interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        reserve_port_block(tmp_path, port_range=(low, high))
    monkeypatch.undo()
    reserve_port_block(tmp_path, port_range=(low, high)).release()  # the only block: free again
    assert info.traceback  # the traceback, and the scan's frame, still held


def test_a_quarantined_block_skips_that_block_only(tmp_path: Path, clean_quarantine: None) -> None:
    from pytest_sglworker.resources.ports import _start_block, quarantine_port_block

    low, high = free_range(2, 4)
    first = low + 4 * _start_block(2)  # the block this process looks at first
    quarantine_port_block(first, reason="a test")
    block = reserve_port_block(tmp_path, port_range=(low, high))
    try:
        assert block.port == low + 4 * (1 - _start_block(2))
    finally:
        block.release()


def test_a_busy_block_skips_that_block_only(tmp_path: Path) -> None:
    from pytest_sglworker.resources.ports import _start_block

    low, high = free_range(2, 4)
    first = low + 4 * _start_block(2)  # the block this process looks at first
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", first + 2))
        busy.listen()
        block = reserve_port_block(tmp_path, port_range=(low, high))
        try:
            assert block.port == low + 4 * (1 - _start_block(2))
        finally:
            block.release()
