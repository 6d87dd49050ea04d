"""The docs' options table (docs/reference/options.md, generated from plugin/options.py by
scripts/gen_reference.py; tests/plugin/test_docs.py keeps it equal to the code) is the users' contract (their CI
configs name these flags, variables and ini keys): every row is read from the page itself and resolved in a real
session, once from the command line, once from the environment, once from an ini file. A name the help text
announces that the session does not read fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

OPTIONS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "options.md"

#: a valid value for each documented option, and the resolved setting it must give (None: checked by source)
VALUES: dict[str, tuple[str, str, object]] = {
    "--sgl-model": ("qwen3-0.6b,llama-1b", "models", ["qwen3-0.6b", "llama-1b"]),
    "--sgl-engine": ("sim", "engine", "sim"),
    "--sgl-launcher": ("/usr/bin/env python3 -m my.engine", "launcher", ["/usr/bin/env", "python3", "-m", "my.engine"]),
    "--sgl-log-dir": ("{tmp}/logs", "log_dir", "{tmp}/logs"),
    "--sgl-lock-dir": ("{tmp}/locks", "lock_dir", "{tmp}/locks"),
    "--sgl-startup-timeout": ("123", "startup_timeout", 123.0),
    "--sgl-lease-timeout": ("45", "lease_timeout", 45.0),
    "--sgl-gpus": ("sim:3x24", "gpus", "sim:3x24"),
    "--sgl-port-range": ("21000-21999", "port_range", [21000, 21999]),
    "--sgl-keep-logs": ("on", "keep_logs", True),
    "--sgl-reuse": ("off", "reuse", False),
    "--sgl-reorder": ("off", "reorder", False),
    "--sgl-report": ("{tmp}/report.json", "report", "{tmp}/report.json"),
    "--sgl-tail-lines": ("7", "tail_lines", 7),
    "--sgl-card": ("H200", "card", "H200"),
    "--sgl-timeline": ("{tmp}/timeline.html", "timeline", "{tmp}/timeline.html"),
    "--sgl-trace": ("{tmp}/trace.json", "trace", "{tmp}/trace.json"),
    "--sgl-router-launcher": ("/usr/bin/env router", "router_launcher", ["/usr/bin/env", "router"]),
    "--sgl-log-retention-count": ("5", "log_retention_count", 5),
    "--sgl-log-retention-policy": ("failed", "log_retention_policy", "failed"),
    "--sgl-launch-ahead": ("2", "launch_ahead", 2),
    "--sgl-dist": ("on,steal=8", "dist", ["on", 8]),
    "--sgl-worker-url": ("qwen3-0.6b=http://127.0.0.1:1", "worker_urls",
                         {"qwen3-0.6b": ["qwen3-0.6b=http://127.0.0.1:1"]}),
    "--sgl-shard": ("1/2", "shard", "1/2"),
    "--sgl-shard-report": ("{tmp}/shard-report.json", "shard_report", ["{tmp}/shard-report.json"]),
    # "off" (no cluster): a Ray cluster would exclude --sgl-gpus above, and collection would join it
    "--sgl-cluster": ("off", "cluster", None),
    # "off": keeping warm would exclude --sgl-worker-url above (tested on its own in tests/acceptance/test_warm.py)
    "--sgl-keep-warm": ("off", "keep_warm", None),
}

DUMP = """
import json, os, pathlib
import pytest

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    from pytest_sglworker.plugin.session import STATE_KEY

    settings = config.stash[STATE_KEY].settings
    out = {k: (str(v) if isinstance(v, pathlib.Path) else list(v) if isinstance(v, tuple) else v)
           for k, v in vars(settings).items() if k != "sources"}
    out["sources"] = dict(settings.sources)
    pathlib.Path(os.environ["SETTINGS_DUMP"]).write_text(json.dumps(out, default=str))
"""


def documented_rows() -> list[tuple[str, str, str]]:
    """``(flag, env, ini)`` of every row of the options table that has all three."""
    section = OPTIONS_PAGE.read_text()
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # "real\|sim" is one cell
        if len(cells) < 3 or not cells[0].startswith("`--sgl-"):
            continue
        flag = re.match(r"`(--sgl-[a-z-]+)", cells[0]).group(1)  # type: ignore[union-attr]
        env, ini = cells[1].strip("`"), cells[2].strip("`")
        if env and ini:
            rows.append((flag, env, ini))
    return rows


def test_the_table_documents_every_option_and_nothing_else() -> None:
    from pytest_sglworker.plugin.options import OPTIONS

    documented = {flag for flag, _, _ in documented_rows()}
    assert documented == {f"--sgl-{opt.name}" for opt in OPTIONS} | {"--sgl-model", "--sgl-worker-url"}
    assert documented == set(VALUES), "give every documented option a value here"


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_every_documented_name_resolves(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path, source: str) -> None:
    pytester.makeconftest(DUMP)
    dump = tmp_path / "settings.json"
    monkeypatch.setenv("SETTINGS_DUMP", str(dump))
    rows = documented_rows()
    args: list[str] = []
    ini: list[str] = []
    for flag, env, ini_key in rows:
        value = VALUES[flag][0].format(tmp=tmp_path)
        monkeypatch.delenv(env, raising=False)
        if source == "cli":
            args += [flag] if flag == "--sgl-keep-logs" else [flag, value]
        elif source == "env":
            monkeypatch.setenv(env, value)
        else:
            ini.append(f"{ini_key} = {value}")
    if ini:
        pytester.makeini("[pytest]\n" + "\n".join(ini) + "\n")
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest(*args, "--collect-only", "-q")
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    settings = json.loads(dump.read_text())
    for flag, env, ini_key in rows:
        _, attr, expected = VALUES[flag]
        if isinstance(expected, str):
            expected = expected.format(tmp=tmp_path)
        elif isinstance(expected, list):
            expected = [e.format(tmp=tmp_path) if isinstance(e, str) else e for e in expected]
        assert settings[attr] == expected, (flag, source, settings[attr])
        name = flag[len("--sgl-"):]
        want = {"cli": flag, "env": env, "ini": f"ini {ini_key}"}[source]
        assert settings["sources"][name if name != "model" else "model"] == want, (flag, settings["sources"])
