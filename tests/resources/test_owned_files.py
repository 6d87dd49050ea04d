"""Files the plugin touches again only once proven to be the ones it created (resources/owned_files.py), and the
interrupts it holds off while a warm group is handed over or ended (resources/signals.py)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from pytest_sglworker.resources.owned_files import (
    FileId,
    append_owned,
    link_owned,
    remove_own_entry,
    unlink_owned,
    why_not_ours,
)
from pytest_sglworker.resources.signals import signals_deferred


@pytest.fixture
def log(tmp_path: Path) -> tuple[Path, FileId]:
    folder = tmp_path / "logs"
    folder.mkdir(mode=0o700)
    path = folder / "sglang-worker-20004.log"
    path.write_text("started\n")
    ident = FileId.of(path)
    assert ident is not None
    return path, ident


def test_the_file_it_created_is_appended_to_linked_and_deleted(log: tuple[Path, FileId], tmp_path: Path) -> None:
    path, ident = log
    assert why_not_ours(path, ident) is None
    assert append_owned(path, ident, b"ended\n") is None and path.read_text() == "started\nended\n"
    link = path.parent / "sglang-worker-20004-2.log"
    assert link_owned(path, ident, link) is None and link.stat().st_ino == path.stat().st_ino
    assert unlink_owned(link, ident) is None and unlink_owned(path, ident) is None and not path.exists()
    assert unlink_owned(path, ident) is None  # gone already: nothing to do


def test_another_file_at_the_path_is_never_touched(log: tuple[Path, FileId], tmp_path: Path) -> None:
    path, ident = log
    other = path.with_name("other")
    other.write_text("someone else's\n")
    os.replace(other, path)  # same name, another inode
    assert "not the file the plugin created" in (append_owned(path, ident, b"x\n") or "")
    assert "not the file the plugin created" in (unlink_owned(path, ident) or "")
    assert "not the file the plugin created" in (link_owned(path, ident, tmp_path / "l.log") or "")
    assert path.read_text() == "someone else's\n" and not (tmp_path / "l.log").exists()
    assert "no identity on record" in (unlink_owned(path, None) or "")


def test_a_symlink_or_a_directory_in_its_place_is_never_followed(log: tuple[Path, FileId], tmp_path: Path) -> None:
    path, ident = log
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path.unlink()
    path.symlink_to(victim)
    assert append_owned(path, ident, b"x\n") is not None and victim.read_text() == "precious\n"
    assert unlink_owned(path, ident) is not None and path.is_symlink()
    path.unlink()
    path.mkdir()
    assert unlink_owned(path, ident) is not None and path.is_dir()


def test_a_directory_others_can_write_makes_a_file_untouchable(log: tuple[Path, FileId]) -> None:
    path, ident = log
    path.parent.chmod(0o777)
    try:
        assert why_not_ours(path, ident) == "its directory is writable by other users"
        assert unlink_owned(path, ident) is not None and path.exists()
        path.parent.chmod(0o1777)  # sticky: nobody else may remove or rename our entry
        assert why_not_ours(path, ident) is None
    finally:
        path.parent.chmod(0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_users_file_and_entry_are_theirs(log: tuple[Path, FileId], tmp_path: Path) -> None:
    path, ident = log
    os.chown(path, 65534, 65534)
    assert "belongs to uid 65534" in (append_owned(path, ident, b"x\n") or "")
    assert "belongs to uid 65534" in (remove_own_entry(path) or "") and path.exists()
    assert FileId.of(path) is None


def _to_this_thread(signum: int) -> None:
    """The signal, to this (the main) thread: its handler runs before the next line. ``os.kill`` of the process
    lets the kernel pick any thread (an xdist worker has several), and the handler may then run a few lines later,
    after the block, where the xdist worker's own handler took it under load."""
    signal.pthread_kill(threading.get_ident(), signum)


def test_an_interrupt_waits_for_the_block_then_takes_effect() -> None:
    """With Python's own SIGINT handler in place (set here: what an earlier test of the same xdist worker left
    installed decided the outcome in two full runs), the interrupt is noted inside and raised after."""
    seen: list[int] = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), signals_deferred() as received:
            _to_this_thread(signal.SIGINT)
            seen.append(len(received))  # still inside: the interrupt was noted, not raised
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [1]


def test_an_interrupt_can_be_noted_without_being_raised() -> None:
    noted: list[int] = []
    before = signal.getsignal(signal.SIGINT)
    with signals_deferred(reraise=False, on_signal=noted.append) as received:
        _to_this_thread(signal.SIGTERM)
        _to_this_thread(signal.SIGINT)
    assert received == [signal.SIGTERM, signal.SIGINT] and noted == received
    assert signal.getsignal(signal.SIGINT) is before  # the handler is back
