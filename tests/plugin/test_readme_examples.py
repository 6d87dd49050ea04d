"""The examples of the README and of the docs site (docs/) are what the program does: each block marked with an
HTML comment is checked here, wherever it lives (the README's failure text example is checked against its snapshot
in tests/acceptance/test_failure_texts.py):

- ``<!-- output of: pytest --sgl-list-models ... -->``: the command's output, line for line;
- ``<!-- run by tests/plugin/test_readme_examples.py with SGLWORKER_ENGINE=sim -->``: a script, run on the sim;
- ``<!-- test file, run by tests/plugin/test_readme_examples.py with: ARGS -->``: a test file, run by pytest with
  ARGS in a fresh directory, every test of it passing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]


def _blocks(marker: str, lang: str) -> list[tuple[Path, str, str]]:
    """``(page, the rest of the comment, block)`` of every fenced block right after a comment starting with
    ``marker``, in the README and the docs pages."""
    pattern = re.compile(r"<!-- " + re.escape(marker) + r"(.*?)-->\n```" + lang + r"\n(.*?)```", re.S)
    return [(page, m.group(1), m.group(2)) for page in PAGES for m in pattern.finditer(page.read_text())]


def _block(marker: str, lang: str) -> str:
    """The one fenced block right after the comment that starts with ``marker``."""
    found = _blocks(marker, lang)
    assert len(found) == 1, f"{len(found)} {lang} blocks after '<!-- {marker}' in the README and docs/: {found}"
    return found[0][2]


TEST_FILES = _blocks("test file, run by tests/plugin/test_readme_examples.py with:", "python")


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


def test_the_docs_have_test_files() -> None:
    assert TEST_FILES, "no test file block in the README or docs/: the marker changed?"


@pytest.mark.parametrize("page, args, source", TEST_FILES,
                         ids=[f"{page.relative_to(REPO)}#{i}" for i, (page, _, _) in enumerate(TEST_FILES)])
def test_a_test_file_of_the_docs_passes(pytester: pytest.Pytester, sim_env: dict[str, str], page: Path, args: str,
                                        source: str) -> None:
    if "sgl_router" in source and importlib.util.find_spec("sglang_router") is None:
        pytest.skip("the sglang router is not installed: pip install 'pytest-sglworker[router]'")
    pytester.makepyfile(test_from_the_docs=source)
    result = pytester.runpytest_subprocess(*args.split(), "-p", "no:cacheprovider", timeout=300)
    outcomes = result.parseoutcomes()
    assert result.ret == 0 and outcomes.get("passed", 0) == source.count("    def test_") + source.count(
        "\ndef test_"), result.stdout.str()[-4000:]


def _bash_lines(page: Path) -> list[str]:
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
            for line in block.splitlines() if line.strip()]


def test_the_readmes_test_command_is_the_one_ci_runs() -> None:
    """.ci/run runs the README's install-and-test command as written: the two must stay one line."""
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    readme = [line for line in _bash_lines(README) if line.endswith(".venv/bin/pytest")]
    assert len(ci) == 1 and readme == ci, (readme, ci)


#: The pages a newcomer starts from: their commands must work as written today.
FIRST_PAGES = [README, *(REPO / "docs" / page for page in ("index.md", "tutorial.md", "how-to/gpu-ci.md"))]


@pytest.mark.parametrize("page", FIRST_PAGES, ids=[str(p.relative_to(REPO)) for p in FIRST_PAGES])
def test_no_first_command_installs_the_package_from_the_index(page: Path) -> None:
    """pytest-sglworker is not on PyPI yet (``No matching distribution found``): the commands install it from a
    clone or a built wheel; the index line is prose, for when it is published. (Adding an extra to an installed
    package, ``pip install 'pytest-sglworker[ray]'``, works without the index: that one is allowed elsewhere.)"""
    lines = _bash_lines(page)
    from_index = [line for line in lines if re.search(r"pip install ['\"]?pytest-sglworker\b", line)]
    assert not from_index, from_index
    installs = [line for line in lines if "pip install" in line]
    assert installs and all("pip install -e" in line or ".whl" in line for line in installs), installs
