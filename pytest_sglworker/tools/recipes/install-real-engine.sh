#!/usr/bin/env bash
# Install the real sglang 0.5.23 engine for CPU-only machines: the project's real-engine test tier.
#
# Usage: sglworker install-real-engine [VENV_DIR]   (runs: bash install-real-engine.sh VENV_DIR)
#        (default VENV_DIR: <user cache dir>/pytest-sglworker/real-engine, e.g. ~/.cache/pytest-sglworker/real-engine)
#
# Builds a venv (about 2.3 GB) with sglang 0.5.23 (--no-deps), the CPU build of torch 2.13.0 (pinned by
# real_engine/constraints.txt, so nothing pulls a CUDA torch), the packages sglang needs to serve
# (real_engine/requirements.txt, smg-grpc-servicer for --grpc-mode included), torchvision 0.28.0 with
# its two fake-op registrations guarded, and a placeholder sgl_kernel copied into the venv's site-packages (no
# PYTHONPATH needed). Idempotent: a
# finished install leaves a marker file (written last) and a rerun with the same recipe exits at once.
#
# Then: SGLWORKER_REAL_ENGINE=VENV_DIR (or the default location, found without it) lets the tests find it; see
# pytest_sglworker/engine/cpu_engine.py for the launch recipe. Environment: SGLWORKER_BASE_PYTHON picks the
# interpreter the venv is made from (default python3; the torch wheel pinned here is for CPython 3.11).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
recipe="$here/real_engine"
if [[ $# -ne 1 || -z "$1" ]]; then
  echo "usage: $0 VENV_DIR   (sglworker install-real-engine gives it the default)" >&2
  exit 2
fi
venv="$1"
base_python="${SGLWORKER_BASE_PYTHON:-python3}"

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0+cpu
TORCHVISION_VERSION=0.28.0
MARKER_NAME=.sglworker-real-engine

mkdir -p "$(dirname "$venv")"
venv="$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")"
marker="$venv/$MARKER_NAME"

recipe_hash="$(cat "$recipe/requirements.txt" "$recipe/constraints.txt" "$recipe/sgl_kernel/__init__.py" \
  | sha256sum | cut -c1-16)"
expected="sglang=$SGLANG_VERSION
torch=$TORCH_VERSION
torchvision=$TORCHVISION_VERSION
recipe=$recipe_hash"

if [[ -x "$venv/bin/python" && -f "$marker" && "$(cat "$marker")" == "$expected" ]]; then
  echo "real engine already installed: $venv"
  exit 0
fi

start=$SECONDS
echo "installing the real sglang $SGLANG_VERSION CPU engine into $venv ..."
rm -f "$marker"

# pip, quiet, without compiling every module to bytecode up front (that alone took ~45 s here; the modules
# an import touches get compiled when first imported). The only lines dropped are the harmless "Location
# ... is ignored" index warnings, so that real errors stay visible; pipefail keeps pip's exit status.
pip_install() {
  "$venv/bin/python" -m pip install -q --no-compile "$@" 2>&1 | { grep -v -E "Location '.*' is ignored" || true; } >&2
}

if [[ ! -x "$venv/bin/python" ]]; then
  "$base_python" -m venv "$venv"
fi
# One resolver run for torch and everything sglang needs, all pinned by the constraints file.
pip_install -c "$recipe/constraints.txt" -r "$recipe/requirements.txt"
pip_install --no-deps -c "$recipe/constraints.txt" "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# sglang imports torchvision; PyPI's wheel is a CUDA build whose two fake-op registrations fail beside the
# CPU torch. Guard them so that torchvision imports (sglang never calls those ops on this path).
meta="$site/torchvision/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\("(torchvision::q?nms)"\)/@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda f: f))/' \
  "$meta"
if grep -q -E '^@torch\.library\.register_fake\("torchvision::q?nms"\)' "$meta"; then
  echo "error: could not guard the fake-op registrations in $meta" >&2
  exit 1
fi

# PyPI has no CPU build of sgl_kernel; sglang's CPU path imports names from it: install the placeholder.
rm -rf "$site/sgl_kernel"
mkdir -p "$site/sgl_kernel"
cp "$recipe/sgl_kernel/__init__.py" "$site/sgl_kernel/__init__.py"

# Compile sglang's modules now (in parallel, ~8 s): a launch imports nearly all of them, and compiling them
# lazily would make the first server start ~17 s slower.
"$venv/bin/python" -m compileall -q -j 0 "$site/sglang" > /dev/null \
  || echo "note: some sglang modules did not byte-compile now; they compile when imported" >&2

# Verify without any PYTHONPATH: what the tests and users will run.
env -u PYTHONPATH SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -W ignore::UserWarning - "$TORCH_VERSION" "$SGLANG_VERSION" <<'EOF'
import sys

import sgl_kernel
import torch
import torchvision  # noqa: F401
import sglang
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.test.test_utils  # noqa: F401  (what sglang's own unittest files import: the compat tiers)
import smg_grpc_proto  # noqa: F401  (--grpc-mode: the servicer and its stubs)
import smg_grpc_servicer  # noqa: F401

assert torch.__version__ == sys.argv[1], f"torch {torch.__version__} != {sys.argv[1]}"
assert sglang.__version__ == sys.argv[2], f"sglang {sglang.__version__} != {sys.argv[2]}"
assert getattr(sgl_kernel, "PLACEHOLDER", False), f"unexpected sgl_kernel at {sgl_kernel.__file__}"
EOF

printf '%s\n' "$expected" > "$marker.tmp"
mv "$marker.tmp" "$marker"
echo "real engine installed in $((SECONDS - start)) s: $venv"
