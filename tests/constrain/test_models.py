"""Model loading: the packaged default (GGUF, converted once and cached), pairs, and clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import constrain
from constrain.models import ModelNotFoundError, cache_dir


def test_default_model_loads_and_runs():
    handle = constrain.load_model()
    assert handle.vocab_size == 49152 == len(handle.tokenizer)
    eos = handle.tokenizer.convert_ids_to_tokens(list(handle.eos_token_ids))
    assert "<|im_end|>" in eos and "<|endoftext|>" in eos
    ids = handle.tokenizer.encode("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = handle.model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    assert any((cache_dir() / "models").glob("SmolLM2-135M-Instruct*/model.safetensors"))
    again = constrain.load_model("smollm2-135m-instruct")  # from the converted cache
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, logits)


def test_a_model_tokenizer_pair(smol_tokenizer):
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    handle = constrain.load_model((LlamaForCausalLM(config), smol_tokenizer))
    assert handle.eos_token_ids[0] == 2 and not handle.model.training


def test_missing_models_say_what_to_do():
    with pytest.raises(ValueError, match="unknown packaged model"):
        constrain.models.gguf_path("gpt-5")
    with pytest.raises(ModelNotFoundError, match="neither a packaged model"):
        constrain.load_model("/nowhere/model.bin")
    with pytest.raises(ValueError, match="pair"):
        constrain.load_model((1, 2, 3))
