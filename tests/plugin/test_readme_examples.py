"""The README's examples are what the program does: each block marked with an HTML comment is checked here (the
failure text example is checked against its snapshot in tests/acceptance/test_failure_texts.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(marker: str, lang: str) -> str:
    """The fenced block right after the README comment that starts with ``marker``."""
    text = README.read_text()
    found = re.search(r"<!-- " + re.escape(marker) + r".*?-->\n```" + lang + r"\n(.*?)```", text, re.S)
    assert found, f"the README has no {lang} block after '<!-- {marker}'"
    return found.group(1)


def test_the_list_models_example_is_what_it_prints(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--sgl-list-models")
    assert result.ret == 0, result.stdout.str()
    shown = _block("output of: pytest --sgl-list-models", "text").splitlines()
    if "no GPU visible" not in result.stdout.lines[0]:
        pytest.skip("a GPU is visible here: the README shows the registry on a machine without one")
    assert result.stdout.lines == shown


def test_the_outside_pytest_example_runs_on_a_cpu(tmp_path: Path, sim_env: dict[str, str]) -> None:
    script = tmp_path / "script.py"
    script.write_text(_block("run by tests/plugin/test_readme_examples.py", "python"))
    env = {**os.environ, "SGLWORKER_ENGINE": "sim"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "Qwen/Qwen3-0.6B\n"), done.stderr[-3000:]
