"""The simulated engine's model: its deterministic generations, logprobs and embeddings (its tokenizer and what a
model directory says are in :mod:`.vocab`, re-exported here).

Part of :mod:`pytest_sglworker.sim`; stdlib only. When ``--model-path`` is a directory with a ``config.json`` its
vocab size, context length, hidden size, EOS and architecture are the real ones; prompts are tokenized with the
model's own tokenizer whenever one is found, else with the sim's fallback (:mod:`.vocab` says which, and why).

Generations are deterministic, seeded by the prompt: the model echoes the prompt's (non-special) tokens
in a cycle, 16 of them and then its EOS token, unless ``max_new_tokens``, a stop string or ``ignore_eos``
says otherwise; a seeded sample and the penalties change the tokens in the real engine's direction (:class:`Sampling`).
Logprobs are deterministic too: every generated token is the top-1 choice of its position.
"""

from __future__ import annotations

import base64
import math
import random
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .vocab import HFVocab, ModelDir, Vocab, load_model_dir, message_text, render_chat

__all__ = ["HFVocab", "ModelDir", "Vocab", "load_model_dir", "message_text", "render_chat"]

#: How many tokens the simulated model says before its end-of-sequence token.
NATURAL_TOKENS = 16


# ---------------------------------------------------------------------------------------------- generation


@dataclass
class Generation:
    """One deterministic completion of a prompt."""

    prompt_ids: list[int]
    output_ids: list[int]
    texts: list[str]  # the cumulative text after each output token (stop strings trimmed)
    finish: dict[str, Any]
    cached_tokens: int
    seed: int

    @property
    def text(self) -> str:
        return self.texts[-1] if self.texts else ""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def openai_finish(self) -> tuple[str, Any]:
        """(finish_reason, matched_stop) as the OpenAI endpoints spell them."""
        if self.finish["type"] == "length":
            return "length", None
        return "stop", self.finish.get("matched")

    def deltas(self) -> list[str]:
        """The text each output token adds (what a stream sends)."""
        out, previous = [], ""
        for text in self.texts:
            out.append(text[len(previous):] if text.startswith(previous) else text)
            previous = text
        return out


def prompt_seed(ids: Sequence[int]) -> int:
    return zlib.crc32(",".join(map(str, ids)).encode())


@dataclass(frozen=True)
class Sampling:
    """The sampling knobs that change a generation, as the real engine's do in direction (never in value):

    - ``temperature`` above 0 *with* a ``seed`` (``sampling_params.sampling_seed``, OpenAI's ``seed``): the prompt's
      words (a word: its tokens up to the next one that starts with a space) are drawn with replacement, half the
      time among the words already said (so words repeat, as a sampled small model's do), by a generator seeded
      with the seed and the prompt: the same seed repeats, another seed differs. Without a seed, or at temperature
      0, the generation is the deterministic echo (the real engine samples afresh then; the sim cannot be random
      and stay reproducible).
    - a penalty (``frequency_penalty`` or ``presence_penalty`` above 0, ``repetition_penalty`` above 1): a token
      (in a seeded sample: a word) the generation already holds is replaced by one it does not (the prompt's
      first, then the vocabulary's), so the vocabulary used widens; below 0 (below 1): each token (word) is said
      twice, so it narrows.

    No knob (:data:`NO_SAMPLING`) leaves the echo unchanged."""

    temperature: float | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, params: Any, *, seed_key: str = "sampling_seed") -> Sampling:
        """The knobs of ``sampling_params`` (or an OpenAI request, ``seed_key="seed"``); what is not a number is
        the default (the request checks refuse it before)."""
        def number(key: str, default: float) -> float:
            value = params.get(key) if isinstance(params, dict) else None
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

        seed = params.get(seed_key) if isinstance(params, dict) else None
        temperature = params.get("temperature") if isinstance(params, dict) else None
        return cls(float(temperature) if isinstance(temperature, (int, float)) else None,
                   seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
                   number("frequency_penalty", 0.0), number("presence_penalty", 0.0),
                   number("repetition_penalty", 1.0))

    @property
    def sampled(self) -> bool:
        return self.seed is not None and self.temperature is not None and self.temperature > 0

    @property
    def penalty(self) -> int:
        """1: a penalty against repeats, -1: one for them, 0: none."""
        if self.frequency_penalty > 0 or self.presence_penalty > 0 or self.repetition_penalty > 1:
            return 1
        if self.frequency_penalty < 0 or self.presence_penalty < 0 or self.repetition_penalty < 1:
            return -1
        return 0


NO_SAMPLING = Sampling()


def _next_token(vocab: Vocab, source: list[int], output: list[int], sampling: Sampling) -> int:
    """The next token of a generation under ``sampling`` (see :class:`Sampling`)."""
    position = len(output)
    if sampling.penalty < 0 and position % 2 == 1:
        return output[-1]
    at = position // 2 if sampling.penalty < 0 else position
    token = source[at % len(source)]
    if sampling.penalty > 0 and token in output:
        used = set(output)
        fresh = [t for t in source if t not in used]
        if fresh:
            return fresh[0]
        candidate = _fresh_token(vocab, used, output)
        if candidate is not None:
            return candidate
    return token


def _fresh_token(vocab: Vocab, used: set[int], salt: Sequence[int]) -> int | None:
    """A token of the vocabulary that is not special and not in ``used`` (where to start looking: ``salt``)."""
    start = prompt_seed(salt) % vocab.vocab_size
    for step in range(vocab.vocab_size):
        candidate = (start + step) % vocab.vocab_size
        if candidate not in used and candidate not in vocab.special_ids:
            return candidate
    return None


def _words(vocab: Vocab, source: list[int]) -> list[tuple[int, ...]]:
    """``source`` cut into words: a new one at each token whose text starts with whitespace."""
    words: list[list[int]] = []
    for token in source:
        if not words or vocab.decode([token])[:1].isspace():
            words.append([token])
        else:
            words[-1].append(token)
    return [tuple(w) for w in words]


def _sampled(vocab: Vocab, source: list[int], sampling: Sampling, draw: random.Random, length: int) -> list[int]:
    """A seeded sample's first ``length`` tokens: the prompt's words, drawn with replacement (:class:`Sampling`)."""
    words = _words(vocab, source)
    out: list[int] = []
    said: list[tuple[int, ...]] = []
    while len(out) < length:
        # half the time a word already said: a small model's sample repeats itself
        word = said[draw.randrange(len(said))] if said and draw.random() < 0.5 else words[draw.randrange(len(words))]
        if sampling.penalty > 0 and word in said:
            fresh = [w for w in words if w not in said]
            token = None if fresh else _fresh_token(vocab, set(out), out)
            word = fresh[0] if fresh else ((token,) if token is not None else word)
        said.append(word)
        out.extend(word * (2 if sampling.penalty < 0 else 1))
    return out[:length]


def generate(vocab: Vocab, prompt_ids: list[int], source_ids: list[int], max_new_tokens: int | None,
             stop: list[str], ignore_eos: bool, stop_token_ids: Sequence[int] = (),
             stop_regex: Sequence[str] = (), sampling: Sampling = NO_SAMPLING) -> Generation:
    """The prompt's tokens (``source_ids``, special ones left out), cycled, then EOS after 16 tokens;
    ``max_new_tokens`` (None: up to the EOS), stop strings (trimmed from the text), stop regexes (matched
    anywhere in the text, which keeps the match; ``matched`` is the pattern) and ``ignore_eos`` as in sglang;
    ``output_ids`` includes a matched EOS, the text does not. ``sampling``: see :class:`Sampling`."""
    seed = prompt_seed(prompt_ids)
    draw = random.Random(f"{sampling.seed}:{seed}") if sampling.sampled else None
    source = [i for i in source_ids if i not in vocab.special_ids] or [
        next(i for i in range(seed % vocab.vocab_size, seed % vocab.vocab_size + vocab.vocab_size)
             if i % vocab.vocab_size not in vocab.special_ids) % vocab.vocab_size]
    limit = NATURAL_TOKENS + 1 if max_new_tokens is None else max_new_tokens
    natural = limit if ignore_eos else NATURAL_TOKENS
    output: list[int] = []
    texts: list[str] = []
    finish: dict[str, Any] | None = None
    stops = set(stop_token_ids)
    sampled = _sampled(vocab, source, sampling, draw, min(limit, natural)) if draw is not None else None
    while finish is None:
        if len(output) >= limit:
            finish = {"type": "length", "length": limit}
            break
        if len(output) >= natural:
            output.append(vocab.eos_token_id)
            texts.append(texts[-1] if texts else "")
            finish = {"type": "stop", "matched": vocab.eos_token_id}
            break
        if sampled is not None:
            token = sampled[len(output)]
        elif sampling == NO_SAMPLING:
            token = source[len(output) % len(source)]
        else:
            token = _next_token(vocab, source, output, sampling)
        output.append(token)
        text = vocab.decode(output)
        if token in stops:
            texts.append(vocab.decode(output[:-1]))
            finish = {"type": "stop", "matched": token}
            break
        for s in stop:
            at = text.find(s)
            if at >= 0:
                text = text[:at].rstrip() if not vocab.real else text[:at]
                finish = {"type": "stop", "matched": s}
                break
        if finish is None:
            finish = next(({"type": "stop", "matched": p} for p in stop_regex if re.search(p, text)), None)
        texts.append(text)
    return Generation(list(prompt_ids), output, texts, finish, 0, seed)


def constrained(vocab: Vocab, prompt_ids: list[int], text: str, max_new_tokens: int | None, stop: list[str],
                stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> Generation:
    """A constrained decoding's generation: the tokens of ``text`` (the output its grammar allows, see
    :mod:`.constrained`), then EOS once the grammar is done; ``max_new_tokens``, stop strings and stop tokens cut it
    as they cut any generation. With ``ignore_eos`` (and ``max_new_tokens``), the EOS the finished grammar allows
    does not end it: EOS tokens (no text) until the limit, finish ``length``, as the real engine's.
    Each text is an exact prefix of ``text``."""
    seed = prompt_seed(prompt_ids)
    pieces = vocab.split(text)
    limit = len(pieces) + 1 if max_new_tokens is None else max_new_tokens
    output: list[int] = []
    texts: list[str] = []
    finish: dict[str, Any] | None = None
    stops = set(stop_token_ids)
    for token, end in pieces:
        if len(output) >= limit:
            finish = {"type": "length", "length": limit}
            break
        output.append(token)
        if token in stops:
            texts.append(texts[-1] if texts else "")
            finish = {"type": "stop", "matched": token}
            break
        done = text[:end]
        matched = next(((done.find(s), s) for s in stop if s in done), None)
        if matched is not None:
            texts.append(done[:matched[0]])
            finish = {"type": "stop", "matched": matched[1]}
            break
        texts.append(done)
    if finish is None:
        if len(output) >= limit:
            finish = {"type": "length", "length": limit}
        elif ignore_eos and max_new_tokens is not None:
            while len(output) < limit:
                output.append(vocab.eos_token_id)
                texts.append(texts[-1] if texts else "")
            finish = {"type": "length", "length": limit}
        else:
            output.append(vocab.eos_token_id)
            texts.append(texts[-1] if texts else "")
            finish = {"type": "stop", "matched": vocab.eos_token_id}
    return Generation(list(prompt_ids), output, texts, finish, 0, seed)


# ---------------------------------------------------------------------------------------------- logprobs


def _logprob(seed: int, position: int, token: int) -> float:
    return -round(0.05 + zlib.crc32(f"{seed}:{position}:{token}".encode()) % 8000 / 1000, 6)


def top_candidates(vocab: Vocab, seed: int, position: int, chosen: int, k: int) -> list[tuple[float, int]]:
    """``k`` (logprob, token) pairs of one position, best first: the chosen token, then others below it."""
    best = _logprob(seed, position, chosen)
    out = [(best, chosen)]
    probe = zlib.crc32(f"{seed}:{position}:alt".encode())
    seen = {chosen}
    while len(out) < k and len(seen) < vocab.vocab_size:
        probe = (probe * 1103515245 + 12345) & 0x7FFFFFFF
        token = probe % vocab.vocab_size
        if token in seen:
            continue
        seen.add(token)
        out.append((round(best - 0.25 * len(out) - (probe % 97) / 1000, 6), token))
    return out


@dataclass
class Logprobs:
    """sglang's ``meta_info`` logprob fields of one generation."""

    input_token: list[list[Any]]
    output_token: list[list[Any]]
    input_top: list[Any]
    output_top: list[Any]


def logprobs(vocab: Vocab, gen: Generation, *, start_len: int, top_n: int, with_text: bool,
             input_side: bool = True) -> Logprobs:
    """The logprobs of ``gen``: ``[logprob, token_id, text_or_null]`` per token, from prompt position
    ``start_len`` (-1: none of the prompt; the first reported prompt token's logprob is null); ``top_n`` alternatives
    per position when > 0; ``input_side=False`` (a decode node in PD) has no prompt logprobs at all."""

    def entry(lp: float | None, token: int) -> list[Any]:
        return [lp, token, vocab.piece(token) if with_text else None]

    prompt = gen.prompt_ids
    input_token: list[list[Any]] = []
    input_top: list[Any] = []
    if input_side and start_len >= 0:
        first = min(start_len, len(prompt))
        for pos in range(first, len(prompt)):
            token = prompt[pos]
            if pos == first:  # sglang has no logprob for the first position it reports
                input_token.append(entry(None, token))
                input_top.append(None)
                continue
            input_token.append(entry(_logprob(gen.seed, pos, token), token))
            input_top.append([entry(lp, t) for lp, t in top_candidates(vocab, gen.seed, pos, token, top_n)])
    output_token, output_top = [], []
    for k, token in enumerate(gen.output_ids):
        pos = len(prompt) + k
        output_token.append(entry(_logprob(gen.seed, pos, token), token))
        output_top.append([entry(lp, t) for lp, t in top_candidates(vocab, gen.seed, pos, token, top_n)])
    return Logprobs(input_token, output_token, input_top, output_top)


def token_ids_logprobs(gen: Generation, token_ids: Sequence[int], start_len: int) -> tuple[list[Any], list[Any]]:
    """sglang's ``token_ids_logprob``: for each reported prompt position (from ``start_len``; -1: none) and each
    generated token, ``[logprob, token_id, null]`` of every asked token id."""
    prompt = gen.prompt_ids
    first = len(prompt) if start_len < 0 else min(start_len, len(prompt))
    inputs = [[[_logprob(gen.seed, pos, t), t, None] for t in token_ids] for pos in range(first, len(prompt))]
    outputs = [[[_logprob(gen.seed, len(prompt) + k, t), t, None] for t in token_ids]
               for k in range(len(gen.output_ids))]
    return inputs, outputs


def openai_chat_logprob(vocab: Vocab, gen: Generation, index: int, top_n: int) -> dict[str, Any]:
    """One entry of an OpenAI chat ``logprobs.content`` list."""
    token = gen.output_ids[index]
    pos = gen.prompt_tokens + index
    text = vocab.piece(token)

    def item(lp: float, t: int) -> dict[str, Any]:
        piece = vocab.piece(t)
        return {"token": piece, "bytes": list(piece.encode("utf-8")), "logprob": lp}

    tops = top_candidates(vocab, gen.seed, pos, token, top_n) if top_n > 0 else []
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": _logprob(gen.seed, pos, token),
            "top_logprobs": [item(lp, t) for lp, t in tops]}


def openai_completion_logprobs(vocab: Vocab, gen: Generation, top_n: int, *, echo: bool,
                               indices: Sequence[int] | None = None) -> dict[str, Any]:
    """An OpenAI completions ``logprobs`` object (``echo``: the prompt's tokens first, the first one null)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[Any] = []
    if echo:
        for pos, token in enumerate(gen.prompt_ids):
            tokens.append(vocab.piece(token))
            values.append(None if pos == 0 else _logprob(gen.seed, pos, token))
            if top_n > 0:
                tops.append(None if pos == 0 else {vocab.piece(t): lp for lp, t in
                                                   top_candidates(vocab, gen.seed, pos, token, top_n)})
    for k in indices if indices is not None else range(len(gen.output_ids)):
        token = gen.output_ids[k]
        pos = gen.prompt_tokens + k
        tokens.append(vocab.piece(token))
        values.append(_logprob(gen.seed, pos, token))
        if top_n > 0:
            tops.append({vocab.piece(t): lp for lp, t in top_candidates(vocab, gen.seed, pos, token, top_n)})
    return {"text_offset": [-1] * len(tokens), "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def label_scores(seed: int, labels: Sequence[int], softmax: bool) -> list[float]:
    """``/v1/score``: the probability of each label token after one query/item pair."""
    values = [math.exp(_logprob(seed, 0, t)) for t in labels]
    if softmax and values:
        total = sum(values)
        values = [v / total for v in values]
    return values


# ---------------------------------------------------------------------------------------------- embeddings


def embedding(ids: Sequence[int], size: int) -> list[float]:
    """A deterministic unit vector of ``size`` floats for a prompt."""
    seed = prompt_seed(ids)
    raw = [((zlib.crc32(f"{seed}:{i}".encode()) % 20001) - 10000) / 10000 for i in range(size)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def embedding_base64(vector: Sequence[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
