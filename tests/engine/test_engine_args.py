"""engine_args: argv checked by sglang's own parser in a subprocess of the engine's python, cached.

Most tests use a fake ``sglang`` package (``sglang.srt.server_args.ServerArgs.add_cli_args``) in a throwaway
venv or on PYTHONPATH, so the logic is tested everywhere; the ``real_engine`` tests run the real parser of
the installed CPU engine (``sglworker install-real-engine``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pytest_sglworker.engine.budget import check_argv
from pytest_sglworker.engine.cpu_engine import (
    CPU_ENGINE_ARGS,
    cpu_engine_spec,
    real_engine_launcher,
    real_engine_missing_reason,
    real_engine_python,
)
from pytest_sglworker.engine.engine_args import (
    ParserCheck,
    check_with_sglang,
    find_sglang_python,
    install_fingerprint,
    python_module,
)
from pytest_sglworker.engine.specs import BUILTIN_SPECS, CI_WORKER_ARGS

FAKE_SERVER_ARGS = """
import argparse
import os
import sys

_mode = os.environ.get("FAKE_SGLANG_MODE", "")
if _mode == "print":
    print("noise on stdout while importing")
elif _mode == "import-error":
    raise ModuleNotFoundError("No module named 'torch'")
elif _mode == "crash":
    sys.stderr.write("fatal: the fake engine crashed\\n")
    sys.stderr.flush()
    os._exit(3)
elif _mode == "hang":
    import time
    time.sleep(60)


class ServerArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        log = os.environ.get("FAKE_SGLANG_LOG")
        if log:
            with open(log, "a") as f:
                f.write("parser\\n")
        parser.add_argument("--model-path", "--model", required=True)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=30000)
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
        parser.add_argument("--mem-fraction-static", type=float)
        parser.add_argument("--max-total-tokens", type=int)
        parser.add_argument("--device", default="cuda")
        parser.add_argument("--attention-backend")
        parser.add_argument("--sampling-backend")
        parser.add_argument("--sleep-on-idle", action="store_true")
        for kind in ("decode", "prefill"):
            parser.add_argument(f"--cuda-graph-backend-{kind}", choices=["full", "breakable", "disabled"])
"""


def _write_fake_sglang(site: Path, version: str | None = None) -> Path:
    pkg = site / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version or '0.0.fake'!r}\n")
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "server_args.py").write_text(FAKE_SERVER_ARGS)
    if version is not None:
        dist = site / f"sglang-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return pkg / "srt" / "server_args.py"


@pytest.fixture(scope="module")
def fake_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (pip-less) venv whose site-packages holds a fake sglang 9.9.9: fingerprinted statically."""
    root = tmp_path_factory.mktemp("fakevenv") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    (site,) = root.glob("lib/python3*/site-packages")
    _write_fake_sglang(site, "9.9.9")
    return root / "bin" / "python"


@pytest.fixture
def fake_pythonpath(tmp_path: Path) -> Path:
    """A folder with a fake sglang (no dist-info) to put on PYTHONPATH: fingerprinted by the probe."""
    folder = tmp_path / "fakepath"
    _write_fake_sglang(folder)
    return folder


GOOD = ("--model-path", "m", "--host", "127.0.0.1", "--port", "30000", "--tp-size", "1", *CI_WORKER_ARGS)
MISSPELT = ("--model-path", "m", "--mem-fraction-statc=0.5")
BAD_CHOICE = ("--model-path", "m", "--cuda-graph-backend-prefill", "bogus")


def test_fake_parser_answers_like_sglang(fake_venv: Path, tmp_path: Path) -> None:
    bogus = ("--model-path", "m", "--bogus")
    res = check_with_sglang(str(fake_venv), [GOOD, bogus, BAD_CHOICE, ("--mem-frac", "0.5")], cache_dir=tmp_path)
    assert res.available, res.reason
    assert res.version == "9.9.9"
    assert res.results[GOOD] == ParserCheck(True, "")
    assert res.results[bogus] == ParserCheck(False, "sglang serve: error: unrecognized arguments: --bogus")
    assert res.results[BAD_CHOICE].message == (
        "sglang serve: error: argument --cuda-graph-backend-prefill: invalid choice: 'bogus' "
        "(choose from 'full', 'breakable', 'disabled')"
    )
    assert "required: --model-path" in res.results[("--mem-frac", "0.5")].message
    assert set(res.rejected()) == {bogus, BAD_CHOICE, ("--mem-frac", "0.5")}


def test_second_call_spawns_nothing(fake_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argvs = [GOOD, MISSPELT, GOOD]  # duplicates are parsed once
    first = check_with_sglang(str(fake_venv), argvs, cache_dir=tmp_path)
    assert first.available and first.spawned == 1  # the worker only: the venv is fingerprinted statically
    assert list(first.results) == [GOOD, MISSPELT]
    assert first.cache_path is not None and first.cache_path.is_file()

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a subprocess was started although every argv is cached")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    second = check_with_sglang(str(fake_venv), list(reversed(argvs)), cache_dir=tmp_path)
    assert second.spawned == 0
    assert second.available and second.version == "9.9.9"
    assert second.results == first.results


def test_only_missing_argvs_are_parsed(fake_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "parsed.log"
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))
    check_with_sglang(str(fake_venv), [GOOD], cache_dir=tmp_path / "cache")
    assert log.read_text().count("parser") == 1
    res = check_with_sglang(str(fake_venv), [GOOD, BAD_CHOICE], cache_dir=tmp_path / "cache")
    assert res.spawned == 1 and res.available
    assert log.read_text().count("parser") == 2  # GOOD came from the cache
    assert list(res.results) == [GOOD, BAD_CHOICE]
    cached = json.loads(res.cache_path.read_text()) if res.cache_path else {}
    assert len(cached["results"]) == 2


def test_concurrent_checks_share_one_parser(fake_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # xdist workers collecting at the same time: one parses, the others wait for its answers
    log = tmp_path / "parsed.log"
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))
    argvs = [GOOD, MISSPELT, BAD_CHOICE]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: check_with_sglang(str(fake_venv), argvs, cache_dir=tmp_path), range(3)))
    assert sum(r.spawned for r in results) == 1
    assert log.read_text().count("parser") == len(argvs)
    assert all(r.available and list(r.results) == argvs for r in results)
    assert results[0].results == results[1].results == results[2].results


def test_engine_change_invalidates_the_cache(fake_venv: Path, tmp_path: Path) -> None:
    first = check_with_sglang(str(fake_venv), [GOOD], cache_dir=tmp_path)
    (site,) = fake_venv.parent.parent.glob("lib/python3*/site-packages")
    server_args = site / "sglang" / "srt" / "server_args.py"
    before = install_fingerprint(str(fake_venv))
    original = server_args.read_text()
    try:
        server_args.write_text(original + "\n# changed\n")
        assert install_fingerprint(str(fake_venv)) != before
        second = check_with_sglang(str(fake_venv), [GOOD], cache_dir=tmp_path)
        assert second.spawned == 1 and second.available
        assert second.cache_path != first.cache_path
    finally:
        server_args.write_text(original)


def test_no_cache_dir_and_corrupt_cache(fake_venv: Path, tmp_path: Path) -> None:
    res = check_with_sglang(str(fake_venv), [GOOD], cache_dir=None)
    assert res.available and res.cache_path is None and res.spawned == 1
    first = check_with_sglang(str(fake_venv), [GOOD], cache_dir=tmp_path)
    assert first.cache_path is not None
    first.cache_path.write_text("{not json")
    again = check_with_sglang(str(fake_venv), [GOOD], cache_dir=tmp_path)
    assert again.available and again.spawned == 1 and again.results[GOOD].ok
    json.loads(first.cache_path.read_text())  # rewritten whole


def test_sglang_on_pythonpath_is_probed(fake_pythonpath: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(fake_pythonpath)}
    assert install_fingerprint(sys.executable, env) is None  # a PYTHONPATH sglang may shadow the venv's
    first = check_with_sglang(sys.executable, [GOOD, MISSPELT], cache_dir=tmp_path, env=env)
    assert first.available, first.reason
    assert first.spawned == 2  # the cheap probe, then the parser
    assert first.results[MISSPELT].message == ("sglang serve: error: unrecognized arguments: --mem-fraction-statc=0.5")
    second = check_with_sglang(sys.executable, [GOOD, MISSPELT], cache_dir=tmp_path, env=env)
    assert second.spawned == 1  # the probe only
    assert second.results == first.results


def test_stdout_noise_while_importing_is_tolerated(fake_pythonpath: Path) -> None:
    env = {"PYTHONPATH": str(fake_pythonpath), "FAKE_SGLANG_MODE": "print"}
    res = check_with_sglang(sys.executable, [GOOD], cache_dir=None, env=env)
    assert res.available, res.reason
    assert res.results[GOOD].ok


def test_missing_python_is_unavailable(tmp_path: Path) -> None:
    res = check_with_sglang(str(tmp_path / "nope" / "python"), [GOOD], cache_dir=tmp_path)
    assert not res.available and res.spawned == 0
    assert res.reason == f"python {tmp_path / 'nope' / 'python'} does not exist"
    res = check_with_sglang("no-such-python-3.99", [GOOD], cache_dir=tmp_path)
    assert not res.available and "not on PATH" in res.reason
    assert not res.results


def test_python_without_sglang_is_unavailable(tmp_path: Path) -> None:
    env = {"PYTHONPATH": ""}
    res = check_with_sglang(sys.executable, [GOOD], cache_dir=tmp_path, env=env)
    assert not res.available
    assert res.reason == (
        f"sglang is not importable by {sys.executable} (ModuleNotFoundError: No module named 'sglang')"
    )
    assert not list(tmp_path.iterdir())  # nothing cached for an unavailable engine


def test_import_error_is_unavailable_with_reason(fake_pythonpath: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(fake_pythonpath), "FAKE_SGLANG_MODE": "import-error"}
    res = check_with_sglang(sys.executable, [GOOD], cache_dir=tmp_path, env=env)
    assert not res.available
    assert "could not be loaded" in res.reason and "No module named 'torch'" in res.reason


def test_crash_is_unavailable_with_reason(fake_pythonpath: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(fake_pythonpath), "FAKE_SGLANG_MODE": "crash"}
    res = check_with_sglang(sys.executable, [GOOD], cache_dir=tmp_path, env=env)
    assert not res.available
    assert "crashed" in res.reason and "exit code 3" in res.reason
    assert "fatal: the fake engine crashed" in res.reason


def test_hang_times_out(fake_pythonpath: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(fake_pythonpath), "FAKE_SGLANG_MODE": "hang"}
    res = check_with_sglang(sys.executable, [GOOD], cache_dir=tmp_path, env=env, timeout=2)
    assert not res.available  # the reason names the 2 s timeout: the check gave up, the fake engine hangs for ever
    assert "did not answer within 2 s" in res.reason


def test_not_a_python_is_unavailable(tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'not really python' >&2\nexit 7\n")
    fake.chmod(0o755)
    res = check_with_sglang(str(fake), [GOOD], cache_dir=tmp_path)
    assert not res.available
    assert "exit code 7" in res.reason and "not really python" in res.reason


@pytest.mark.parametrize(
    ("launcher", "expected"),
    [
        (["/v/bin/python", "-m", "sglang.launch_server"], "/v/bin/python"),
        (["/v/bin/python3.11", "-m", "sglang.launch_server"], "/v/bin/python3.11"),
        (["python3", "-u", "-X", "importtime", "-m", "sglang.launch_server"], "python3"),
        (["/v/bin/python", "-msglang.launch_server"], "/v/bin/python"),
        (["/v/bin/python", "-m", "pytest_sglworker.sim"], None),
        (["/v/bin/python", "script.py"], None),
        (["/v/bin/python"], None),
        (["/usr/bin/env", "python", "-m", "sglang.launch_server"], None),
        ([], None),
    ],
)
def test_find_sglang_python(launcher: list[str], expected: str | None) -> None:
    assert find_sglang_python(launcher) == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/v/bin/python", "-m", "mod"], "mod"),
        (["python3", "-mmod.sub", "--port", "1"], "mod.sub"),
        (["/v/bin/python3.11", "-u", "-X", "importtime", "-W", "ignore", "-m", "mod", "-m", "other"], "mod"),
        (["python", "-Xdev", "-B", "-mmod"], "mod"),
        (["python", "script.py", "-m", "mod"], None),  # -m after the script is the script's
        (["python", "-", "-m", "mod"], None),
        (["python", "-u", "-m"], None),
        (["python", "-u"], None),
        (["/v/bin/pythonw", "-m", "mod"], None),
        (["/usr/bin/env", "python", "-m", "mod"], None),
        ([], None),
    ],
)
def test_python_module(argv: list[str], expected: str | None) -> None:
    assert python_module(argv) == expected


def test_the_launcher_check_reads_the_module_the_same_way() -> None:
    """check_launcher finds the module with python_module: ``-mMOD`` and interpreter options included, and
    a ``-m`` that belongs to a script is not the launcher's."""
    from pytest_sglworker.workers.errors import LaunchError
    from pytest_sglworker.workers.launcher import check_launcher

    missing = "no_such_module_for_sglworker"
    for launcher in ([sys.executable, "-m", missing], [sys.executable, f"-m{missing}.x"],
                     [sys.executable, "-u", "-X", "importtime", "-m", missing]):
        with pytest.raises(LaunchError, match=f"cannot import '{missing}'"):
            check_launcher(launcher)
    check_launcher([sys.executable, "script.py", "-m", missing])


def test_find_sglang_python_for_the_sglang_script(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sglang").write_text("#!/bin/sh\n")
    assert find_sglang_python([str(bin_dir / "sglang"), "serve"]) is None  # no python beside it
    py = bin_dir / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    assert find_sglang_python([str(bin_dir / "sglang"), "serve"]) == str(py)
    assert find_sglang_python([str(bin_dir / "sglang"), "version"]) is None


def test_find_sglang_python_of_the_cpu_launcher() -> None:
    assert find_sglang_python(real_engine_launcher("/x/bin/python")) == "/x/bin/python"


# --- the real parser of the installed CPU engine --------------------------------------------------------


@pytest.fixture(scope="module")
def real_python() -> str:
    python = real_engine_python()
    if python is None:
        pytest.skip(f"real-engine tests need the real sglang: {real_engine_missing_reason()}")
    return str(python)


def _serve_argv(model: str, worker_args: tuple[str, ...]) -> tuple[str, ...]:
    return ("--model-path", model, "--host", "127.0.0.1", "--port", "30000", "--tp-size", "1", *worker_args)


@pytest.mark.real_engine
def test_real_parser_accepts_every_builtin_spec_and_rejects_mistakes(real_python: str, tmp_path: Path) -> None:
    from pytest_sglworker.workers.launcher import build_argv

    cpu = cpu_engine_spec("cpu-tiny", "/models/tiny", extra_args=("--skip-server-warmup",))
    # exactly the argv the plugin builds (without the launcher), --nccl-port included
    good = {spec.name: tuple(build_argv(spec, port=30000, nccl_port=30001, launcher=()))
            for spec in (*BUILTIN_SPECS, cpu)}
    for spec in (*BUILTIN_SPECS, cpu):
        assert not check_argv(spec.worker_args), spec.name
    misspelt = _serve_argv("/models/tiny", (*CI_WORKER_ARGS, "--max-total-tokenz", "1024"))
    bad_choice = _serve_argv("/models/tiny", ("--mem-fraction-static=0.6", "--cuda-graph-backend-prefill=bogus"))
    # budget.py assumes these are the shortest unambiguous prefixes of the budget flags in sglang 0.5.23
    abbrev_ok = ("--model-path", "m", "--mem", "0.5", "--cuda-graph-backend-p", "disabled")
    ambiguous = ("--model-path", "m", "--me", "0.5")
    ambiguous_prefill = ("--model-path", "m", "--cuda-graph-backend-", "disabled")
    argvs = [*good.values(), misspelt, bad_choice, abbrev_ok, ambiguous, ambiguous_prefill]

    res = check_with_sglang(real_python, argvs, cache_dir=tmp_path, env=dict(cpu.env), timeout=300)
    assert res.available, res.reason
    assert res.version is not None
    for name, argv in good.items():
        assert res.results[argv].ok, f"spec {name}: {res.results[argv].message}"
    assert res.results[misspelt] == ParserCheck(
        False, "sglang serve: error: unrecognized arguments: --max-total-tokenz 1024"
    )
    assert res.results[bad_choice] == ParserCheck(
        False,
        "sglang serve: error: argument --cuda-graph-backend-prefill: invalid choice: 'bogus' "
        "(choose from 'full', 'breakable', 'disabled')",
    )
    assert res.results[abbrev_ok].ok, res.results[abbrev_ok].message
    assert "ambiguous option: --me " in res.results[ambiguous].message
    assert "ambiguous option: --cuda-graph-backend- " in res.results[ambiguous_prefill].message

    again = check_with_sglang(real_python, argvs, cache_dir=tmp_path, env=dict(cpu.env))
    assert again.spawned == 0 and again.results == res.results


@pytest.mark.real_engine
def test_real_install_is_fingerprinted_without_a_subprocess(real_python: str) -> None:
    fingerprint = install_fingerprint(real_python, {"PYTHONPATH": ""})
    assert fingerprint is not None, "the installed venv's sglang should be found next to its python"
    assert fingerprint["python"] == os.path.abspath(real_python)
    assert Path(fingerprint["server_args"]).is_file()


def test_cpu_recipe_args_are_in_the_fake_parser_too(fake_venv: Path, tmp_path: Path) -> None:
    # keeps the fake honest about the flags the CPU recipe passes
    argv = _serve_argv("m", (*CI_WORKER_ARGS, *CPU_ENGINE_ARGS))
    res = check_with_sglang(str(fake_venv), [argv], cache_dir=tmp_path)
    assert res.results[argv].ok, res.results[argv].message


def test_engine_args_module_does_not_import_sglang() -> None:
    code = textwrap.dedent(
        """
        import sys
        import pytest_sglworker.engine.engine_args
        assert "sglang" not in sys.modules and "torch" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
