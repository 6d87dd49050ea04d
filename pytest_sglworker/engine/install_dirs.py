"""Where the optional installs of the ``sglworker`` command go when it is given no folder, and where the plugin
looks for them: the user's cache directory, as ``platformdirs`` names it (on Linux ``$XDG_CACHE_HOME/
pytest-sglworker``, else ``~/.cache/pytest-sglworker``), never inside site-packages or a checkout.

- ``real-engine/``: the real sglang CPU engine's venv (``sglworker install-real-engine``);
- ``tiktoken/``: the router's offline vocabulary (``sglworker install-router-vocab``).

Read when asked (not at import), so that a changed ``XDG_CACHE_HOME`` is seen.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["APP_NAME", "default_real_engine_dir", "default_router_vocab_dir", "user_cache_root"]

#: The folder's name under the user's cache directory.
APP_NAME = "pytest-sglworker"


def user_cache_root() -> Path:
    """``<user cache dir>/pytest-sglworker`` (not created here)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def default_real_engine_dir() -> Path:
    """Where ``sglworker install-real-engine`` installs by default, and where the plugin finds it without
    ``SGLWORKER_REAL_ENGINE``."""
    return user_cache_root() / "real-engine"


def default_router_vocab_dir() -> Path:
    """Where ``sglworker install-router-vocab`` writes ``o200k_base.tiktoken`` by default, and where the plugin
    finds it without ``TIKTOKEN_ENCODINGS_BASE``."""
    return user_cache_root() / "tiktoken"
