"""Port blocks for workers, reserved across processes with file locks and verified free by binding.

Plain Python, no pytest.

A block is ``size`` consecutive ports starting at an aligned base (``base = low + k * size``). The block
``base`` is guarded by ``<lock_dir>/port-<base>.lock`` (``flock``: released by the kernel if the holder
dies), held until :meth:`PortBlock.release`, so two processes, or two workers of one process, never get
the same block; in a lock directory several users share, every user's sessions take every block's lock, whoever
created its file (:mod:`.lockfiles`), and a lock file one of them cannot open only skips that block. Every port
of a block is bound once on the host (``SO_REUSEADDR`` off) and closed again before the block is handed out: a
port somebody else listens on (or that lingers in ``TIME_WAIT``) makes the block skipped. The first port is the
HTTP port, the second the NCCL port (``--nccl-port``); the rest are spare for ports the engine derives.

A caller that must have one particular block (a port pinned by a test's URL) and whose engine binds its ports with
``SO_REUSEADDR`` (uvicorn, zmq and torch's store all do) passes ``reuse_addr=True``: the check binds the same way,
so a port that holds only closed connections of an earlier server (``TIME_WAIT``, up to 60 s after it ended)
counts as free, as it is for the engine, while a port somebody listens on still does not. How long a reservation
waited is :attr:`PortBlock.waited`.

A process that finds no free block may wait for one (``timeout``), as GPU leases do: it says so with a flag
file ``<lock_dir>/waiting-ports-<pid>`` (:func:`others_waiting_for_ports`; the bookkeeping, shared with the GPU
leases, is :mod:`~pytest_sglworker.resources.waiters`), so that holders of idle pooled workers give their blocks
back instead of keeping them.

A block whose port is still listened on after its worker's teardown, by a process that is not provably ours
(an escaped listener), is **quarantined** (:func:`quarantine_port_block`): never handed out again by this
process, and, when the block is still held, its lock stays held until the process exits, so that no other
process of the machine gets it either.

Default range: from 20000 up to just below the kernel's ephemeral range (read from
``/proc/sys/net/ipv4/ip_local_port_range``; 32768 when unreadable), so the kernel never hands a reserved
port to an outgoing connection. If the ephemeral range starts too low to leave at least
:data:`MIN_DEFAULT_PORTS` ports above 20000, the ports above the ephemeral range are used when there
are enough of them; failing that, 20000-29999, where the bind check (not the kernel) is the only
protection against an ephemeral port being taken between the check and the worker's own bind. The default
range leaves out the ports other services hand out by themselves (:data:`FOREIGN_PORTS`: Ray Client's servers).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from ..errors import PortUnavailable
from .lockfiles import LockFile
from .waiters import PORTS_WAITING_PREFIX, flag_waiting, others_waiting_for_ports, unflag_waiting

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DEFAULT_LOW_PORT",
    "FOREIGN_PORTS",
    "MIN_DEFAULT_PORTS",
    "PORT_BLOCK_SIZE",
    "PortBlock",
    "default_port_range",
    "others_waiting_for_ports",
    "parse_port_range",
    "quarantine_port_block",
    "quarantined_port_blocks",
    "reserve_port_block",
]

DEFAULT_LOW_PORT = 20000
#: Ports every worker (and the router) reserves, as one block: a worker kind's pinned ports (HTTP, NCCL, a
#: bootstrap port), the rest spare for ports the engine derives.
PORT_BLOCK_SIZE = 4
MIN_DEFAULT_PORTS = 1024
_FALLBACK_RANGE = (20000, 29999)
#: Ports another service of the same machine hands out by itself, which the default range leaves alone: Ray
#: Client's server gives each new client a server process on a port of 23000-23999 that it checks free when it
#: chooses it and binds seconds later (``MIN/MAX_SPECIFIC_SERVER_PORT`` in ray/util/client/server/proxier.py), so a
#: worker reserved there in between made that client fail ("Starting Ray client server failed"). An explicit
#: ``--sgl-port-range`` is used as given.
FOREIGN_PORTS = ((23000, 23999),)
_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Blocks not yet released: a forgotten block stays reserved until the process exits, never freed by
#: garbage collection while its worker may still listen on it.
_HELD_BLOCKS: set[PortBlock] = set()
_RANGE_FORM = "expected LOW-HIGH with 1 <= LOW <= HIGH <= 65535, e.g. 20000-30000"
#: Block bases this process never hands out again -> why (see :func:`quarantine_port_block`).
_QUARANTINED: dict[int, str] = {}
#: Locks of quarantined blocks, held until the process exits (the kernel then drops them).
_QUARANTINE_LOCKS: list[LockFile] = []
WAITING_PREFIX = PORTS_WAITING_PREFIX  # the flag prefix of a port waiter (see resources.waiters)


class PortBlock:
    """A reserved block of ports: ``port`` (HTTP), ``nccl_port``, and ``ports`` (the whole block)."""

    def __init__(self, ports: tuple[int, ...], *, host: str, lock: LockFile, lock_path: Path,
                 waited: float = 0.0) -> None:
        self.ports = ports
        self.host = host
        self.lock_path = lock_path
        #: seconds :func:`reserve_port_block` waited for this block (0 when it was free at once)
        self.waited = waited
        self._lock: LockFile | None = lock
        _HELD_BLOCKS.add(self)

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def nccl_port(self) -> int:
        return self.ports[1]

    @property
    def spare(self) -> tuple[int, ...]:
        return self.ports[2:]

    @property
    def released(self) -> bool:
        return self._lock is None

    def release(self) -> None:
        """Give the block back. Idempotent."""
        lock, self._lock = self._lock, None
        _HELD_BLOCKS.discard(self)
        if lock is not None:
            lock.release()

    def held_lock(self) -> LockFile | None:
        """The block's lock, for a hand-over to another process (``--sgl-keep-warm``: see :meth:`handed_over`)."""
        return self._lock

    def handed_over(self) -> None:
        """Say that another process holds this block's locked file now (a warm group's keeper inherited it) and
        that the caller has forgotten its own copy: the block counts as released, nothing is unlocked."""
        self._lock = None
        _HELD_BLOCKS.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<PortBlock {self.host}:{self.ports[0]}-{self.ports[-1]} ({state})>"


def parse_port_range(value: str) -> tuple[int, int]:
    """Parse ``LOW-HIGH`` (inclusive), e.g. ``20000-30000``. ``ValueError`` says what is wrong."""
    text = value.strip()
    low_text, sep, high_text = text.partition("-")
    if not sep:
        raise ValueError(f"invalid port range {value!r}: no '-' between the bounds; {_RANGE_FORM}")
    try:
        low, high = int(low_text.strip()), int(high_text.strip())
    except ValueError:
        raise ValueError(
            f"invalid port range {value!r}: the bounds must be whole numbers; {_RANGE_FORM}"
        ) from None
    _check_range((low, high), what=repr(value))
    return low, high


def _check_range(port_range: tuple[int, int], *, what: str) -> None:
    low, high = port_range
    if not 1 <= low <= 65535 or not 1 <= high <= 65535:
        raise ValueError(f"invalid port range {what}: ports lie between 1 and 65535; {_RANGE_FORM}")
    if low > high:
        raise ValueError(f"invalid port range {what}: LOW {low} is above HIGH {high}; {_RANGE_FORM}")


def default_port_range(ephemeral_file: Path = _EPHEMERAL_FILE) -> tuple[int, int]:
    """The range used when none is configured: below the ephemeral range (see the module docstring)."""
    try:
        eph_low, eph_high = (int(x) for x in ephemeral_file.read_text().split()[:2])
    except (OSError, ValueError):
        eph_low, eph_high = 32768, 60999
    if eph_low - DEFAULT_LOW_PORT >= MIN_DEFAULT_PORTS:
        return DEFAULT_LOW_PORT, eph_low - 1
    if 65535 - eph_high >= MIN_DEFAULT_PORTS:
        return eph_high + 1, 65535
    return _FALLBACK_RANGE


def _port_is_free(host: str, port: int, *, reuse_addr: bool = False) -> bool:
    """Bind ``port`` on every address of ``host``, close at once; ``False`` if in use. Without ``reuse_addr`` the
    bind is plain (a port in ``TIME_WAIT`` is in use); with it, ``SO_REUSEADDR`` as the engine's own bind (a port
    somebody listens on, or holds bound without ``SO_REUSEADDR``, is in use; one with only closed connections is
    not)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve the worker host {host!r}: {exc}") from None
    bound_any = False
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # address family not supported here (e.g. IPv6 disabled)
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_addr))
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) and len(infos) > 1:
                    continue  # this address does not exist here; another one of the host's does
                return False
            bound_any = True
    return bound_any


def _start_block(blocks: int) -> int:
    """A pseudo-random first block, from the pid, so that parallel processes start apart."""
    return (os.getpid() * 2654435761) % blocks


def _block_order(blocks: int, start: int) -> Iterator[int]:
    for offset in range(blocks):
        yield (start + offset) % blocks


def quarantine_port_block(block: PortBlock | int, *, reason: str) -> None:
    """Never hand out the block ``block`` (a :class:`PortBlock`, or a block's base port) again in this process.

    For a port still listened on after its worker's teardown by a process that is not provably ours. A held
    :class:`PortBlock` keeps its lock until the process exits (the block counts as released), so that other
    processes of the machine skip it too; a base port (of a block already released) is only skipped here.
    Idempotent; the first reason is kept.
    """
    if isinstance(block, PortBlock):
        base = block.port
        lock, block._lock = block._lock, None
        _HELD_BLOCKS.discard(block)
        if lock is not None:
            _QUARANTINE_LOCKS.append(lock)
    else:
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 65535:
            raise ValueError(f"a port block's base port lies between 1 and 65535, not {block!r}")
        base = block
    _QUARANTINED.setdefault(base, reason)


def quarantined_port_blocks() -> dict[int, str]:
    """The block bases this process quarantined, with the reason of each (a copy)."""
    return dict(_QUARANTINED)


class _Scan:
    """What one pass over the range found, for the wait and failure messages."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.reserved = 0
        self.in_use: list[int] = []
        self.quarantined = 0
        self.unusable: list[str] = []

    def explain(self, lock_dir: Path) -> str:
        example = f" (e.g. {', '.join(str(p) for p in self.in_use[:3])})" if self.in_use else ""
        text = (f"{self.reserved} of {self.blocks} block(s) reserved by other workers (lock files port-*.lock in "
                f"{lock_dir}), {len(self.in_use)} with a port already in use{example}")
        if self.quarantined:
            text += (f", {self.quarantined} quarantined by this process (a process that is not ours kept "
                     "listening there after a teardown)")
        if self.unusable:
            text += f", {len(self.unusable)} with an unusable lock file ({'; '.join(self.unusable[:2])})"
        return text


def reserve_port_block(
    lock_dir: Path,
    *,
    size: int = PORT_BLOCK_SIZE,
    port_range: tuple[int, int] | None = None,
    host: str = "127.0.0.1",
    timeout: float = 0.0,
    poll_interval: float = 0.25,
    on_wait: Callable[[str], None] | None = None,
    notice_interval: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    reuse_addr: bool = False,
    last: Collection[int] = (),
) -> PortBlock:
    """Reserve ``size`` consecutive free ports for one worker; hold them until ``release()``.

    ``port_range`` is inclusive (default: :func:`default_port_range`). When no block is free, waits up to
    ``timeout`` seconds (default: not at all) for one, as :meth:`LeaseManager.acquire
    <pytest_sglworker.resources.gpus.LeaseManager.acquire>` waits for GPUs: flagged in the lock directory (see
    :func:`others_waiting_for_ports`), with ``on_wait`` told when the wait starts and every
    ``notice_interval`` seconds. Raises :class:`PortUnavailable` naming the range and why each block was
    skipped (reserved, in use, quarantined, an unusable lock file) when the time is up. ``reuse_addr``: the
    ports are checked the way an engine that binds with ``SO_REUSEADDR`` finds them (see the module docstring).
    The block's :attr:`~PortBlock.waited` says how long the wait took. ``last``: the base ports of blocks to try only
    when no other block is free (a retry after an engine found a port of its block taken: the taker may come back).
    """
    if size < 2:
        raise ValueError(f"a port block needs at least 2 ports (HTTP and NCCL), not {size}")
    low, high = port_range if port_range is not None else default_port_range()
    _check_range((low, high), what=f"{low}-{high}")
    blocks = (high - low + 1) // size
    if blocks < 1:
        raise ValueError(
            f"port range {low}-{high} holds {high - low + 1} port(s), less than one block of {size}"
        )
    if timeout != timeout or timeout < 0:  # NaN or negative
        raise ValueError(f"the port wait timeout must be 0 or more seconds, not {timeout!r}")
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    start = clock()
    next_notice: float | None = None
    waiting_flag: Path | None = None
    what = f"block of {size} ports in {low}-{high} on {host}"
    try:
        while True:
            block, scan = _scan(lock_dir, low, size, blocks, host, avoid=FOREIGN_PORTS if port_range is None else (),
                                reuse_addr=reuse_addr, last=last)
            now = clock()
            if block is not None:
                block.waited = now - start if waiting_flag is not None else 0.0
                return block
            waited = now - start
            if waited >= timeout:
                within = f" within {timeout:g} s" if timeout > 0 else ""
                raise PortUnavailable(f"no free {what}{within}: {scan.explain(lock_dir)}; choose a wider or "
                                      "another port range")
            if waiting_flag is None:
                waiting_flag = flag_waiting(lock_dir, PORTS_WAITING_PREFIX)
            if on_wait is not None and (next_notice is None or now >= next_notice):
                on_wait(f"waiting for a free {what} ({waited:.0f} s of {timeout:g} s): {scan.explain(lock_dir)}")
                next_notice = now + notice_interval
            sleep(max(min(poll_interval, timeout - waited), 0.0))
    finally:
        unflag_waiting(waiting_flag)


def _scan(lock_dir: Path, low: int, size: int, blocks: int, host: str,
          avoid: tuple[tuple[int, int], ...] = (), *, reuse_addr: bool = False,
          last: Collection[int] = ()) -> tuple[PortBlock | None, _Scan]:
    """One pass over the blocks, from a per-process start: the first free one, locked, or why there is none.
    Blocks that overlap a range of ``avoid`` are not looked at; those whose base is in ``last`` are looked at after
    every other one."""
    order = [k for k in _block_order(blocks, _start_block(blocks))
             if not any(low + k * size <= hi and low + (k + 1) * size - 1 >= lo for lo, hi in avoid)]
    if last:
        order = [k for k in order if low + k * size not in last] + [k for k in order if low + k * size in last]
    scan = _Scan(len(order))
    for k in order:
        base = low + k * size
        if base in _QUARANTINED:
            scan.quarantined += 1
            continue
        lock_path = lock_dir / f"port-{base}.lock"
        lock = LockFile(lock_path)  # 0644 whatever the umask: every user may open it to lock it
        try:
            locked = lock.acquire()
        except OSError as exc:  # a directory, a symlink, a file this user may not open: skip the block, say so
            from .state import describe_file_problem

            scan.unusable.append(f"{lock_path.name} {describe_file_problem(lock_path, exc)}")
            continue
        if not locked:
            scan.reserved += 1
            continue
        ports = tuple(range(base, base + size))
        try:
            busy = next((p for p in ports if not _port_is_free(host, p, reuse_addr=reuse_addr)), None)
        except BaseException:
            lock.release()
            raise
        if busy is not None:
            lock.release()
            scan.in_use.append(busy)
            continue
        return PortBlock(ports, host=host, lock=lock, lock_path=lock_path), scan
    return None, scan
