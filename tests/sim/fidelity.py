"""How the simulated engine's fidelity is measured, field by field (``test_sim_fidelity.py`` runs it,
``test_sim_fidelity_table.py`` checks its bookkeeping, ``fidelity_doc.py`` renders the result).

Every field of sglang 0.5.23's request models (``tests/data/sim/request_fields.json``, written by
``tests/engine_scripts/dump_request_fields.py`` from the real engine's own pydantic, dataclass and msgspec
classes) has a row in :data:`TABLE` (``fidelity_cases.py``): the values it is sent with (merged into a base request
of its model, or into ``/generate``'s ``sampling_params``), and, when the two engines differ in what a client sees,
the named reason. Each probe goes to the real engine and to the sim, not streamed and (where the endpoint streams)
streamed; what is compared is :func:`differences`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from real_pair import Answer, Case, compare, diff_shapes, send, shape

REPO = Path(__file__).resolve().parents[2]
FIELDS_FILE = REPO / "tests" / "data" / "sim" / "request_fields.json"
RESULTS_FILE = REPO / "tests" / "data" / "sim" / "fidelity_results.json"
DOC_FILE = REPO / "docs" / "SIM_FIDELITY.md"

#: The model each field belongs to -> (the endpoint, whether it streams, the pair of servers).
MODELS: dict[str, tuple[str, bool, str]] = {
    "ChatCompletionRequest": ("/v1/chat/completions", True, "generation"),
    "CompletionRequest": ("/v1/completions", True, "generation"),
    "EmbeddingRequest": ("/v1/embeddings", False, "embedding"),
    "GenerateReqInput": ("/generate", True, "generation"),
    "SamplingParams": ("/generate", True, "generation"),
}

#: What every probe of a model starts from (greedy and without EOS: the token counts do not depend on weights).
BASE: dict[str, dict[str, Any]] = {
    "ChatCompletionRequest": {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                              "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    "CompletionRequest": {"model": "m", "prompt": "hello there", "max_tokens": 3, "temperature": 0,
                          "ignore_eos": True},
    "EmbeddingRequest": {"model": "m", "input": "hello there"},
    "GenerateReqInput": {"text": "hello there", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                    "ignore_eos": True}},
    "SamplingParams": {"text": "hello there", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                  "ignore_eos": True}},
}


@dataclass(frozen=True)
class F:
    """One field's row: ``probes``, each merged into its model's base request (a SamplingParams row's into its
    ``sampling_params``; a ``None`` value deletes the key);
    ``known``: why a client sees the two engines differ (empty: they must not); ``stream``: also sent streamed."""

    name: str
    probes: tuple[dict[str, Any], ...]
    known: str = ""
    stream: bool = True
    #: False: not sent to the real engine (``known`` says why), nor to the sim
    sent: bool = True


def row(name: str, *probes: dict[str, Any], known: str = "", stream: bool = True, sent: bool = True) -> F:
    return F(name, probes or ({name: True},), known, stream, sent)


@dataclass
class Outcome:
    """What one field's probes found: their count and the differences (``probe: what``)."""

    requests: int = 0
    differences: list[str] = field(default_factory=list)


def request_body(model: str, probe: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    body = json.loads(json.dumps(BASE[model]))
    target = body["sampling_params"] if model == "SamplingParams" else body
    for key, value in probe.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    if stream:
        body["stream"] = True
    return body


def probe_cases(model: str, row_: F) -> list[Case]:
    path, streams, pair = MODELS[model]
    cases = []
    for k, probe in enumerate(row_.probes):
        for stream in (False, True) if streams and row_.stream else (False,):
            name = f"{model}.{row_.name}[{k}]{'~stream' if stream else ''}"
            cases.append(Case(name, "POST", path, request_body(model, probe, stream=stream), message=True,
                              embedding=pair == "embedding"))
    return cases


def observed(answer: Answer) -> Any:
    """The values a client can count on in an answer (its shape is compared apart): OpenAI usage, choices' indexes
    and finish reasons; ``/generate``'s token counts and finish reasons; for a stream, which chunks carry what
    (:func:`stream_kinds`)."""
    if answer.is_stream:
        return stream_kinds(answer.body)
    return _values(answer.body)


def _values(body: Any) -> Any:
    if isinstance(body, list):
        return [_values(b) for b in body]
    if not isinstance(body, dict):
        return None
    out: dict[str, Any] = {}
    if "usage" in body:
        out["usage"] = body["usage"]
    if isinstance(body.get("choices"), list):
        out["choices"] = [(c.get("index"), c.get("finish_reason")) for c in body["choices"]]
    meta = body.get("meta_info")
    if isinstance(meta, dict):
        out["meta"] = {k: meta.get(k) for k in ("prompt_tokens", "completion_tokens", "finish_reason")}
        out["output_ids"] = len(body.get("output_ids") or [])
    if isinstance(body.get("data"), list):
        out["data"] = [(d.get("index"), d.get("object")) for d in body["data"] if isinstance(d, dict)]
    return out


def _chunk_kind(event: Any) -> tuple[bool, Any]:
    """(whether the chunk is plain content, what it carries): an OpenAI chunk's choices (index, finish reason,
    role, logprobs), its usage and ``sglext``; a ``/generate`` chunk's index and whether it is final."""
    if not isinstance(event, dict):
        return False, event
    if isinstance(event.get("choices"), list):
        choices = [{"index": c.get("index"), "finish": c.get("finish_reason"), "role": "role" in (c.get("delta") or {}),
                    "logprobs": c.get("logprobs") is not None,
                    "ids": sorted(k for k in c if k.endswith("token_ids"))} for c in event["choices"]]
        plain = bool(choices) and all(not c["finish"] and not c["role"] for c in choices)
        usage = event.get("usage")
        return plain, {"choices": choices, "usage": (usage is not None) if plain else usage,
                       "sglext": sorted(event.get("sglext") or {})}
    meta = event.get("meta_info")
    if isinstance(meta, dict):
        final = meta.get("finish_reason") is not None
        return not final, {"index": event.get("index"), "final": final, "keys": sorted(event)}
    return False, sorted(event)


def stream_kinds(events: list[Any]) -> dict[str, Any]:
    """What a stream's chunks carry: every chunk that is not plain content (roles, finish reasons, usage,
    ``sglext``, errors), as a multiset, and the kinds of the plain ones. How many tokens the real engine puts in
    one chunk, and in which order two choices' chunks interleave, depend on its timing: plain chunks are not
    counted, and the plain kinds are compared only when both streams have some (``plain`` is None otherwise)."""
    marked, plain = [], set()
    for event in events:
        is_plain, kind = _chunk_kind(event)
        if is_plain and isinstance(kind, dict) and "choices" in kind:  # which token ids a plain chunk carries
            kind = {**kind, "choices": [{k: v for k, v in c.items() if k != "ids"} for c in kind["choices"]]}
        text = json.dumps(kind, sort_keys=True)  # depends on how many it folds: its shape is compared apart
        if is_plain:
            plain.add(text)
        else:
            marked.append(text)
    return {"marked": sorted(marked), "plain": sorted(plain) or None}


def differences(case: Case, real: Answer, sim: Answer) -> list[str]:
    """The corpus comparison (status, content type, shapes, error messages) and the observed values; a stream's
    shapes as :func:`stream_shapes` takes them."""
    if real.is_stream and sim.is_stream and real.status == sim.status:
        a, b = stream_shapes(real.body), stream_shapes(sim.body)
        for key in ("first", "plain"):  # compared only where both streams have them
            if a[key] is None or b[key] is None:
                a[key] = b[key] = None
        problems = diff_shapes(a, b, "stream")
    else:
        problems = compare(case, real, sim)
    if problems or real.status != 200:
        return problems
    a, b = observed(real), observed(sim)
    if isinstance(a, dict) and isinstance(b, dict) and (a.get("plain") is None or b.get("plain") is None):
        a, b = {**a, "plain": None}, {**b, "plain": None}
    if a != b:
        problems.append(f"observed: real {json.dumps(a)[:400]} vs sim {json.dumps(b)[:400]}")
    return problems


def stream_shapes(events: list[Any]) -> dict[str, Any]:
    """What is compared of a stream's shapes: whether it ends with ``[DONE]``, its last data chunk, its first
    (when it has more than one), the set of shapes of the chunks between that are not plain content, and that of
    the plain ones (None when there are none: the real engine may fold every token into the first chunk)."""
    data = [e for e in events if e != "[DONE]"]
    middle = data[1:-1]
    plain = {json.dumps(shape(e), sort_keys=True) for e in middle if _chunk_kind(e)[0]}
    return {"done": bool(events) and events[-1] == "[DONE]", "last": shape(data[-1]) if data else None,
            "first": shape(data[0]) if len(data) > 1 else None,
            "marked": sorted({json.dumps(shape(e), sort_keys=True) for e in middle if not _chunk_kind(e)[0]}),
            "plain": sorted(plain) or None}


def run_row(urls: dict[str, tuple[str, str]], model: str, row_: F) -> Outcome:
    """Every probe of one row against both engines (``urls``: pair name -> (real URL, sim URL))."""
    outcome = Outcome()
    if not row_.sent:
        return outcome
    for case in probe_cases(model, row_):
        real_url, sim_url = urls["embedding" if case.embedding else "generation"]
        real, sim = send(real_url, case), send(sim_url, case)
        outcome.requests += 1
        outcome.differences += [f"{case.name}: {p}" for p in differences(case, real, sim)]
    return outcome


def verdict(row_: F, outcome: Outcome) -> dict[str, Any]:
    """``same``; ``known`` (with the row's reason and what differed, or why it was not sent); ``unexplained``."""
    if not row_.sent:
        return {"verdict": "known", "requests": 0, "reason": row_.known}
    if not outcome.differences:
        return {"verdict": "same", "requests": outcome.requests}
    status = "known" if row_.known else "unexplained"
    out = {"verdict": status, "requests": outcome.requests, "differences": outcome.differences[:3]}
    if row_.known:
        out["reason"] = row_.known
    return out


def request_fields() -> dict[str, list[dict[str, Any]]]:
    models: dict[str, list[dict[str, Any]]] = json.loads(FIELDS_FILE.read_text(encoding="utf-8"))["models"]
    return models
