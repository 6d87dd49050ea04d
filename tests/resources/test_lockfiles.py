"""Lock files every user of a shared lock directory can take (resources/lockfiles.py), and the lock directory pinned
once checked (resources/state.py: a directory swapped for a symlink mid-session never gets a file created
elsewhere; issue 38, finding 6)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pytest_sglworker.resources.gpus import DeclaredInventory, LeaseManager
from pytest_sglworker.resources.lockfiles import LockFile, Unusable
from pytest_sglworker.resources.ports import reserve_port_block
from pytest_sglworker.resources.state import UnsafeDirectory, atomic_write, ensure_private_dir


def test_a_lock_file_is_readable_by_all_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        lock = LockFile(tmp_path / "a.lock")
        assert lock.acquire()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.lock").stat().st_mode) == 0o644
    other = LockFile(tmp_path / "a.lock")
    assert not other.acquire()  # another open file: the flock is held
    lock.release()
    assert other.acquire()
    other.release()


def test_a_lock_file_opened_read_only_still_locks(tmp_path: Path) -> None:
    """What a user meets with another user's lock file: it may only read it; a flock needs no more."""
    import fcntl

    path = tmp_path / "b.lock"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not LockFile(path).acquire()
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@pytest.mark.parametrize("planted", ["directory", "symlink"])
def test_what_is_no_lock_file_is_an_error_never_followed(tmp_path: Path, planted: str) -> None:
    path = tmp_path / "c.lock"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    if planted == "directory":
        path.mkdir()
    else:
        path.symlink_to(victim)
    with pytest.raises(OSError):
        LockFile(path).acquire()
    assert victim.read_text() == "precious"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_claim_is_a_lock_file_of_ones_own(tmp_path: Path) -> None:
    path = tmp_path / "warm-1-abcdefab.lock"
    path.write_bytes(b"")
    os.chown(path, 65534, 65534)
    with pytest.raises(Unusable, match="belongs to uid 65534 \\(another user\\)"):
        LockFile(path, mode=0o600, own_only=True).acquire()
    assert LockFile(path).acquire()  # a GPU or port lock file of another user is locked all the same


def test_a_lock_directory_swapped_for_a_symlink_mid_session_gets_no_file_elsewhere(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    ensure_private_dir(locks, what="lock directory")
    manager = LeaseManager(locks, DeclaredInventory(1, 1024), namespace="sim-1x1")
    with manager.acquire(1, 10, holder="before", timeout=0):
        pass
    third = tmp_path / "third"
    third.mkdir()
    moved = tmp_path / "moved"
    locks.rename(moved)
    locks.symlink_to(third)
    (moved / "gpu-sim-1x1-0.lock").unlink()  # so that the next lease must create its lock file again
    with manager.acquire(1, 10, holder="after", timeout=0) as lease:
        assert lease.indices == (0,)
        assert (moved / "gpu-sim-1x1-0.json").exists()
    block = reserve_port_block(locks, port_range=(41000, 41999))
    block.release()
    atomic_write(locks / "record.json", "{}")
    assert list(third.iterdir()) == [], "a file was created in the directory the symlink names"
    assert (moved / "gpu-sim-1x1-0.lock").exists() and (moved / f"port-{block.port}.lock").exists()
    with pytest.raises(UnsafeDirectory, match="is a symlink; refusing to follow it"):
        ensure_private_dir(locks, what="lock directory")


def test_a_parent_writable_by_others_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    """Finding 6: every directory above the lock directory counts, not only the last."""
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match=rf"lies in {parent}, which is writable by other users \(mode 777\)"):
        ensure_private_dir(parent / "locks", what="lock directory", shared_ok=True)
    parent.chmod(0o1777)  # sticky, like /tmp: nobody else can swap our entry
    assert ensure_private_dir(parent / "locks", what="lock directory", shared_ok=True) == parent / "locks"
