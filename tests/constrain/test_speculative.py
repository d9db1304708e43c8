"""Draft proposers: prompt lookup and a draft model, verified by the loop without changing a token."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import constrain
from constrain.generate import _expand, _run, generate
from constrain.speculative import DraftModelProposer, NgramProposer, ngram_proposal

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 6},
                   "note": {"type": "string", "maxLength": 30}},
    "required": ["items", "note"],
    "additionalProperties": False,
}  # fmt: skip


def test_ngram_proposal():
    history = [5, 1, 2, 3, 9, 9, 1, 2]
    assert ngram_proposal(history, 2) == [3, 9]  # "1 2" occurred before, followed by 3 9
    assert ngram_proposal(history, 10) == [3, 9, 9, 1, 2]
    assert ngram_proposal([1, 2, 3], 2) == []  # no earlier occurrence of any suffix
    assert ngram_proposal([7], 3) == []
    assert NgramProposer(n_max=1).propose([4, 8], [4], 3, None) == [8, 4]  # prompt and output, one history
    with pytest.raises(ValueError, match="n_max"):
        NgramProposer(n_max=0)


def _random_model(tokenizer, seed: int) -> constrain.ModelHandle:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    return constrain.load_model((LlamaForCausalLM(config), tokenizer))


def _decode(handle, specs, speculative):
    """(output ids and texts, forward passes of the target model) of one batched run."""
    requests = [r for spec in specs for r in _expand(handle, spec)]
    calls: list[int] = []
    original = handle.model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    handle.model.forward = counted
    try:
        _run(handle, requests, speculative=speculative)
    finally:
        del handle.model.forward
    return [(r.output_ids, r.text) for r in requests], len(calls)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"seed": 5}, {"seed": 2, "top_k": 20, "logprobs": 1}])
def test_draft_model_changes_no_token(tiny, smol_tokenizer, sampling):
    """Drafts from the target's own weights are the target's greedy choices (almost all accepted: far
    fewer passes); drafts from another random model are mostly rejected. Either way the tokens are
    those of plain decoding, constrained or not."""
    specs = [constrain.Request("JSON:", schema=SCHEMA, max_tokens=50, sampling=sampling),
             constrain.Request("Free text:", max_tokens=30, sampling=sampling),
             constrain.Request("Code:", regex=r"[a-z]{4}-\d{6}", sampling=sampling)]  # fmt: skip
    plain, plain_passes = _decode(tiny, specs, False)
    twin = DraftModelProposer((copy.deepcopy(tiny.model), smol_tokenizer), k=4)
    other = DraftModelProposer(_random_model(smol_tokenizer, seed=1), k=4)
    same, same_passes = _decode(tiny, specs, twin)
    mixed, _ = _decode(tiny, specs, other)
    assert same == plain and mixed == plain
    assert all(ids for ids, _ in plain)
    if sampling.get("temperature") == 0:  # the twin drafts exactly the greedy choice
        assert same_passes < 0.6 * plain_passes, (same_passes, plain_passes)


def test_draft_model_reuses_its_cache_and_obeys_the_grammar(tiny, smol_tokenizer):
    proposer = DraftModelProposer((copy.deepcopy(tiny.model), smol_tokenizer), k=3, max_cached=1)
    compiled = constrain.compile(constrain.regex(r"(ab|cd){2,5}"), smol_tokenizer)
    prompt = smol_tokenizer.encode("Letters:")
    matcher = compiled.matcher()
    drafts = proposer.propose(prompt, [], 3, matcher)
    assert drafts and compiled.matcher().accept_tokens(drafts) == len(drafts)
    seen, cache = proposer._caches[tuple(prompt)]
    assert cache.get_seq_length() == len(seen) >= len(prompt)
    proposer.propose(prompt, drafts[:1], 3, None)  # continues from the cached prefix
    assert proposer._caches[tuple(prompt)][1] is cache
    proposer.propose([1, 2, 3], [], 2, None)
    assert list(proposer._caches) == [(1, 2, 3)]  # max_cached=1: the older prompt's cache was dropped


def test_draft_model_of_another_vocabulary_is_refused_up_front(tiny, sp_tokenizer):
    proposer = DraftModelProposer(_random_model(sp_tokenizer, seed=0))
    calls: list[int] = []
    tiny.model.forward = functools.partial(lambda *a, **k: calls.append(1))
    try:
        with pytest.raises(ValueError, match="vocabulary"):
            generate(tiny, "Hi", max_tokens=3, speculative=proposer)
    finally:
        del tiny.model.forward
    assert not calls
    with pytest.raises(ValueError, match="at least 1"):
        DraftModelProposer(tiny, k=0)
