"""Placeholder for ``sgl_kernel`` on CPU-only machines: PyPI has no CPU build of it.

Installed into the real-engine venv's site-packages by ``scripts/install-real-engine.sh``, so that no
``PYTHONPATH`` is needed. sglang's CPU path imports names from ``sgl_kernel`` when its modules load: any
name imports; calling one raises, so a code path that really needs a kernel fails loudly instead of
computing something wrong. With this placeholder sglang takes its plain-torch code paths; serving a tiny
model on the CPU calls none of these names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

#: Marks this module as the placeholder (checked by the install script's verification).
PLACEHOLDER = True


def _missing(name: str) -> Callable[..., NoReturn]:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} is not available on this CPU-only install (placeholder)")

    call.__name__ = name
    call.__qualname__ = name
    return call


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
