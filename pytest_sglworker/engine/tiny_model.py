"""Write a tiny random-weight Llama with a ChatML tokenizer: the model the real-engine tests serve on a CPU.

Usage: ``<real-engine python> tiny_model.py OUT_DIR``. A standalone script (it imports nothing from
pytest_sglworker), because it runs in the real-engine venv, which has torch, transformers and tokenizers
but not this package; :func:`pytest_sglworker.engine.cpu_engine.build_tiny_model` runs it there.

The model: LlamaForCausalLM, 2 layers, hidden 64, 4 attention heads (2 KV heads, head_dim 16), vocab 512,
bf16, about 320 KB; a byte-level BPE tokenizer trained on a fixed corpus with the ChatML specials
``<|endoftext|>`` (bos/pad), ``<|im_start|>``, ``<|im_end|>`` (eos) and a ChatML chat template. Weights
come from ``torch.manual_seed(0)``: the same recipe gives the same files.

Idempotent: a finished build leaves a marker file (written last) naming the recipe; when ``config.json``
and a matching marker are there, nothing is done. Files are written to a temporary folder beside OUT_DIR
and moved in one by one, so concurrent builders of the same folder do not see half-written files.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Names the recipe. Change it whenever the output would change, so that old builds get rebuilt.
RECIPE = "tiny-llama-chatml/1 vocab=512 hidden=64 inter=128 layers=2 heads=4 kv=2 head_dim=16 bf16 seed=0"
MARKER = ".sglworker-tiny-model"

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _module(name: str) -> Any:
    # Imported by name: these live only in the real-engine venv, and the type checker of the dev venv
    # need not know them.
    return importlib.import_module(name)


def is_built(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a finished build of this recipe."""
    marker = out_dir / MARKER
    try:
        return (out_dir / "config.json").is_file() and marker.read_text(encoding="utf-8").strip() == RECIPE
    except OSError:
        return False


_CORPUS_WORDS = """
hello world the quick brown fox jumps over the lazy dog . The capital city of France is Paris .
user assistant system you are a helpful model answer briefly yes no one two three four five
what is it a test of the server , please say something ! ? 0 1 2 3 4 5 6 7 8 9
"""


def _corpus() -> list[str]:
    words = _CORPUS_WORDS.split()
    lines = []
    for i in range(400):
        # A fixed, varied corpus: rotations of the word list, so the BPE merges are deterministic.
        k = (i * 7) % len(words)
        lines.append(" ".join(words[k:] + words[:k]) + f" {i}.")
    return lines


def _write(tmp: Path) -> None:
    torch = _module("torch")
    tokenizers = _module("tokenizers")
    transformers = _module("transformers")
    transformers.utils.logging.disable_progress_bar()

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    config.dtype = "bfloat16"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp)


def build(out_dir: Path) -> Path:
    """Build the model into ``out_dir`` unless a finished build of this recipe is there."""
    out_dir = Path(out_dir).absolute()
    if is_built(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write(tmp)
        out_dir.mkdir(exist_ok=True)
        (out_dir / MARKER).unlink(missing_ok=True)
        for item in sorted(tmp.iterdir()):
            if item.is_file():
                item.chmod(0o644)
                os.replace(item, out_dir / item.name)
        marker_tmp = tmp / MARKER
        marker_tmp.write_text(RECIPE + "\n", encoding="utf-8")
        os.replace(marker_tmp, out_dir / MARKER)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: python {Path(__file__).name} OUT_DIR", file=sys.stderr)
        return 2
    print(build(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
