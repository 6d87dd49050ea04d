"""The runtime behind the drop-ins of :mod:`.dropins`: ``popen_launch_server`` served by the running pytest session
(the launch goes through the plugin's budget check, sglang's own flag check, a GPU lease, the pinned port of the test's
``base_url``, the pool's launch and readiness wait, a log file per port, a failure with its diagnosis, and the
failure sections of the tests that used the server), and who owns each server until it is given back.

Who owns a server: the scope that launched it. :class:`CompatRuntime` (a plugin object, registered when a session
starts) watches which fixture is being set up (``pytest_fixture_setup``) and which test is being called. A server
launched inside a fixture (unittest's ``setUpClass`` and ``setUpModule`` are class- and module-scoped fixtures
under pytest) belongs to that fixture; one launched by a test's call (``setUp``, the test method) to that test.

- Just before the owning fixture's teardown (``tearDownClass``) runs, a server that is no longer alive died while
  its tests ran: a death (it fails the last test when all of them passed; a class with ``expect_server_exit =
  True`` expects it). After the teardown, a server that is gone was ended by it (sglang's own
  ``kill_process_tree``, unchanged in the file): a deliberate stop. A server still running was forgotten: the
  plugin stops it and says so. Either way the pool retires it and the GPU lease comes back.
- The drop-in's ``kill_process_tree(pid)`` (or ``terminate()`` / ``kill()`` of the returned process) ends a
  server at once the same way: the plugin's tree teardown, its lease and port given back, counted as a stop.
- At the session's end anything left is given back; the pool's own close and the session's watchdog stand behind
  that, so nothing outlives the session.

Why no ``subprocess.Popen``: :class:`ServerProcess` is duck-typed (``pid``, ``poll``, ``wait``, ``returncode``,
``terminate``, ``kill``, ``send_signal``, ``args``). sglang's ``CustomTestCase`` starts a watcher for a
``Popen`` that calls ``os._exit`` when the server exits non-zero during a test method: under pytest that kills
the whole session before any report or teardown. The plugin reports the death itself, with its diagnosis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..engine.sglang_facts import LOOPBACK_HOST, flag_table
from ..errors import InventoryUnavailable, SglWorkerError
from ..plugin.keys import WORKERS_KEY
from ..plugin.markers import MarkerError, opt_out_reason
from ..plugin.run_hooks import enable_run_hooks
from ..plugin.session import SglSession, active_session, session_plugin, when_session_starts
from ..resources.ports import PORT_BLOCK_SIZE, PortBlock, default_port_range, reserve_port_block
from ..workers.config import WorkerConfig
from ..workers.errors import WorkerDied
from ..workers.process import PER_TEST_VARIABLES
from ..workers.sources.base import GroupRequest, GroupUse, SourceRefusal
from .models import CompatError, opt_out_for, renamed_args, resolve_spec

if TYPE_CHECKING:
    from ..workers.group import WorkerGroup
    from ..workers.launcher import ModelInstance

__all__ = ["RUNTIME_NAME", "CompatRuntime", "ServerProcess", "install", "parse_base_url", "runtime"]

RUNTIME_NAME = "sglworker-compat"
#: host names of a ``base_url`` that reach the worker, which binds 127.0.0.1 only
LOOPBACK_URL_HOSTS = frozenset({LOOPBACK_HOST, "localhost"})

BUDGET_FIX = ("keep --mem-fraction-static at most 0.6 and --cuda-graph-backend-prefill=disabled in other_args, or "
              "opt out with a reason: pytest_sglworker.compat.budget_opt_out('{cls}', reason='why') in a conftest.py, "
              "or @pytest.mark.sgl_budget_opt_out(reason='why') on the test class")


def parse_base_url(base_url: str) -> tuple[str, int]:
    """``(host, port)`` of a test's ``base_url`` (``http://127.0.0.1:21000``); a :class:`CompatError` for anything
    the worker cannot serve: another scheme, a path, no port, a host that is not loopback."""
    try:
        parts = urllib.parse.urlsplit(base_url)
        port = parts.port
    except (ValueError, TypeError, AttributeError) as exc:
        raise CompatError(f"popen_launch_server: base_url {base_url!r} is not a URL ({exc})") from None
    if parts.scheme != "http" or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise CompatError(f"popen_launch_server: base_url {base_url!r} must be http://HOST:PORT (no path, no "
                          "credentials), as sglang's DEFAULT_URL_FOR_TEST is")
    host = parts.hostname or ""
    if host not in LOOPBACK_URL_HOSTS:
        raise CompatError(f"popen_launch_server: base_url {base_url!r} names host {host!r}; workers listen on "
                          f"{LOOPBACK_HOST} only: use http://{LOOPBACK_HOST}:PORT")
    if port is None or not 1 <= port <= 65536 - PORT_BLOCK_SIZE:
        raise CompatError(f"popen_launch_server: base_url {base_url!r} needs a port between 1 and "
                          f"{65536 - PORT_BLOCK_SIZE} (the worker pins it and the {PORT_BLOCK_SIZE - 1} after it)")
    return host, port


class ServerProcess:
    """What :func:`popen_launch_server` returns: the worker's root process, shaped like ``subprocess.Popen``
    (``pid``, ``args``, ``returncode``, ``poll()``, ``wait()``, ``terminate()``, ``kill()``, ``send_signal()``),
    plus ``url``, ``log_path`` and ``worker`` (the plugin's :class:`~pytest_sglworker.ModelInstance`)."""

    stdin = None
    stdout = None
    stderr = None

    def __init__(self, runtime: CompatRuntime, worker: ModelInstance, base_url: str) -> None:
        self._runtime = runtime
        self.worker = worker
        self.url = base_url

    @property
    def pid(self) -> int:
        return self.worker.pid

    @property
    def args(self) -> list[str]:
        return list(self.worker.argv)

    @property
    def returncode(self) -> int | None:
        return self.worker.process.poll()

    @property
    def log_path(self) -> Path:
        return self.worker.log_path

    def poll(self) -> int | None:
        return self.worker.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the root process to exit (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        return self.worker.process.wait(timeout)

    def terminate(self) -> None:
        """End the server now: the plugin's teardown of the whole tree, its lease and port given back."""
        self._runtime.end(self.pid)

    def kill(self) -> None:
        """SIGKILL the root, then the same as :meth:`terminate`."""
        self._runtime.end(self.pid, sig=signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the root process on purpose: the exit that follows is a stop, not a death."""
        self.worker.kill(sig)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def __repr__(self) -> str:
        return f"<ServerProcess {self.worker.describe()} for {self.url}>"


@dataclasses.dataclass(eq=False)
class _Launch:
    """A server the drop-in launched, and who owns it."""

    group: WorkerGroup
    #: the node id of what it serves (a test class, a module, a test), for messages and the run report
    owner: str
    #: the fixture whose setup launched it (``setUpClass``): given back after that fixture's teardown
    fixturedef: Any
    #: the test whose call launched it: given back after that call
    item: pytest.Item | None
    #: the unittest class of the owner, whose ``expect_server_exit`` says a death is expected
    cls: type | None
    started: float
    guards: list[PortBlock]
    tee_stop: threading.Event | None = None
    failed: bool = False
    died: bool = False

    @property
    def worker(self) -> ModelInstance:
        return self.group[0]


#: how long a server that is being killed gets to finish exiting before it counts as still running
EXIT_GRACE_SECONDS = 60.0
_PF_EXITING = 0x4  # task flag set when the kernel starts tearing a process down (include/linux/sched.h)
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _dying(pid: int) -> bool:
    """Whether ``pid`` is being killed: SIGKILL pending, or the kernel already tearing it down. sglang's
    ``kill_process_tree`` returns once a killed root can no longer be signalled, which for a large process can be
    before it has exited (freeing its memory takes a while on a busy machine): that root is not a server the
    teardown forgot. Linux only (``/proc``); elsewhere False."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    try:
        flags = int(stat.rsplit(")", 1)[1].split()[6])  # field 9 of stat; fields 1-2 end at the last ')'
    except (IndexError, ValueError):
        flags = 0
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            with contextlib.suppress(ValueError):
                pending |= int(line.split(":", 1)[1].strip(), 16)
    return bool(flags & _PF_EXITING or pending & _SIGKILL_BIT)


def _settle(worker: ModelInstance) -> bool:
    """Whether ``worker``'s root is alive, after letting a root that is being killed finish exiting."""
    if worker.is_alive() and _dying(worker.pid):
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(EXIT_GRACE_SECONDS)
    return worker.is_alive()


def _tee(path: Path, sink: Any, stop: threading.Event) -> None:
    """Copy the worker's log, from its start, into ``sink`` (``return_stdout_stderr``) until ``stop`` is set."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            while True:
                line = fh.readline()
                if line:
                    sink.write(line)
                    with contextlib.suppress(Exception):
                        sink.flush()
                elif stop.is_set():
                    return
                else:
                    stop.wait(0.1)
    except (OSError, ValueError):  # the log went away, or the test closed its sink: nothing more to copy
        return


class CompatRuntime:
    """The drop-in's state in one session: the servers it launched, which scope owns each, and the hooks that give
    them back when that scope ends. Registered as a plugin when a session starts (:func:`install`)."""

    def __init__(self, session: SglSession) -> None:
        self.session = session
        self.launches: dict[int, _Launch] = {}
        self._fixtures: list[tuple[Any, Any]] = []
        self._item: pytest.Item | None = None
        self._calling: pytest.Item | None = None
        self._timeouts_said: set[float] = set()  # file timeouts already said to differ from --sgl-startup-timeout

    # -- hooks ----------------------------------------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        self._item = item
        try:
            return (yield)
        finally:
            self._item = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Every server up now serves this test too: a failure of it gets the servers' log sections."""
        self._remember_on(item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        self._calling = item
        try:
            return (yield)
        finally:
            self._calling = None
            self._give_back_where(lambda launch: launch.item is item, after=f"the test {item.nodeid}")

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Generator[None, Any, Any]:
        self._fixtures.append((fixturedef, request))
        try:
            return (yield)
        finally:
            self._fixtures.pop()
            if any(launch.fixturedef is fixturedef for launch in self.launches.values()):
                # Finalizers run last-in first-out: this one runs before the fixture's own teardown (tearDownClass).
                fixturedef.addfinalizer(functools.partial(self._before_teardown, fixturedef))

    def pytest_fixture_post_finalizer(self, fixturedef: Any, request: Any) -> None:
        self._give_back_where(lambda launch: launch.fixturedef is fixturedef,
                              after=f"the teardown of {getattr(request.node, 'nodeid', request.node)}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            for launch in self.launches.values():
                launch.failed = True

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self._give_back_where(lambda launch: True, after="the session")

    # -- launching ------------------------------------------------------------------------------------------
    def _owner(self) -> tuple[str, Any, pytest.Item | None, type | None, Any]:
        """``(owner node id, fixturedef, item, unittest class, node)`` of a launch made now."""
        if self._calling is not None:
            item = self._calling
            return item.nodeid, None, item, getattr(item, "cls", None), item
        if self._fixtures:
            fixturedef, request = self._fixtures[-1]
            node = request.node
            return getattr(node, "nodeid", str(node)), fixturedef, None, getattr(request, "cls", None), node
        if self._item is not None:
            return self._item.nodeid, None, None, getattr(self._item, "cls", None), self._item
        return "the session", None, None, None, None

    def launch(self, model: str, base_url: str, timeout: float, *, api_key: str | None, other_args: Sequence[Any],
               env: Mapping[str, Any] | None, return_stdout_stderr: Any, device: str) -> ServerProcess:
        session = self.session
        _, port = parse_base_url(base_url)
        owner, fixturedef, item, cls, node = self._owner()
        scope = getattr(fixturedef, "scope", None)
        where = {"class": f"{owner} (setUpClass)", "module": f"{owner} (setUpModule)"}.get(str(scope), owner)
        if isinstance(other_args, str):
            raise CompatError(f"popen_launch_server(other_args=...) in {where} must be a list of arguments, not the "
                              f"string {other_args!r}")
        given = [str(a) for a in other_args]
        renamed, renames = renamed_args(given)
        parsed = flag_table().parse(renamed)
        if parsed.given("port"):
            raise CompatError(f"popen_launch_server in {where}: other_args name --port {parsed.last('port')}; the "
                              f"port comes from base_url ({base_url})")
        if not isinstance(model, str) or not model:
            raise CompatError(f"popen_launch_server in {where}: model must be a model name or path, got {model!r}")
        spec = resolve_spec(model, session.registry)
        environ = session.worker_environ()
        args = list(renamed)
        if api_key:
            args += ["--api-key", str(api_key)]
        if device and device != "auto":
            args += ["--device", str(device)]
        if model != spec.resolve_model_path(environ) and not parsed.given("served_model_name"):
            args += ["--served-model-name", model]  # the name the test asks for, as sglang would serve it
        # sglang merges env over os.environ; only what differs from the environment a worker inherits anyway
        # is this server's own (a suite that passes a whole os.environ copy adds nothing).
        own_env = {str(k): str(v) for k, v in (env or {}).items()
                   if k not in PER_TEST_VARIABLES and environ.get(str(k)) != str(v)}
        try:
            # The test being run carries the markers of its class and module, and those a conftest added to it.
            marked = self._item if self._item is not None else node
            reason = opt_out_for(owner) or (opt_out_reason(marked) if marked is not None else None)
        except MarkerError as exc:
            raise CompatError(f"{where}: {exc}") from None
        cls_name = cls.__name__ if cls is not None else owner
        config = WorkerConfig.resolve(
            spec, args, own_env, opt_out=reason,
            subject=f"popen_launch_server({model!r}, other_args={given!r}) in {where} (model spec {spec.name!r})",
            fix=BUDGET_FIX.format(cls=cls_name))
        if args:
            rejected = session.check_flags({f"popen_launch_server({model!r}) in {where}": (spec, tuple(args))})
            if rejected:
                raise CompatError("\n".join(rejected.values()))
        options, guards = self._pinned(port, timeout, base_url=base_url, where=where)
        request = GroupRequest(config, f"{owner} (pid {os.getpid()})", fresh=True, launch=True, options=options,
                               budget_opt_out=bool(reason), environ=environ)
        try:
            group = session.source.acquire(request)
        except BaseException as exc:
            for guard in guards:
                guard.release()
            if isinstance(exc, SourceRefusal) and exc.refusal.action == "skip":
                pytest.skip(exc.refusal.reason)
            if isinstance(exc, InventoryUnavailable):
                pytest.skip(f"no GPU inventory: {exc}")
            raise
        for note in renames:
            session.terminal.message(f"pytest_sglworker.compat: {where}: other_args renamed {note}")
        launch = _Launch(group, owner, fixturedef, item, cls, time.time(), guards)
        self.launches[launch.worker.pid] = launch
        enable_run_hooks(session)  # the failure sections of the tests it serves
        for current in {n for n in (self._item, item) if n is not None}:
            self._remember_on(current)
        if launch.worker.port != port:  # the pool honours the pinned range; a mismatch is a bug, never a guess
            self._give_back(launch, after="a launch on the wrong port")
            raise CompatError(f"{launch.worker.describe()} does not serve {base_url}")
        if return_stdout_stderr:
            sink = return_stdout_stderr[1] if len(return_stdout_stderr) > 1 else return_stdout_stderr[0]
            launch.tee_stop = threading.Event()
            threading.Thread(target=_tee, args=(launch.worker.log_path, sink, launch.tee_stop),
                             name=f"sglworker-compat-tee-{port}", daemon=True).start()
        return ServerProcess(self, launch.worker, base_url)

    @property
    def calling(self) -> pytest.Item | None:
        """The test whose call runs now (None in a fixture's setup or teardown, as ``setUpClass``)."""
        return self._calling

    def pin_port(self, port: int, *, base_url: str, where: str) -> tuple[Any, list[PortBlock]]:
        """Launch options whose port range starts at ``port`` (a test's URL), and the guard blocks that keep the
        session's pooled workers off it (:meth:`_pinned`), for another process than a worker (a router)."""
        return self._pinned(port, 0, base_url=base_url, where=where)

    def _pinned(self, port: int, timeout: float, *, base_url: str, where: str) -> tuple[Any, list[PortBlock]]:
        """The launch options that pin the worker's port block to ``port`` and the ports after it, and the guard
        blocks: the session's own aligned blocks that overlap it, held so that no pooled worker is handed them.

        The ports are checked as the engine binds them (``SO_REUSEADDR``): the closed connections that the
        previous class's server on the same URL left (``TIME_WAIT``) do not hold the next one up. A wait for the
        block (another process's server on the same URL) is said whatever the verbosity, and counted as a lease
        wait. A second launch on ports this session's own server still holds is an error at once."""
        base = self.session.launch_options()
        low, high = base.port_range or default_port_range()
        last = port + PORT_BLOCK_SIZE - 1
        starts: list[int] = []
        if port <= high and last >= low:
            first = low + (max(port, low) - low) // PORT_BLOCK_SIZE * PORT_BLOCK_SIZE
            starts = [start for start in range(first, last + 1, PORT_BLOCK_SIZE)
                      if start != port and start + PORT_BLOCK_SIZE - 1 <= high]
        self._check_not_held([(port, last)] + [(start, start + PORT_BLOCK_SIZE - 1) for start in starts],
                             base_url=base_url, where=where)

        def on_wait(text: str) -> None:
            self.session.terminal.message(f"pytest_sglworker.compat: {where}: port {port} of {base_url}: {text}",
                                          always=True)

        guards: list[PortBlock] = []
        try:
            for start in starts:
                guards.append(reserve_port_block(
                    self.session.lock_dir(), size=PORT_BLOCK_SIZE, port_range=(start, start + PORT_BLOCK_SIZE - 1),
                    timeout=base.port_wait_timeout, on_wait=on_wait, reuse_addr=True))
        except BaseException:
            for guard in guards:
                guard.release()
            raise
        startup = float(timeout) if timeout and float(timeout) > 0 else base.startup_timeout
        if startup != base.startup_timeout and startup not in self._timeouts_said:
            self._timeouts_said.add(startup)  # once per value: a suite passes sglang's constant to every launch
            self.session.terminal.message(
                f"pytest_sglworker.compat: {where}: popen_launch_server(timeout={startup:g}) is the startup timeout "
                f"of this server (and of every launch with that timeout), not --sgl-startup-timeout "
                f"({base.startup_timeout:g} s)", always=True)
        return dataclasses.replace(base, port_range=(port, last), port_retries=1, startup_timeout=startup,
                                   reuse_addr=True, on_port_wait=on_wait), guards

    def _check_not_held(self, ranges: Sequence[tuple[int, int]], *, base_url: str, where: str) -> None:
        """Refuse at once a launch on ports a server of this session still holds: its port block would wait for
        this very process until the lease timeout. A server that is gone already (ended by sglang's own
        ``kill_process_tree``) is given back now, a stop, and its ports are free again."""
        def overlaps(launch: _Launch) -> bool:
            held = [(launch.worker.port, launch.worker.port + PORT_BLOCK_SIZE - 1)]
            held += [(guard.ports[0], guard.ports[-1]) for guard in launch.guards if not guard.released]
            return any(lo <= h_hi and hi >= h_lo for lo, hi in ranges for h_lo, h_hi in held)

        for launch in [launch for launch in self.launches.values() if overlaps(launch)]:
            worker = launch.worker
            if worker.stopped or not _settle(worker):
                self._give_back(launch, after=f"a new launch on {base_url}")
                continue
            raise CompatError(
                f"popen_launch_server in {where}: base_url {base_url} is still served by {worker.describe()}, "
                f"which {launch.owner} launched: this test already holds that port, and a second server there "
                "would wait for it until the lease timeout. End the first server before launching again "
                "(kill_process_tree(process.pid)), or give the second one another base_url")

    def _remember_on(self, item: pytest.Item) -> None:
        seen = item.stash.setdefault(WORKERS_KEY, [])
        for launch in self.launches.values():
            if launch.worker not in seen:
                seen.append(launch.worker)

    # -- giving back ----------------------------------------------------------------------------------------
    def _before_teardown(self, fixturedef: Any) -> None:
        """Before the owning fixture's teardown: a server that is gone now died while its tests ran."""
        failure: SglWorkerError | None = None
        for launch in [launch for launch in self.launches.values() if launch.fixturedef is fixturedef]:
            worker = launch.worker
            if worker.stopped or _settle(worker):
                continue
            if launch.cls is not None and getattr(launch.cls, "expect_server_exit", False):
                worker.expect_exit()  # sglang's CustomTestCase: a fault-injection class expects it
                continue
            launch.died = True
            if failure is None and not launch.failed:
                failure = worker.failure(WorkerDied, f"exited while the tests of {launch.owner} ran")
        if failure is not None:
            raise failure

    def _give_back_where(self, which: Callable[[_Launch], bool], *, after: str) -> None:
        for launch in [launch for launch in self.launches.values() if which(launch)]:
            self._give_back(launch, after=after)

    def _give_back(self, launch: _Launch, *, after: str) -> None:
        worker = launch.worker
        self.launches.pop(worker.pid, None)
        if launch.tee_stop is not None:
            launch.tee_stop.set()
        forgotten = _settle(worker)
        if not forgotten and not worker.stopped and not launch.died:
            worker.expect_exit()  # ended by the owner's own teardown (sglang's kill_process_tree): a stop
        use = GroupUse(launch.owner, "failed" if launch.failed or launch.died else "passed", launch.started,
                       time.time(), last_use=True, check_deaths=False)
        try:
            self.session.source.give_back(launch.group, use)
        finally:
            for guard in launch.guards:
                guard.release()
        if forgotten:
            self.session.terminal.message(
                f"pytest_sglworker.compat: {worker.describe()}, launched by {launch.owner}, was still running after "
                f"{after}; stopped it (call kill_process_tree(process.pid) in tearDownClass)")

    def end(self, pid: int, sig: int | None = None) -> bool:
        """End the server whose root is ``pid`` now and give it back (a stop); False when it is not one of ours."""
        launch = self.launches.get(pid)
        if launch is None:
            return False
        worker = launch.worker
        if not worker.stopped and not _settle(worker):
            launch.died = True  # gone before anyone asked: a death, reported as one
        else:
            if sig is not None:
                worker.kill(sig)
            worker.stop()
        self._give_back(launch, after="kill_process_tree")
        return True


def install(session: SglSession) -> CompatRuntime:
    """The session's :class:`CompatRuntime`, registered as a plugin on first call."""
    return session_plugin(session, RUNTIME_NAME, CompatRuntime)


def runtime() -> CompatRuntime | None:
    """The runtime of the pytest session in progress in this process, or None outside one."""
    session = active_session()
    return install(session) if session is not None else None


when_session_starts(install)
