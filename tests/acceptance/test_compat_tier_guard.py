"""The compat tiers (``test_compat_real_engine.py`` and the files that share its inner session) run upstream files
that import ``sglang.test.test_utils``. An installed real engine that cannot import it (an install by a recipe
without ``datasets``) once made every such tier skip, unseen; it now fails them, with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_compat_real_engine import _prepare_inner


def test_an_engine_that_cannot_import_test_utils_fails_the_tier_instead_of_skipping_it(tmp_path: Path) -> None:
    python = tmp_path / "python"  # answers the tier's import probe as an engine without datasets does
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'datasets'\" >&2\nexit 1\n")
    python.chmod(0o755)
    caught: BaseException | None = None
    try:
        _prepare_inner(tmp_path / "inner", python, tmp_path / "model", {})
    except BaseException as exc:  # a skip (the old behaviour) must be seen here, not skip this test
        caught = exc
    assert isinstance(caught, pytest.fail.Exception), repr(caught)
    said = str(caught)
    assert f"the real engine at {python} cannot import sglang.test.test_utils" in said
    assert "No module named 'datasets'" in said and "run `sglworker install-real-engine` again" in said
