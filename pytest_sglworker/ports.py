"""Port blocks for workers, reserved across processes with file locks and verified free by binding.

Plain Python, no pytest; ``filelock`` is imported lazily.

A block is ``size`` consecutive ports starting at an aligned base (``base = low + k * size``). The block
``base`` is guarded by ``<lock_dir>/port-<base>.lock`` (``flock``: released by the kernel if the holder
dies), held until :meth:`PortBlock.release`, so two processes, or two workers of one process, never get
the same block. Every port of a block is bound once on the host (``SO_REUSEADDR`` off) and closed
again before the block is handed out: a port somebody else listens on (or that lingers in
``TIME_WAIT``) makes the block skipped. The first port is the HTTP port, the second the NCCL port
(``--nccl-port``); the rest are spare for ports the engine derives.

Default range: from 20000 up to just below the kernel's ephemeral range (read from
``/proc/sys/net/ipv4/ip_local_port_range``; 32768 when unreadable), so the kernel never hands a reserved
port to an outgoing connection. If the ephemeral range starts too low to leave at least
:data:`MIN_DEFAULT_PORTS` ports above 20000, the ports above the ephemeral range are used when there
are enough of them; failing that, 20000-29999, where the bind check (not the kernel) is the only
protection against an ephemeral port being taken between the check and the worker's own bind.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from .errors import PortUnavailable

if TYPE_CHECKING:
    from filelock import BaseFileLock
    from typing_extensions import Self

__all__ = [
    "DEFAULT_LOW_PORT",
    "MIN_DEFAULT_PORTS",
    "PortBlock",
    "default_port_range",
    "parse_port_range",
    "reserve_port_block",
]

DEFAULT_LOW_PORT = 20000
MIN_DEFAULT_PORTS = 1024
_FALLBACK_RANGE = (20000, 29999)
_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Blocks not yet released: a forgotten block stays reserved until the process exits, never freed by
#: garbage collection while its worker may still listen on it.
_HELD_BLOCKS: set[PortBlock] = set()
_RANGE_FORM = "expected LOW-HIGH with 1 <= LOW <= HIGH <= 65535, e.g. 20000-30000"


class PortBlock:
    """A reserved block of ports: ``port`` (HTTP), ``nccl_port``, and ``ports`` (the whole block)."""

    def __init__(self, ports: tuple[int, ...], *, host: str, lock: BaseFileLock, lock_path: Path) -> None:
        self.ports = ports
        self.host = host
        self.lock_path = lock_path
        self._lock: BaseFileLock | None = lock
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
            lock.release(force=True)

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


def _port_is_free(host: str, port: int) -> bool:
    """Bind ``port`` on every address of ``host`` (no SO_REUSEADDR), close at once; ``False`` if in use."""
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
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
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


def reserve_port_block(
    lock_dir: Path,
    *,
    size: int = 4,
    port_range: tuple[int, int] | None = None,
    host: str = "127.0.0.1",
) -> PortBlock:
    """Reserve ``size`` consecutive free ports for one worker; hold them until ``release()``.

    ``port_range`` is inclusive (default: :func:`default_port_range`). Raises :class:`PortUnavailable`
    naming the range when every block is reserved by someone else or has a port in use.
    """
    from filelock import FileLock, Timeout

    if size < 2:
        raise ValueError(f"a port block needs at least 2 ports (HTTP and NCCL), not {size}")
    low, high = port_range if port_range is not None else default_port_range()
    _check_range((low, high), what=f"{low}-{high}")
    blocks = (high - low + 1) // size
    if blocks < 1:
        raise ValueError(
            f"port range {low}-{high} holds {high - low + 1} port(s), less than one block of {size}"
        )
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    reserved = 0
    in_use: list[int] = []
    for k in _block_order(blocks, _start_block(blocks)):
        base = low + k * size
        lock_path = lock_dir / f"port-{base}.lock"
        lock = FileLock(lock_path, thread_local=False, mode=0o644)  # never world-writable, whatever the umask
        try:
            lock.acquire(blocking=False)
        except Timeout:
            reserved += 1
            continue
        ports = tuple(range(base, base + size))
        busy = next((p for p in ports if not _port_is_free(host, p)), None)
        if busy is not None:
            lock.release(force=True)
            in_use.append(busy)
            continue
        return PortBlock(ports, host=host, lock=lock, lock_path=lock_path)
    example = f" (e.g. {', '.join(str(p) for p in in_use[:3])})" if in_use else ""
    raise PortUnavailable(
        f"no free block of {size} ports in {low}-{high} on {host}: {reserved} of {blocks} block(s) reserved "
        f"by other workers (lock files port-*.lock in {lock_dir}), {len(in_use)} with a port already in "
        f"use{example}; choose a wider or another port range"
    )
