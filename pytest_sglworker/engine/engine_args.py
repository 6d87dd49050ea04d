"""Validating worker argv with sglang's own argument parser, in the interpreter that will run the engine.

sglang's truth about which flags exist is its parser: ``argparse.ArgumentParser(prog="sglang serve")``
filled by ``sglang.srt.server_args.ServerArgs.add_cli_args`` (what ``python -m sglang.launch_server`` builds).
Importing it pulls in torch (seconds), so it never happens in the pytest process: one subprocess of the
launcher's python parses every distinct argv of a session, batched as JSON over stdin/stdout, and the
answers are cached on disk.

Cache design: one JSON file per *fingerprint* of the engine install in ``cache_dir``. The fingerprint is
the python path as given (a venv's python is a symlink to the base interpreter, so the realpath alone would
not tell venvs apart), the realpath and its size/mtime, sglang's dist-info name (it carries the version),
and the size/mtime of sglang's ``srt/server_args.py``. For a venv whose site-packages holds sglang (the
usual case, and what ``sglworker install-real-engine`` makes) it is read from the file system next to the
python: a session whose argvs are all cached spawns nothing. Otherwise (sglang on ``PYTHONPATH``, an
editable install, a system python) a cheap probe subprocess locates sglang without importing it. An
upgrade of sglang changes the fingerprint and so starts a fresh cache file.

Plain Python: no pytest, and no sglang in this process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sglang_facts import LAUNCH_MODULES

__all__ = [
    "ParserCheck",
    "SglangCheckResult",
    "check_with_sglang",
    "find_sglang_python",
    "install_fingerprint",
    "python_module",
]

#: Bump when the worker's semantics or the cache layout change: old cache files are then ignored.
CACHE_FORMAT = 1
#: At most this many argvs are kept per cache file (oldest dropped first).
MAX_CACHED_ARGVS = 4096
#: How long the cheap probe (locating sglang without importing it) may take.
PROBE_TIMEOUT = 30.0

_REPLY_MARK = "@@SGLWORKER-ARGCHECK@@ "

# Runs in the engine's python. Finds sglang without importing it (find_spec of a top-level package does not
# execute it), so that "is sglang there, and which one" costs one interpreter start.
_PROBE = r"""
import importlib.metadata, importlib.util, json, os, sys
out = {"executable": sys.executable}
try:
    spec = importlib.util.find_spec("sglang")
except Exception as e:
    spec = None
    out["error"] = f"{type(e).__name__}: {e}"
if spec is None or not spec.submodule_search_locations:
    out.setdefault("error", "ModuleNotFoundError: No module named 'sglang'")
else:
    pkg = list(spec.submodule_search_locations)[0]
    path = os.path.join(pkg, "srt", "server_args.py")
    out["package"] = pkg
    out["server_args"] = path
    try:
        st = os.stat(path)
        out["server_args_stat"] = [st.st_mtime_ns, st.st_size]
    except OSError:
        out["server_args_stat"] = None
    try:
        out["version"] = importlib.metadata.version("sglang")
    except Exception:
        out["version"] = None
print(json.dumps(out))
"""

# Runs in the engine's python: imports sglang's parser once, parses each argv of the request with a fresh
# parser whose error() raises instead of exiting, and answers on the original stdout (everything the import
# prints goes to stderr).
_WORKER = r"""
import argparse, contextlib, io, json, os, sys, traceback
MARK = __MARK__
request = json.loads(sys.stdin.read())
reply_fd = os.dup(1)
os.dup2(2, 1)
sys.stdout = sys.stderr
def reply(obj):
    with os.fdopen(reply_fd, "w", encoding="utf-8") as f:
        f.write(MARK + json.dumps(obj) + "\n")
try:
    from sglang.srt.server_args import ServerArgs
    import sglang
except BaseException as e:
    reply({"loaded": False, "error": f"{type(e).__name__}: {e}",
           "traceback": traceback.format_exc()[-4000:]})
    sys.exit(0)
version = getattr(sglang, "__version__", None)
if version is None:
    try:
        import importlib.metadata
        version = importlib.metadata.version("sglang")
    except Exception:
        version = None

class Rejected(Exception):
    pass

def make_parser():
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    def error(message):
        raise Rejected(f"{parser.prog}: error: {message}")
    parser.error = error
    return parser

results = []
for argv in request["argvs"]:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            make_parser().parse_args(list(argv))
        results.append([True, ""])
    except Rejected as e:
        results.append([False, str(e)])
    except SystemExit as e:
        text = buf.getvalue().strip().splitlines()
        first = text[0] if text else ""
        results.append([False, f"sglang serve would exit (status {e.code}) instead of serving: {first}"[:500]])
    except Exception as e:
        results.append([False, f"sglang serve: error while parsing: {type(e).__name__}: {e}"[:500]])
reply({"loaded": True, "version": version, "server_args": getattr(sys.modules.get("sglang.srt.server_args"),
       "__file__", None), "results": results})
""".replace("__MARK__", repr(_REPLY_MARK))


@dataclass(frozen=True)
class ParserCheck:
    """sglang's parser on one argv: ``ok``, or ``message`` is its own error line, e.g.
    ``sglang serve: error: unrecognized arguments: --bogus``."""

    ok: bool
    message: str = ""


@dataclass
class SglangCheckResult:
    """The answers of sglang's parser for a batch of argvs.

    ``available`` is False when the parser could not be run (``reason`` says why: no such python, no
    sglang, an import error, a crash, a timeout); ``results`` then holds only what came from the cache.
    ``spawned`` counts the subprocesses this check started (0: everything came from the cache).
    """

    python: str
    version: str | None = None
    available: bool = False
    reason: str = ""
    results: dict[tuple[str, ...], ParserCheck] = field(default_factory=dict)
    spawned: int = 0
    cache_path: Path | None = None

    def rejected(self) -> dict[tuple[str, ...], ParserCheck]:
        """The argvs that sglang's parser rejected."""
        return {argv: check for argv, check in self.results.items() if not check.ok}


_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?")
# Interpreter options that take a separate value (``python -X importtime -m ...``).
_PYTHON_OPTS_WITH_VALUE = frozenset({"-X", "-W", "-Q"})


def python_module(argv: Sequence[str]) -> str | None:
    """The module that ``argv`` runs when it is ``[PY, ..., "-m", MODULE, ...]``, else None.

    PY is a ``python``, ``python3`` or ``python3.11`` (a path or a bare name); interpreter options may stand
    before ``-m`` (``-u``, ``-X importtime``), and ``-mMODULE`` is one argument. A script (or ``-``) before
    any ``-m`` means no module is run.
    """
    if not argv or not _PYTHON_NAME.fullmatch(os.path.basename(argv[0])):
        return None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        if not arg.startswith("-") or arg == "-":
            return None
        i += 2 if arg in _PYTHON_OPTS_WITH_VALUE else 1
    return None


def find_sglang_python(launcher: Sequence[str]) -> str | None:
    """The python that runs sglang for a launcher argv, or None if the launcher is not sglang's.

    Understands ``[PY, "-m", "sglang.launch_server"]`` (see :func:`python_module`: PY a ``python``,
    ``python3`` or ``python3.11``, possibly with interpreter options before ``-m``) and
    ``[.../bin/sglang, "serve"]`` (the venv's python beside the script).
    """
    if not launcher:
        return None
    exe = launcher[0]
    name = os.path.basename(exe)
    if _PYTHON_NAME.fullmatch(name):
        return exe if python_module(launcher) in LAUNCH_MODULES else None
    if name == "sglang" and len(launcher) > 1 and launcher[1] == "serve":
        folder = os.path.dirname(exe)
        if not folder:
            found = shutil.which(exe)
            folder = os.path.dirname(found) if found else ""
        for candidate in ("python", "python3"):
            path = os.path.join(folder, candidate)
            if folder and os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    return None


def _effective_env(env: Mapping[str, str] | None) -> dict[str, str]:
    full = dict(os.environ)
    if env:
        full.update(env)
    return full


def _resolve_python(python: str, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The absolute path of ``python`` (symlinks kept), or None and why."""
    if os.sep in python:
        path = os.path.abspath(python)
    else:
        found = shutil.which(python, path=environ.get("PATH"))
        if found is None:
            return None, f"python {python!r} is not on PATH"
        path = os.path.abspath(found)
    if not os.path.isfile(path):
        return None, f"python {path} does not exist"
    if not os.access(path, os.X_OK):
        return None, f"python {path} is not executable"
    return path, ""


def _stat(path: str | Path) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def install_fingerprint(python: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The cache fingerprint of the sglang that ``python`` imports, read from the file system alone, or
    None when that cannot be told without running ``python`` (no venv layout, sglang not in the venv's
    site-packages, or a ``PYTHONPATH`` entry that may shadow it)."""
    environ = _effective_env(env)
    path, _ = _resolve_python(python, environ)
    if path is None:
        return None
    prefix = Path(path).parent.parent
    if not (prefix / "pyvenv.cfg").is_file():
        return None
    for entry in environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and (Path(entry) / "sglang").exists():
            return None
    sites = sorted(prefix.glob("lib/python3*/site-packages"))
    if len(sites) != 1:
        return None
    site = sites[0]
    dist_infos = sorted(site.glob("sglang-*.dist-info"))
    server_args = site / "sglang" / "srt" / "server_args.py"
    if len(dist_infos) != 1 or not server_args.is_file():
        return None
    dist = dist_infos[0]
    version = dist.name[len("sglang-") : -len(".dist-info")]
    return {
        "format": CACHE_FORMAT,
        "python": path,
        "python_real": os.path.realpath(path),
        "python_stat": _stat(os.path.realpath(path)),
        "sglang": version,
        "dist_info": _stat(dist),
        "server_args": str(server_args),
        "server_args_stat": _stat(server_args),
    }


def _fingerprint_from_probe(path: str, probe: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "python": path,
        "python_real": os.path.realpath(path),
        "python_stat": _stat(os.path.realpath(path)),
        "sglang": probe.get("version"),
        "server_args": probe.get("server_args"),
        "server_args_stat": probe.get("server_args_stat"),
    }


def _run(argv: list[str], stdin: str, environ: Mapping[str, str], timeout: float) -> tuple[int | None, str, str]:
    """Run ``argv`` (no shell) in its own session; on timeout kill its whole group. Returns (exit code or
    None on timeout, stdout, stderr)."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(environ),
        text=True,
        encoding="utf-8",
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        return None, out or "", err or ""
    return proc.returncode, out, err


def _tail(text: str, lines: int = 8) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept)


def _cache_file(cache_dir: Path, fingerprint: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir / f"sglang-args-{digest}.json"


def _argv_key(argv: Sequence[str]) -> str:
    return json.dumps(list(argv))


def _load_cache(path: Path, fingerprint: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("fingerprint") != json.loads(json.dumps(fingerprint)):
        return None
    if not isinstance(data.get("results"), dict):
        return None
    return data


def _save_cache(
    path: Path, fingerprint: Mapping[str, Any], version: str | None, new: Mapping[str, ParserCheck]
) -> None:
    """Merge ``new`` into the cache file (re-read first: other processes may have written) atomically."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        old = _load_cache(path, fingerprint)
        results: dict[str, Any] = dict(old["results"]) if old else {}
        for key, check in new.items():
            results.pop(key, None)
            results[key] = {"ok": check.ok, "message": check.message}
        if len(results) > MAX_CACHED_ARGVS:
            results = dict(list(results.items())[-MAX_CACHED_ARGVS:])
        data = {"fingerprint": fingerprint, "version": version, "results": results}
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a cache that cannot be written only costs a subprocess next time


def check_with_sglang(
    python: str,
    argvs: Sequence[Sequence[str]],
    *,
    cache_dir: Path | None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> SglangCheckResult:
    """Parse each argv (the sglang part: everything after the launcher, ``--model-path`` included) with
    sglang's own parser, in ``python``.

    ``env`` is added to ``os.environ`` for the subprocesses (as for the worker itself). At most one
    subprocess parses all the argvs that the cache in ``cache_dir`` (None: no cache) does not answer; a
    cheap probe precedes it only when the install cannot be fingerprinted from the file system. Never
    raises for a broken engine and never hangs: ``available`` is False with a ``reason`` instead.
    """
    distinct = list(dict.fromkeys(tuple(str(a) for a in argv) for argv in argvs))
    environ = _effective_env(env)
    path, why = _resolve_python(python, environ)
    result = SglangCheckResult(python=python)
    if path is None:
        result.reason = why
        return result
    result.python = path

    fingerprint = install_fingerprint(path, env)
    if fingerprint is None:
        result.spawned += 1
        try:
            code, out, err = _run([path, "-c", _PROBE], "", environ, min(timeout, PROBE_TIMEOUT))
        except OSError as e:
            result.reason = f"{path} could not be run ({type(e).__name__}: {e})"
            return result
        if code is None:
            result.reason = f"{path} did not answer a trivial probe within {min(timeout, PROBE_TIMEOUT):g} s"
            return result
        try:
            probe = json.loads(out.strip().splitlines()[-1])
            if not isinstance(probe, dict):
                raise ValueError(probe)
        except (ValueError, IndexError):
            result.reason = f"{path} failed to run a probe (exit code {code}): {_tail(err or out) or 'no output'}"
            return result
        if "error" in probe:
            result.reason = f"sglang is not importable by {path} ({probe['error']})"
            return result
        fingerprint = _fingerprint_from_probe(path, probe)
    result.version = fingerprint.get("sglang")

    cache_path = _cache_file(cache_dir, fingerprint) if cache_dir is not None else None
    result.cache_path = cache_path
    if not _fill_from_cache(result, cache_path, fingerprint, distinct):
        result.available = True
        return result
    with _cache_lock(cache_path, timeout):
        # Another process (an xdist worker) may have parsed them while this one waited for the lock.
        missing = _fill_from_cache(result, cache_path, fingerprint, distinct)
        if not missing:
            result.available = True
            result.results = {argv: result.results[argv] for argv in distinct}
            return result
        _parse_in_subprocess(result, path, environ, missing, timeout)
        result.results = {argv: result.results[argv] for argv in distinct if argv in result.results}
        if result.available and cache_path is not None:
            _save_cache(cache_path, fingerprint, result.version, {_argv_key(a): result.results[a] for a in missing})
    return result


def _fill_from_cache(
    result: SglangCheckResult,
    cache_path: Path | None,
    fingerprint: Mapping[str, Any],
    distinct: Sequence[tuple[str, ...]],
) -> list[tuple[str, ...]]:
    """Put the cached answers into ``result``; return the argvs the cache does not answer."""
    cached = _load_cache(cache_path, fingerprint) if cache_path is not None else None
    missing: list[tuple[str, ...]] = []
    for argv in distinct:
        entry = cached["results"].get(_argv_key(argv)) if cached else None
        if isinstance(entry, dict) and isinstance(entry.get("ok"), bool):
            result.results[argv] = ParserCheck(entry["ok"], str(entry.get("message", "")))
        else:
            missing.append(argv)
    return missing


@contextlib.contextmanager
def _cache_lock(cache_path: Path | None, timeout: float) -> Iterator[None]:
    """Serialize the parser subprocess between processes that share the cache (xdist workers): one parses,
    the others then read its answers. Without a cache, or when the lock cannot be had, run unlocked."""
    if cache_path is None:
        yield
        return
    import filelock

    lock = filelock.FileLock(str(cache_path) + ".lock", timeout=timeout + PROBE_TIMEOUT)
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except (filelock.Timeout, OSError):
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _parse_in_subprocess(
    result: SglangCheckResult,
    path: str,
    environ: Mapping[str, str],
    missing: Sequence[tuple[str, ...]],
    timeout: float,
) -> None:
    """Parse ``missing`` in one subprocess of ``path``; fill ``result`` (``available`` stays False with a
    ``reason`` when the parser could not run)."""
    result.spawned += 1
    request = json.dumps({"argvs": [list(a) for a in missing]})
    try:
        code, out, err = _run([path, "-c", _WORKER], request, environ, timeout)
    except OSError as e:
        result.reason = f"{path} could not be run ({type(e).__name__}: {e})"
        return
    if code is None:
        result.reason = f"sglang's parser did not answer within {timeout:g} s (python {path})"
        return
    reply: dict[str, Any] | None = None
    for line in reversed(out.splitlines()):
        if line.startswith(_REPLY_MARK):
            try:
                parsed = json.loads(line[len(_REPLY_MARK) :])
            except ValueError:
                break
            reply = parsed if isinstance(parsed, dict) else None
            break
    if reply is None:
        detail = _tail(err) or "no output"
        result.reason = f"sglang's parser crashed in {path} (exit code {code}): {detail}"
        return
    if not reply.get("loaded"):
        result.reason = f"sglang's parser could not be loaded by {path} ({reply.get('error')})"
        return
    answers = reply.get("results")
    if not isinstance(answers, list) or len(answers) != len(missing):
        result.reason = f"sglang's parser in {path} gave a malformed answer"
        return
    for argv, (ok, message) in zip(missing, answers, strict=True):
        result.results[argv] = ParserCheck(bool(ok), str(message))
    if reply.get("version"):
        result.version = str(reply["version"])
    result.available = True


# pragma: no cover - a manual check: python -m pytest_sglworker.engine.engine_args PY ARGS...
if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m pytest_sglworker.engine.engine_args PYTHON [SGLANG ARGS...]", file=sys.stderr)
        sys.exit(2)
    res = check_with_sglang(sys.argv[1], [sys.argv[2:]], cache_dir=None)
    if not res.available:
        print(f"unavailable: {res.reason}", file=sys.stderr)
        sys.exit(2)
    for _argv, chk in res.results.items():
        print("ok" if chk.ok else chk.message)
    sys.exit(0 if all(c.ok for c in res.results.values()) else 1)
