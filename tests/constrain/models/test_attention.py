"""The attention load_model runs: transformers' SDPA without copies of the grouped key/value heads on a CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import sdpa_attention

import constrain
from constrain.models.attention import GROUPED_SDPA, use_grouped_sdpa


def _tiny_llama(dtype=torch.float32, attention="sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attention)  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def _block_pass(model):
    """A prefill with left padding, then a pass of 3 tokens per row with a hole in the mask (a rejected draft),
    as the decode loop feeds drafts: the block's logits, ``[2, 3, V]``."""
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with torch.inference_mode():
        cache = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                      use_cache=True).cache  # fmt: skip
        mask = torch.cat([mask, torch.tensor([[1, 1, 1], [1, 1, 1]])], dim=1)  # [2, 9]
        mask[0, 4] = 0
        positions = mask[:, :6].sum(-1, keepdim=True) + torch.arange(3)  # [2, 3]
        return model(input_ids=ids[:, :3], attention_mask=mask, position_ids=positions, cache=cache).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_gives_sdpa_s_logits_without_copying_heads(dtype, monkeypatch):
    plain = _tiny_llama(dtype)
    grouped = copy.deepcopy(plain)
    assert use_grouped_sdpa(grouped) and grouped.config._attn_implementation == GROUPED_SDPA
    expected = _block_pass(plain)
    copies = []
    repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: copies.append(h.shape) or repeat(h, n))
    got = _block_pass(grouped)
    assert not copies  # the padded prefill and the block ran on grouped heads
    assert torch.equal(got, expected)  # the same kernel on the same numbers
    _block_pass(plain)
    assert len(copies) == 2 * 2 * 2  # sdpa copies keys and values in each of the 2 layers, in both passes


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_equals_attention_over_copied_heads(tokens, dtype):
    """With a mask (left padding, a hole), one token per row or several: bitwise what SDPA gives on the key and
    value heads copied for each query head."""
    from constrain.models.attention import grouped_sdpa_attention

    generator = torch.Generator().manual_seed(2)
    query = torch.randn(3, 6, tokens, 16, generator=generator).to(dtype)  # [b, heads, q, dim]
    key, value = (torch.randn(3, 2, 40, 16, generator=generator).to(dtype) for _ in range(2))  # [b, kv_heads, k, dim]
    mask = torch.ones(3, 1, tokens, 40, dtype=torch.bool)
    mask[1, ..., :5] = False
    mask[2, ..., 30] = False
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    copied = [h.repeat_interleave(3, 1) for h in (key, value)]
    expected = torch.nn.functional.scaled_dot_product_attention(query, *copied, attn_mask=mask, scale=0.25)
    assert got.shape == (3, tokens, 6, 16) and torch.equal(got, expected.transpose(1, 2))


def test_only_sdpa_models_switch():
    eager = _tiny_llama(attention="eager")
    assert not use_grouped_sdpa(eager) and eager.config._attn_implementation == "eager"


def test_load_model_runs_grouped_attention_on_models_it_loads_only(smol_tokenizer, tmp_path):
    _tiny_llama().save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    handle = constrain.load_model(str(tmp_path))
    assert handle.model.config._attn_implementation == GROUPED_SDPA
    assert "constrain" not in handle.model.config.to_json_string()  # saved configs stay loadable elsewhere
    mine = _tiny_llama()
    assert constrain.load_model((mine, smol_tokenizer)).model.config._attn_implementation == "sdpa"
    assert constrain.load_model((mine, smol_tokenizer), prepack=True).model.config._attn_implementation == "sdpa"
