"""The prefix cache (constrain.decode.kv.PrefixCache): bounded in bytes, least recently used dropped, reported."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import constrain
from constrain.decode import kv
from constrain.decode.kv import (
    MIN_PREFIX,
    PREFIX_CACHE_CAP,
    PrefixCache,
    default_prefix_cache_bytes,
    device_memory,
    kv_bytes_per_token,
)

LAYERS, HEADS, HEAD_DIM = 2, 2, 4
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 4
"""KV bytes a token takes in :func:`_batch`'s caches: keys and values, every layer, float32 (128)."""


def _batch(prompts: list[list[int]]) -> DynamicCache:
    """A prefilled batch's cache, left-padded to the longest prompt: at each kept position, every key
    entry holds the token id plus the layer, every value entry its negation (padding: NaN)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), float("nan"))  # [n, width]
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.float32)
    cache = DynamicCache()
    for layer in range(LAYERS):
        keys = (ids + layer)[:, None, :, None].expand(-1, HEADS, -1, HEAD_DIM).contiguous()  # [n, heads, width, dim]
        cache.update(keys, -keys, layer)
    return cache


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _prompt(first: int, length: int = 40) -> list[int]:
    return list(range(first, first + length))


def _stats() -> dict[str, int]:
    return constrain.cache_stats()["caches"]["decode.kv.prefix_cache"]


def test_the_bound_is_in_bytes_and_the_least_recently_used_go_first():
    prefixes = PrefixCache(max_bytes=3 * 40 * TOKEN_BYTES)  # room for three prompts of 40 tokens
    prompts = [_prompt(1000 * k) for k in range(6)]
    for k, prompt in enumerate(prompts):
        prefixes.add([prompt], _batch([prompt]))
        assert prefixes.nbytes == min(k + 1, 3) * 40 * TOKEN_BYTES <= prefixes.max_bytes
        if k in (2, 4):
            assert prefixes.match(prompts[0] + [7]) == 40
            prefixes.cache(prompts[0] + [7], 40)  # prompt 0 becomes the most recently used
    assert len(prefixes) == 3
    # kept in use, prompt 0 outlives 1, 2 and 3, dropped in turn as 3, 4 and 5 came (first in, first out: 3, 4, 5)
    assert [prefixes.match([*p, 7]) for p in prompts] == [40, 0, 0, 0, 40, 40]


def test_the_bytes_counted_are_the_tensors_kept():
    prefixes = PrefixCache(max_bytes=1 << 20)
    prompts = [_prompt(0, 30), _prompt(500, 50)]  # one batch, the shorter left-padded
    prefixes.add(prompts, _batch(prompts))
    kept = [tensor for entry in prefixes._entries.values() for pair in entry for tensor in pair]
    assert prefixes.nbytes == sum(t.nelement() * t.element_size() for t in kept) == 80 * TOKEN_BYTES


def test_an_entry_larger_than_the_bound_is_not_kept():
    prefixes = PrefixCache(max_bytes=40 * TOKEN_BYTES - 1)
    small, large = _prompt(0, 39), _prompt(100, 40)
    prefixes.add([small, large], _batch([small, large]))
    assert len(prefixes) == 1 and prefixes.nbytes == 39 * TOKEN_BYTES
    assert prefixes.match([*large, 1]) == 0 and prefixes.match([*small, 1]) == 39
    nothing = PrefixCache(max_bytes=0)
    nothing.add([large], _batch([large]))
    assert len(nothing) == 0 and nothing.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)


def test_a_prompt_too_short_to_ever_match_is_not_kept():
    prefixes = PrefixCache(max_bytes=1 << 20)
    short = _prompt(0, MIN_PREFIX - 1)
    prefixes.add([short], _batch([short]))
    assert len(prefixes) == 0 and prefixes.nbytes == 0


def test_match_and_cache_give_the_prefix_rows():
    prefixes = PrefixCache(max_bytes=1 << 20)
    prompts = [_prompt(0, 20), _prompt(300, 45)]
    prefixes.add(prompts, _batch(prompts))
    asked = [*prompts[0][:18], 999, 998]  # shares 18 tokens with the shorter (left-padded) prompt
    length = prefixes.match(asked)
    assert length == 18
    past = prefixes.cache(asked, length)
    assert past.get_seq_length() == 18
    for layer in range(LAYERS):
        expected = torch.tensor(prompts[0][:18], dtype=torch.float32) + layer  # no padding: the row's own tokens
        keys, values = past.layers[layer].keys, past.layers[layer].values  # [1, heads, 18, dim]
        assert keys.shape == (1, HEADS, 18, HEAD_DIM)
        torch.testing.assert_close(keys, expected[None, None, :, None].expand(1, HEADS, 18, HEAD_DIM))
        torch.testing.assert_close(values, -keys)
    assert prefixes.match(prompts[1]) == 44  # all but the last token
    assert prefixes.match(_prompt(5000)) == 0
    assert (prefixes.hits, prefixes.misses) == (2, 1)


def test_the_default_is_sized_to_the_machine(monkeypatch):
    memory = device_memory()
    if hasattr(os, "sysconf"):
        assert memory is not None and 0 < memory <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert PrefixCache().max_bytes == default_prefix_cache_bytes() > 0
    for found, expected in [(4 << 30, int(0.05 * (4 << 30))), (100 << 30, PREFIX_CACHE_CAP), (None, PREFIX_CACHE_CAP)]:
        monkeypatch.setattr(kv, "device_memory", lambda device=None, found=found: found)
        assert default_prefix_cache_bytes() == expected
        assert PrefixCache().max_bytes == expected
    assert int(0.05 * (4 << 30)) == 214_748_364  # 5% of a 4 GiB machine, under the 512 MiB cap


def test_kv_bytes_per_token_is_the_kv_a_forward_keeps():
    smollm2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(smollm2) == 46_080  # 2 * 30 layers * 3 heads * 64 dims * 4 bytes
    assert kv_bytes_per_token(smollm2, torch.bfloat16) == 23_040
    model = _tiny_llama()
    with torch.inference_mode():
        out = model(input_ids=torch.arange(10)[None], use_cache=True)
    layers = out.past_key_values.layers
    kept = sum(t.nelement() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(model) == kept / 10 == 256
    assert kv_bytes_per_token(model.to(torch.bfloat16)) == 128  # the parameters' dtype


def test_the_prefix_caches_are_reported_together_and_go_with_their_owners():
    gc.collect()
    before = _stats()
    assert {"entries", "bytes", "max_bytes", "maxsize", "hits", "misses", "instances"} <= set(before)
    prefixes = PrefixCache(max_bytes=1 << 20)
    prompt = _prompt(0, 30)
    prefixes.add([prompt], _batch([prompt]))
    prefixes.match(prompt)
    during = _stats()
    assert during["instances"] == before["instances"] + 1
    assert during["entries"] == before["entries"] + 1
    assert during["bytes"] == before["bytes"] + 30 * TOKEN_BYTES > 0
    assert during["max_bytes"] == before["max_bytes"] + (1 << 20)
    assert during["hits"] == before["hits"] + 1
    del prefixes
    gc.collect()
    after = _stats()
    assert (after["instances"], after["entries"], after["bytes"]) == (
        before["instances"], before["entries"], before["bytes"]
    )  # fmt: skip
    assert 0 < after["maxsize"]


def test_a_growing_cache_gives_the_dynamic_cache_s_logits_and_appends_in_place(monkeypatch):
    """Decode steps, a crop of rejected drafts, a row selection and a merge: the same logits (bitwise) as
    transformers' own layers, with the keys written into the same buffer from step to step until it is full;
    the model's own caches stay transformers'."""
    model = _tiny_llama()
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(0))

    def run(grow: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        logits: list[torch.Tensor] = []
        buffers: list[torch.Tensor | None] = []  # each step's first layer's key buffer (None: none), kept alive
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            cache = kv.growing(out.cache) if grow else out.cache
            mask = torch.ones(3, 5, dtype=torch.long)
            for step in range(80):  # past the first buffer's room (5 + 64 tokens)
                width = 3 if step % 7 == 0 else 1  # drafts, two of them rejected below
                feed = torch.full((len(mask), width), step % 64)
                mask = torch.cat([mask, torch.ones(len(mask), width, dtype=torch.long)], dim=1)
                positions = mask.sum(-1, keepdim=True) - width + torch.arange(width)
                out = model(input_ids=feed, attention_mask=mask, position_ids=positions, cache=cache)
                logits.append(out.logits)
                held = getattr(cache.layers[0], "_buffers", None)
                buffers.append(None if held is None else held[0])
                if width > 1:
                    cache.crop(-2)
                    mask = mask[:, :-2]
                if step == 30:  # a row leaves
                    cache.batch_select_indices(torch.tensor([0, 2]))
                    mask = mask[[0, 2]]
                if step == 50:  # a row joins
                    joining = model(input_ids=ids[:1, :4], use_cache=True).cache
                    mask = kv.merge_rows(cache, mask, joining, torch.ones(1, 4, dtype=torch.long))
        return logits, buffers

    expected, _ = run(grow=False)
    _, unbuffered = run(grow=True)  # 3 rows of 5 to 85 tokens: fewer than GROW_FROM, concatenated
    monkeypatch.setattr(kv, "GROW_FROM", 0)
    got, buffers = run(grow=True)
    assert all(b is None for b in unbuffered)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(b is not None for b in buffers)
    assert len({id(b) for b in buffers}) <= 5  # a buffer per growth, selection and merge, not one per step
    assert not any(type(layer) is kv.GrowingLayer for layer in model(input_ids=ids, use_cache=True).cache.layers)
    with torch.inference_mode():
        assert kv.mergeable(kv.growing(model(input_ids=ids, use_cache=True).cache))
