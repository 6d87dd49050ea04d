#!/usr/bin/env bash
# Install OpenAI's o200k_base.tiktoken for the sglang router's gRPC mode, offline afterwards.
#
# Usage: sglworker install-router-vocab [DIR]   (runs: bash install-router-vocab.sh DIR)
#        (default DIR: <user cache dir>/pytest-sglworker/tiktoken, e.g. ~/.cache/pytest-sglworker/tiktoken)
#
# sglang-router 0.3.2 builds its Harmony (gpt-oss) encoder whenever it creates its gRPC router, whatever the
# model: it reads $TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken, or downloads the file from OpenAI's blob
# store, and checks its SHA-256 either way. Without it, and without that network, the router panics at
# startup ("Failed to load Harmony encoding"). PyPI ships no copy; the npm package tiktoken@1.0.22 ships the
# same ranks as JSON (encoders/o200k_base.json), from which this script writes the file byte for byte and
# checks the router's own hash. Then point TIKTOKEN_ENCODINGS_BASE at DIR (the plugin finds the default
# location by itself).
#
# Idempotent: a DIR that holds a file with the right hash is left alone. Needs npm (Debian: apt-get install
# npm); without it the script says so and exits 0, and the router's gRPC tests are skipped with this command.
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
  echo "usage: $0 DIR   (sglworker install-router-vocab gives it the default)" >&2
  exit 2
fi
dir="$1"
file="$dir/o200k_base.tiktoken"
sha256=446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d
package=tiktoken@1.0.22

if [[ -f "$file" ]] && echo "$sha256  $file" | sha256sum -c --status; then
  echo "router vocab already installed: $file"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "no npm here: the router's gRPC tests are skipped without $file (apt-get install npm, then rerun this)"
  exit 0
fi
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$package" >/dev/null)
tar -xzf "$tmp"/tiktoken-*.tgz -C "$tmp" package/encoders/o200k_base.json
"${SGLWORKER_PYTHON:-python3}" - "$tmp/package/encoders/o200k_base.json" "$tmp/o200k_base.tiktoken" <<'EOF'
import json
import sys

# "bpe_ranks" is "! <first rank> <base64 token> <base64 token> ...": the ranks are consecutive.
ranks = json.load(open(sys.argv[1], encoding="utf-8"))["bpe_ranks"].split(" ")
assert ranks[0] == "!", ranks[:2]
first = int(ranks[1])
with open(sys.argv[2], "w", encoding="ascii", newline="\n") as out:
    out.writelines(f"{token} {first + i}\n" for i, token in enumerate(ranks[2:]))
EOF
if ! echo "$sha256  $tmp/o200k_base.tiktoken" | sha256sum -c --status; then
  echo "error: the o200k_base.tiktoken rebuilt from $package does not have the router's SHA-256 $sha256" >&2
  exit 1
fi
mv "$tmp/o200k_base.tiktoken" "$file"
echo "router vocab installed: $file (export TIKTOKEN_ENCODINGS_BASE=$dir)"
