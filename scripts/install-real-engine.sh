#!/usr/bin/env bash
# `sglworker install-real-engine [VENV_DIR]` from this checkout (default VENV_DIR: the user's cache directory,
# ~/.cache/pytest-sglworker/real-engine on Linux, where the tests find it). The recipe itself is
# pytest_sglworker/tools/recipes/install-real-engine.sh; see scripts/sglworker.
exec "$(dirname "${BASH_SOURCE[0]}")/sglworker" install-real-engine "$@"
