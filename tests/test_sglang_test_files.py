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


def test_a_manifest_entry_that_is_no_commit_or_plain_path_is_refused_and_never_reaches_git(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A commit of ``--output=PATH`` was taken by ``git show`` as its option and wrote that file; a path of
    ``../x`` would be written outside DEST. Each such entry is refused by name; the good one is still written."""
    clone = tmp_path / "sglang"
    clone.mkdir()
    git(clone, "init", "-q")
    (clone / "t.py").write_text("x = 1\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "one")
    head = git(clone, "rev-parse", "HEAD")
    digest = hashlib.sha256(b"x = 1\n").hexdigest()
    planted = tmp_path / "planted"
    bad = {
        "option": {"upstream": "t.py", "commit": f"--output={planted}", "sha256": digest},
        "short": {"upstream": "t.py", "commit": head[:12], "sha256": digest},
        "upper": {"upstream": "t.py", "commit": head.upper(), "sha256": digest},
        "up": {"upstream": "../escaped.py", "commit": head, "sha256": digest},
        "absolute": {"upstream": str(tmp_path / "abs.py"), "commit": head, "sha256": digest},
        "dash": {"upstream": "-p/t.py", "commit": head, "sha256": digest},
        "newline": {"upstream": "t.py\nnot written: forged", "commit": head, "sha256": digest},
        "digest": {"upstream": "t.py", "commit": head, "sha256": "--stat"},
    }
    manifest = tmp_path / "MANIFEST.json"
    manifest.write_text(json.dumps({"files": {**bad, "good": {"upstream": "t.py", "commit": head, "sha256": digest}}}))
    dest = tmp_path / "dest"
    assert load_script().main([str(clone), str(dest), "--manifest", str(manifest)]) == 1
    assert list(tmp_path.glob("planted*")) == []  # git wrote "planted:t.py", its --output
    assert not (tmp_path / "escaped.py").exists() and not (tmp_path / "abs.py").exists()
    assert (dest / "t.py").read_text() == "x = 1\n"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(bad), err  # one line each, none forged
    assert f"not written: manifest entry 't.py': commit '--output={planted}' is not 40 lowercase hex digits" in err
    assert f"not written: manifest entry 't.py': commit '{head[:12]}' is not 40 lowercase hex digits" in err
    assert "not written: manifest entry 't.py': sha256 '--stat' is not 64 lowercase hex digits" in err
    for path in ("../escaped.py", str(tmp_path / "abs.py"), "-p/t.py", "t.py\\nnot written: forged"):
        said = f"not written: manifest entry '{path}': not a plain relative path"
        assert any(line.startswith(said) for line in err), (path, err)


def test_a_symlink_in_dest_that_leads_out_of_it_is_not_followed(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    clone = tmp_path / "sglang"
    (clone / "test").mkdir(parents=True)
    git(clone, "init", "-q")
    (clone / "test" / "t.py").write_text("x = 1\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "one")
    manifest = tmp_path / "MANIFEST.json"
    head = git(clone, "rev-parse", "HEAD")
    manifest.write_text(json.dumps({"files": {"t.py": {"upstream": "test/t.py", "commit": head,
                                                       "sha256": hashlib.sha256(b"x = 1\n").hexdigest()}}}))
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "test").symlink_to(outside)
    assert load_script().main([str(clone), str(dest), "--manifest", str(manifest)]) == 1
    assert list(outside.iterdir()) == []
    assert "leads out of" in capsys.readouterr().err
