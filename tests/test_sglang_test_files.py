"""``scripts/sglang_test_files.py``: sglang's own test files (not part of this repository) written from a clone,
each at the commit ``MANIFEST.json`` pins, with its sha256 checked. A local git repository stands in for the clone."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script() -> ModuleType:
    script = REPO / "scripts" / "sglang_test_files.py"
    spec = importlib.util.spec_from_file_location("sglworker_sglang_test_files", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_each_file_is_written_at_its_commit_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clone = tmp_path / "sglang"
    clone.mkdir()
    git(clone, "init", "-q")
    path = "test/registered/basic/test_a.py"
    (clone / path).parent.mkdir(parents=True)
    (clone / path).write_text("old = 1\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "one")
    first = git(clone, "rev-parse", "HEAD")
    (clone / path).write_text("new = 2\n")
    git(clone, "commit", "-qam", "two")
    manifest = tmp_path / "MANIFEST.json"
    manifest.write_text(json.dumps({
        "files": {"test_a.py": {"upstream": path, "commit": first,
                                "sha256": hashlib.sha256(b"old = 1\n").hexdigest()}},
        "families": {"test_b.py": {"upstream": "test/registered/basic/test_b.py", "commit": first,
                                   "sha256": "0" * 64}}}))
    dest = tmp_path / "dest"
    code = load_script().main([str(clone), str(dest), "--manifest", str(manifest)])
    assert (dest / path).read_text() == "old = 1\n"  # the pinned commit's bytes, not the clone's head
    assert code == 1
    err = capsys.readouterr().err
    assert "not written: test/registered/basic/test_b.py at " in err and f"fetch origin {first}" in err


def test_a_file_with_other_bytes_is_not_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clone = tmp_path / "sglang"
    clone.mkdir()
    git(clone, "init", "-q")
    (clone / "t.py").write_text("x = 1\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "one")
    manifest = tmp_path / "MANIFEST.json"
    manifest.write_text(json.dumps({"files": {"t.py": {"upstream": "t.py", "commit": git(clone, "rev-parse", "HEAD"),
                                                       "sha256": "f" * 64}}}))
    assert load_script().main([str(clone), str(tmp_path / "dest"), "--manifest", str(manifest)]) == 1
    assert not (tmp_path / "dest" / "t.py").exists()
    assert "the manifest says " + "f" * 64 in capsys.readouterr().err


def test_the_manifest_pins_every_file_and_the_repository_holds_none() -> None:
    manifest = json.loads((REPO / "tests" / "data" / "sglang_tests" / "MANIFEST.json").read_text())
    entries = load_script().entries(manifest)
    assert len(entries) >= 8
    for info in entries:
        assert len(info["commit"]) == 40 and len(info["sha256"]) == 64 and info["upstream"].startswith("test/")
    assert not (REPO / "tests" / "data" / "sglang_tests" / "upstream").exists()
