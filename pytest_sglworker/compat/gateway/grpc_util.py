"""The names the e2e_grpc suite's test files import from its ``util`` module, served by the plugin (the module
``util`` while pytest imports a file under ``e2e_grpc/``: :mod:`.e2e_grpc`).

- ``kill_process_tree``: :func:`.e2e_grpc.kill_process_tree` (a cluster's router stopped, its workers given back to
  the pool; any other pid as sglang does);
- ``DEFAULT_*_MODEL_PATH``: the path the spec serving that model id loads (read when asked for), as ``infra``'s,
  a :class:`ModelPath` that remembers the id (a launch of it is served by that id's spec);
- ``DEFAULT_URL_FOR_TEST``, ``DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH``: sglang 0.5.23's values (``http://127.0.0.1:21000``
  outside CI, ``SGLANG_IS_IN_CI=1``: ``:11000``; shifted by the first digit of ``CUDA_VISIBLE_DEVICES``; 600 s);
- ``CustomTestCase``: ``unittest.TestCase``. sglang's reruns a failing test up to ``SGLANG_TEST_MAX_RETRY`` times,
  which under pytest hides a flaky test behind a pass; here a test runs once;
- ``get_tokenizer(path)``: the model's tokenizer (``transformers.AutoTokenizer``, as sglang's reads it).
"""

from __future__ import annotations

import os
import unittest
from typing import Any

from .constants import DEFAULT_PATHS
from .e2e_grpc import kill_process_tree
from .runtime import model_path_of

__all__ = ["DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH", "DEFAULT_URL_FOR_TEST", "CustomTestCase", "ModelPath", "get_tokenizer",
           "kill_process_tree", *DEFAULT_PATHS]

DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600


def _default_url() -> str:
    """sglang's ``DEFAULT_URL_FOR_TEST`` (sglang/test/test_utils.py)."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES", "0") or "0")[0]
    shift = int(first) if first.isdigit() else 0
    in_ci = os.environ.get("SGLANG_IS_IN_CI", "").lower() in ("1", "true", "yes", "on")
    runner = 10000 + shift * 2000 if in_ci else 20000 + shift * 1000
    return f"http://127.0.0.1:{runner + 1000}"


DEFAULT_URL_FOR_TEST = _default_url()


class CustomTestCase(unittest.TestCase):
    """sglang's ``CustomTestCase`` without its reruns: a test runs once."""


def get_tokenizer(tokenizer_name: str, *args: Any, **kwargs: Any) -> Any:
    """The tokenizer of the model at ``tokenizer_name`` (``transformers.AutoTokenizer.from_pretrained``)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("util.get_tokenizer reads the model's tokenizer with transformers, which this Python does "
                          "not have: pip install transformers") from None
    kwargs.setdefault("trust_remote_code", True)
    return AutoTokenizer.from_pretrained(str(tokenizer_name), *args, **kwargs)


class ModelPath(str):
    """A model path that remembers the suite's model id it was read for (``model_id``), so that a launch of it is
    served by that id's spec even where several specs load the same path."""

    model_id: str

    def __new__(cls, path: str, model_id: str) -> ModelPath:
        made = super().__new__(cls, path)
        made.model_id = model_id
        return made

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]  # copied and pickled with its id
        return str(self), self.model_id


def __getattr__(name: str) -> Any:
    if name in DEFAULT_PATHS:
        return ModelPath(model_path_of(DEFAULT_PATHS[name]), DEFAULT_PATHS[name])
    raise AttributeError(f"module 'util' (pytest_sglworker.compat.gateway.grpc_util, the e2e_grpc suite's util) has "
                         f"no attribute {name!r}; it serves {', '.join(__all__)}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
