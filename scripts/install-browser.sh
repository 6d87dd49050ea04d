#!/usr/bin/env bash
# Install Debian's chromium for the timeline's browser test tier (tests/plugin/test_timeline_browser.py, -m browser).
#
# Usage: bash scripts/install-browser.sh
#
# Idempotent: a machine that has /usr/bin/chromium installs nothing. Needs apt-get and root (or sudo); without
# them it says so and exits 0, and the browser tests are skipped with the install command as the reason.
set -euo pipefail
if [[ -x /usr/bin/chromium ]]; then
  echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "no apt-get here: install chromium yourself to run the browser tests (they are skipped without it)"
  exit 0
fi
sudo=""
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "not root and no passwordless sudo: run 'sudo apt-get install -y chromium' to run the browser tests"
    exit 0
  fi
fi
start=$(date +%s)
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "chromium installed in $(( $(date +%s) - start )) s: $(/usr/bin/chromium --version 2>/dev/null)"
