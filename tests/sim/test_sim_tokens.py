"""How the simulated engine counts tokens: with the model's own tokenizer whenever it finds one (the
``--tokenizer-path`` or ``--model-path`` directory, the local Hugging Face cache), else with its fallback, which it
announces once in its log and whose count grows with the text's length. Real subprocesses, every wait bounded by a
deadline, nothing left running."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sim_procs import CI_ARGS, MODEL, TINY, Launcher

from pytest_sglworker.sim.vocab import Vocab, find_tokenizer, load_model_dir

#: The tiny Llama's own ids of "hello world" (what the real engine's /tokenize answers for it).
HELLO_WORLD = [460, 377]
FALLBACK = "(sim) counting tokens without the model's tokenizer: "


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.cleanup()


def _needs_tokenizers() -> None:
    pytest.importorskip("tokenizers", reason="the model's tokenizer is read with the tokenizers package")


def test_the_fallback_counts_long_words_by_pieces() -> None:
    vocab = Vocab(151_936, 2)
    assert len(vocab.encode("alpha beta gamma")) == 3  # a word of up to 8 characters is one token
    assert len(vocab.encode("x" * 20)) == 5 and len(vocab.encode("x" * 512 * 1024)) == 131_072  # 4 characters each
    text = "supercalifragilistic is a word"
    assert vocab.decode(vocab.encode(text)) == text  # the pieces of a word join without spaces
    ids = vocab.encode("internationalization")
    assert [vocab.token_text(t, i) for i, t in enumerate(ids)] == ["inte", "rnat", "iona", "liza", "tion"]
    # a constrained output's pieces give its text back exactly, its spacing included
    odd = '{"a":  [1, "lengthy-string"]}  '
    ends = [end for _, end in vocab.split(odd)]
    assert ends[-1] == len(odd) and ends == sorted(ends) and len(ends) >= 4


def test_the_fallback_is_announced_once_and_a_big_payload_counts_as_big(launch: Launcher) -> None:
    sim = launch(*CI_ARGS, "--skip-server-warmup")  # a hub id this machine has not cached (the launcher's env)
    sim.wait_ready()
    log = sim.log()
    assert log.count(FALLBACK) == 1
    assert (f"{FALLBACK}no tokenizer.json for {MODEL} (the model is not a local directory and not in the Hugging "
            "Face cache); the fallback counts a token per whitespace-separated word of up to 8 characters, a token "
            "per 4 characters of a longer one") in log
    assert sim.client.post("/tokenize", json={"prompt": "y" * 2000}).json()["count"] == 500
    r = sim.client.post("/generate", json={"text": "x" * 512 * 1024, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("The input (131072 tokens) is longer than the model's context")
    sim.client.post("/generate", json={"text": "x y", "sampling_params": {"max_new_tokens": 1}})
    assert sim.log().count(FALLBACK) == 1  # said once, at startup, not per request


def test_a_hub_id_in_the_local_hugging_face_cache_is_tokenized_for_real(launch: Launcher, tmp_path: Path) -> None:
    _needs_tokenizers()
    repo = tmp_path / "hf" / "models--sim-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    shutil.copy(Path(TINY) / "tokenizer.json", snapshot / "tokenizer.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    sim = launch(*CI_ARGS, "--skip-server-warmup", model="sim-org/tiny-llama",
                 env={"HF_HUB_CACHE": str(tmp_path / "hf")})
    sim.wait_ready()
    assert sim.client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"] == HELLO_WORLD
    assert FALLBACK not in sim.log()


def test_tokenizer_path_is_the_tokenizer(launch: Launcher) -> None:
    _needs_tokenizers()
    assert find_tokenizer(MODEL, TINY) == Path(TINY) / "tokenizer.json"
    sim = launch(*CI_ARGS, "--skip-server-warmup", "--tokenizer-path", TINY)
    sim.wait_ready()
    assert sim.client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"] == HELLO_WORLD
    assert FALLBACK not in sim.log()


def test_without_the_tokenizers_package_the_sim_says_so(launch: Launcher, tmp_path: Path) -> None:
    blocker = tmp_path / "blocked" / "tokenizers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('tokenizers is blocked by the test')\n")
    path = os.pathsep.join(p for p in (str(blocker.parent), os.environ.get("PYTHONPATH", "")) if p)
    sim = launch(*CI_ARGS, "--skip-server-warmup", model=TINY, env={"PYTHONPATH": path})
    sim.wait_ready()
    assert (f"{FALLBACK}the tokenizers package is not installed (pip install 'pytest-sglworker[sim]'), so "
            f"{TINY}/tokenizer.json is not read") in sim.log()
    assert sim.client.post("/tokenize", json={"prompt": "hello world"}).json()["count"] == 2
    # the model directory's other facts still hold
    assert sim.client.get("/v1/models").json()["data"][0]["max_model_len"] == 512


def test_a_model_directory_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    shutil.copy(Path(TINY) / "config.json", tmp_path / "config.json")
    model = load_model_dir(str(tmp_path), vocab_size=1000, eos_token_id=2)
    assert not model.vocab.real and model.context_len == 512
    assert model.tokenizer_note == f"no tokenizer.json for {tmp_path} (the model directory has none)"
