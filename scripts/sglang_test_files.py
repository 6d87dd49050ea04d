"""Write sglang's own test files that the compat tiers run, each at its pinned commit, from a sglang clone of yours.

    python scripts/sglang_test_files.py /path/to/sglang-clone [DEST]

The files are upstream's (https://github.com/sgl-project/sglang, Apache-2.0) and are not part of this repository:
``tests/data/sglang_tests/MANIFEST.json`` names each one's path, commit and sha256. This writes each with ``git show
COMMIT:PATH`` from the clone into DEST at its upstream path (default: the user's cache directory,
``<cache>/pytest-sglworker/sglang-tests``, where the tests look without ``SGLWORKER_SGLANG_TESTS``), checks its
sha256, and says what it could not write (a clone without the commit: ``git -C CLONE fetch origin COMMIT``).

The manifest is read as a claim: an entry whose commit is not 40 hex digits, whose sha256 is not 64, or whose path is
not a plain relative path inside DEST (absolute, ``..``, a part that starts with ``-``, a control character) is
refused and named, never handed to git (``--end-of-options`` stops git from reading what follows as an option).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "tests" / "data" / "sglang_tests" / "MANIFEST.json"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def default_dest() -> Path:
    sys.path.insert(0, str(REPO))
    from pytest_sglworker.engine.install_dirs import user_cache_root

    return user_cache_root() / "sglang-tests"


def entries(manifest: dict[str, object]) -> list[dict[str, str]]:
    found = []
    for section in ("files", "families", "server_flags"):
        found.extend(dict(info) for info in manifest.get(section, {}).values())  # type: ignore[attr-defined]
    return found


def entry_problem(info: dict[str, str]) -> str | None:
    """Why a manifest entry cannot be used as it is (its commit, sha256 or path), or None."""
    commit, sha256, upstream = info.get("commit"), info.get("sha256"), info.get("upstream")
    if not isinstance(upstream, str) or not upstream:
        return f"manifest entry {info!r} names no upstream path"
    parts = upstream.split("/")
    if (upstream.startswith("/") or any(part in ("", ".", "..") or part.startswith("-") for part in parts)
            or not upstream.isprintable() or "\\" in upstream or ":" in upstream):
        return (f"manifest entry {upstream!r}: not a plain relative path (no leading '/', no '..', '.' or empty part, "
                "no part starting with '-', no ':', '\\' or control character)")
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        return f"manifest entry {upstream!r}: commit {commit!r} is not 40 lowercase hex digits"
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        return f"manifest entry {upstream!r}: sha256 {sha256!r} is not 64 lowercase hex digits"
    return None


def write(clone: Path, dest: Path, info: dict[str, str]) -> str | None:
    """Write one file; None when written with the manifest's sha256, else why not."""
    problem = entry_problem(info)
    if problem is not None:
        return problem
    path = dest / info["upstream"]
    if not path.resolve().is_relative_to(dest.resolve()):  # a symlink inside DEST that leads out of it
        return f"{info['upstream']}: {path} leads out of {dest} (a symlink on the way); remove it"
    revision = f"{info['commit']}:{info['upstream']}"
    shown = subprocess.run(["git", "-C", str(clone), "show", "--end-of-options", revision], capture_output=True,
                           check=False)
    if shown.returncode != 0:
        return (f"{info['upstream']} at {info['commit'][:12]}: {shown.stderr.decode(errors='replace').strip()} "
                f"(git -C {clone} fetch origin {info['commit']})")
    digest = hashlib.sha256(shown.stdout).hexdigest()
    if digest != info["sha256"]:
        return f"{info['upstream']} at {info['commit'][:12]}: sha256 {digest}, the manifest says {info['sha256']}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(shown.stdout)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("clone", type=Path, help="a git clone of https://github.com/sgl-project/sglang")
    parser.add_argument("dest", type=Path, nargs="?", help="where to write them (default: the user's cache)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dest = args.dest or default_dest()
    problems = [p for info in entries(json.loads(args.manifest.read_text(encoding="utf-8")))
                if (p := write(args.clone, dest, info)) is not None]
    for problem in problems:
        print(f"not written: {problem}", file=sys.stderr)
    print(f"{dest}: {'some files missing' if problems else 'every file written'}"
          + ("" if args.dest is None else f" (run the tests with SGLWORKER_SGLANG_TESTS={dest})"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
