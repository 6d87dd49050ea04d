"""The simulated engine's tokenizer and what a model directory says: the model's own tokenizer whenever one can be
found, else the sim's fallback, and the chat prompt.

Part of :mod:`pytest_sglworker.sim`; stdlib only at import (``tokenizers`` is imported when a ``tokenizer.json`` is
found). Where the tokenizer comes from (:func:`find_tokenizer`), in order: ``--tokenizer-path`` when it is a
directory, the ``--model-path`` directory, then the local Hugging Face cache for a hub id (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; the snapshot ``refs/main`` names, else any snapshot with a
``tokenizer.json``). With one and the ``tokenizers`` package, token counts, ``output_ids``, ``/tokenize`` and the
chat template's tokens are the real engine's.

Without (no ``tokenizer.json`` for the model, no ``tokenizers`` package, or a file it cannot read) the sim says
why once in its log (:attr:`ModelDir.tokenizer_note`) and counts with :class:`Vocab`: whitespace-separated words,
a word of up to 8 characters one token, a longer one a token per 4 characters (so a payload's count grows with
its length, about like a BPE tokenizer's: a 512 KiB string without spaces is 131,072 tokens, not 1). Token ids
are ``crc32(piece) % vocab_size``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The fallback's longest one-token word; a longer word is cut into pieces of :data:`PIECE_CHARS` characters.
WORD_CHARS = 8
PIECE_CHARS = 4
#: How the fallback counts, for the log line that announces it.
FALLBACK_RULE = (f"a token per whitespace-separated word of up to {WORD_CHARS} characters, a token per "
                 f"{PIECE_CHARS} characters of a longer one")


class Vocab:
    """The fallback tokenizer (see the module docstring): ids it has not seen decode as ``tok<id>``; the pieces
    of a long word after its first decode without a space before them."""

    real = False

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self.vocab_size = max(int(vocab_size), 2)
        self.eos_token_id = eos_token_id
        self.special_ids: frozenset[int] = frozenset({eos_token_id})
        self._words: dict[int, str] = {}
        #: ids of the pieces that continue a word (decoded without a space before them)
        self._joined: set[int] = set()

    def _id(self, piece: str, joined: bool) -> int:
        token = zlib.crc32((("##" if joined else "") + piece).encode()) % self.vocab_size
        self._words.setdefault(token, piece)
        if joined:
            self._joined.add(token)
        return token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in text.split():
            if len(word) <= WORD_CHARS:
                ids.append(self._id(word, False))
                continue
            for at in range(0, len(word), PIECE_CHARS):
                ids.append(self._id(word[at:at + PIECE_CHARS], at > 0))
        return ids

    def piece(self, token: int) -> str:
        return self._words.get(token, f"tok{token}")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        for token in ids:
            if skip_special_tokens and token in self.special_ids:
                continue
            if out and token not in self._joined:
                out.append(" ")
            out.append(self.piece(token))
        return "".join(out)

    def token_text(self, token: int, index: int) -> str:
        """The text a streamed token adds (a space before every word but the first)."""
        return self.piece(token) if index == 0 or token in self._joined else " " + self.piece(token)

    def split(self, text: str) -> list[tuple[int, int]]:
        """``text`` as tokens whose pieces, concatenated, give it back exactly (a constrained output, whatever its
        spacing): ``(token, end)`` per token, ``end`` the offset in ``text`` where its piece ends. Counted as
        :meth:`encode` counts; a piece keeps the whitespace before it."""
        out: list[tuple[int, int]] = []
        for match in re.finditer(r"\s*\S+|\s+", text):
            start, end = match.span()
            word_at = start + len(match.group()) - len(match.group().lstrip())
            cuts = [end] if end - word_at <= WORD_CHARS else [*range(word_at + PIECE_CHARS, end, PIECE_CHARS), end]
            for cut in cuts:
                piece = text[start:cut]
                token = zlib.crc32(("@@" + piece).encode()) % self.vocab_size
                self._words.setdefault(token, piece)
                out.append((token, cut))
                start = cut
        return out


class HFVocab(Vocab):
    """The model's ``tokenizer.json`` through the ``tokenizers`` package."""

    real = True

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        super().__init__(vocab_size, eos_token_id)
        self.tokenizer = tokenizer
        specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if getattr(t, "special", False)}
        self.special_ids = frozenset(specials | {eos_token_id})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def piece(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int, index: int) -> str:
        return self.piece(token)

    def split(self, text: str) -> list[tuple[int, int]]:
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ends, reach = [], 0
        for _, end in encoding.offsets:  # never backwards; the last token ends the text (a normalizer may drop
            reach = max(reach, int(end))  # trailing whitespace from the offsets)
            ends.append(reach)
        if ends:
            ends[-1] = len(text)
        return [(int(token), end) for token, end in zip(encoding.ids, ends, strict=True)]


@dataclass(frozen=True)
class ModelDir:
    """What a local model directory says (``config.json``, the tokenizer, the chat template);
    ``tokenizer_note``: why the sim counts with its fallback (None when it has the model's tokenizer)."""

    vocab: Vocab
    context_len: int | None
    hidden_size: int | None
    architecture: str | None
    model_type: str | None
    chat_template: str | None
    config: dict[str, Any] | None
    tokenizer_note: str | None = None


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def hub_snapshot(model_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of ``model_id`` (``org/name``) that has a ``tokenizer.json``."""
    if model_id.count("/") != 1 or model_id.startswith(("/", ".")):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    repo = Path(hub) / ("models--" + model_id.replace("/", "--"))
    try:
        ref = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        ref = ""
    candidates = [repo / "snapshots" / ref] if ref else []
    try:
        candidates += sorted((repo / "snapshots").iterdir())
    except OSError:
        pass
    return next((c for c in candidates if (c / "tokenizer.json").is_file()), None)


def find_tokenizer(model_path: str, tokenizer_path: str | None = None) -> Path | None:
    """The ``tokenizer.json`` the real engine would load for these flags, when it is on this machine."""
    for folder in (tokenizer_path, model_path):
        if folder and (Path(folder) / "tokenizer.json").is_file():
            return Path(folder) / "tokenizer.json"
    for name in (tokenizer_path, model_path):
        snapshot = hub_snapshot(name) if name and not Path(name).exists() else None
        if snapshot is not None:
            return snapshot / "tokenizer.json"
    return None


def _load_vocab(path: Path | None, model: str, vocab_n: int, eos: int, sized: bool) -> tuple[Vocab, str | None]:
    """The model's tokenizer, else the fallback and why (``sized``: ``vocab_n`` comes from the model's config)."""
    if path is None:
        where = "the model is not a local directory and not in the Hugging Face cache" if not Path(model).is_dir() \
            else "the model directory has none"
        return Vocab(vocab_n, eos), f"no tokenizer.json for {model} ({where})"
    try:
        tokenizers = importlib.import_module("tokenizers")
    except ImportError:
        return Vocab(vocab_n, eos), (f"the tokenizers package is not installed (pip install "
                                     f"'pytest-sglworker[sim]'), so {path} is not read")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # a file it cannot read
        return Vocab(vocab_n, eos), f"tokenizers cannot read {path}: {exc}"
    if not sized:
        vocab_n = max(vocab_n, int(tokenizer.get_vocab_size(with_added_tokens=True)))
    return HFVocab(tokenizer, vocab_n, eos), None


def load_model_dir(model_path: str, *, vocab_size: int, eos_token_id: int,
                   tokenizer_path: str | None = None) -> ModelDir:
    """The tokenizer and facts of ``model_path`` (the defaults given when it is not a directory)."""
    folder = Path(model_path)
    config = _read_json(folder / "config.json") if folder.is_dir() else None
    text_config = config.get("text_config") if config and isinstance(config.get("text_config"), dict) else None
    source = text_config or config or {}
    vocab_n = _first_int(source.get("vocab_size")) or vocab_size
    eos = _first_int(source.get("eos_token_id") if config else None)
    generation = _read_json(folder / "generation_config.json") if config else None
    if eos is None and generation:
        eos = _first_int(generation.get("eos_token_id"))
    eos = eos if eos is not None else eos_token_id
    vocab, note = _load_vocab(find_tokenizer(model_path, tokenizer_path), model_path, vocab_n, eos,
                              sized=_first_int(source.get("vocab_size")) is not None)
    template = None
    if config is not None:
        tok_config = _read_json(folder / "tokenizer_config.json") or {}
        template = tok_config.get("chat_template") if isinstance(tok_config.get("chat_template"), str) else None
        if template is None and (folder / "chat_template.jinja").is_file():
            try:
                template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
            except OSError:
                template = None
    architectures = source.get("architectures") or (config or {}).get("architectures")
    return ModelDir(
        vocab=vocab,
        context_len=_first_int(source.get("max_position_embeddings")),
        hidden_size=_first_int(source.get("hidden_size")),
        architecture=architectures[0] if isinstance(architectures, list) and architectures else None,
        model_type=source.get("model_type") if isinstance(source.get("model_type"), str) else None,
        chat_template=template,
        config=config,
        tokenizer_note=note,
    )


def render_chat(messages: list[dict[str, Any]], template: str | None) -> str:
    """The prompt a chat template makes of ``messages``, with the generation prompt: ChatML when the template is
    ChatML, Llama 3's headers when it is that, else plain ``role: content`` lines (the sim does not run Jinja)."""
    parts = [(str(m.get("role", "")), message_text(m)) for m in messages]
    if template and "<|im_start|>" in template:
        return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in parts) + "<|im_start|>assistant\n"
    if template and "<|start_header_id|>" in template:
        body = "".join(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>" for role, text in parts)
        return "<|begin_of_text|>" + body + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    return "".join(f"{role}: {text}\n" for role, text in parts) + "assistant:"


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text (the text parts of a list content, joined by spaces)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
