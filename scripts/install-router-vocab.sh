#!/usr/bin/env bash
# `sglworker install-router-vocab [DIR]` from this checkout (default DIR: the user's cache directory,
# ~/.cache/pytest-sglworker/tiktoken on Linux, where the plugin finds it). The script itself is
# pytest_sglworker/tools/recipes/install-router-vocab.sh; see scripts/sglworker.
exec "$(dirname "${BASH_SOURCE[0]}")/sglworker" install-router-vocab "$@"
