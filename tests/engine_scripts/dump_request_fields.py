"""Run with the real engine's Python: writes every field of sglang's request models to a JSON file (the argument,
default ``tests/data/sim/request_fields.json``), the source of truth of the simulated engine's fidelity table
(``tests/sim/fidelity_cases.py``, checked by ``tests/sim/test_sim_fidelity_table.py``).

The models are the ones a client's request body becomes: ``ChatCompletionRequest``, ``CompletionRequest`` and
``EmbeddingRequest`` (pydantic, ``sglang.srt.entrypoints.openai.protocol``), ``GenerateReqInput`` (a dataclass,
``sglang.srt.managers.io_struct``: the body of ``/generate``) and ``SamplingParams`` (a msgspec struct,
``sglang.srt.sampling.sampling_params``: ``/generate``'s ``sampling_params``). Each field: its name, its type
as Python writes it and its default (``"<required>"`` for a field without one, ``"<factory>"`` for one made by a
factory).

    SGLANG_USE_CPU_ENGINE=1 $SGLWORKER_REAL_ENGINE/bin/python tests/engine_scripts/dump_request_fields.py
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
from pydantic_core import PydanticUndefined
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams

OUT = Path(__file__).resolve().parents[1] / "data" / "sim" / "request_fields.json"


def type_name(annotation: Any) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    text = re.sub(r"<class '([^']+)'>", r"\1", text)
    return re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+([A-Za-z_][A-Za-z0-9_]*)", r"\1", text)  # sglang.srt....X -> X


def default_of(value: Any) -> Any:
    if value is PydanticUndefined or value is dataclasses.MISSING or value is msgspec.NODEFAULT:
        return "<required>"
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def pydantic_fields(model: Any) -> list[dict[str, Any]]:
    out = []
    for name, info in model.model_fields.items():
        default = "<factory>" if info.default_factory is not None else default_of(info.default)
        out.append({"name": name, "type": type_name(info.annotation), "default": default})
    return out


def dataclass_fields(cls: Any) -> list[dict[str, Any]]:
    out = []
    for f in dataclasses.fields(cls):
        default = "<factory>" if f.default_factory is not dataclasses.MISSING else default_of(f.default)
        out.append({"name": f.name, "type": type_name(f.type), "default": default})
    return out


def msgspec_fields(cls: Any) -> list[dict[str, Any]]:
    out = []
    for f in msgspec.structs.fields(cls):
        default = "<factory>" if f.default_factory is not msgspec.NODEFAULT else default_of(f.default)
        out.append({"name": f.name, "type": type_name(f.type), "default": default})
    return out


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    models = {
        "ChatCompletionRequest": pydantic_fields(ChatCompletionRequest),
        "CompletionRequest": pydantic_fields(CompletionRequest),
        "EmbeddingRequest": pydantic_fields(EmbeddingRequest),
        "GenerateReqInput": dataclass_fields(GenerateReqInput),
        "SamplingParams": msgspec_fields(SamplingParams),
    }
    doc = {"sglang": importlib.metadata.version("sglang"), "models": models}
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: " + ", ".join(f"{k} {len(v)}" for k, v in models.items())
          + f"; {sum(len(v) for v in models.values())} in all")


if __name__ == "__main__":
    main()
