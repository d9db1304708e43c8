"""The incremental detokenizer against ``tokenizer.decode(all ids)``, for several tokenizer families."""

from __future__ import annotations

import random

import pytest

from constrain.decode.detokenizer import IncrementalDetokenizer

TEXTS = [
    '{"name": "Zoë", "city": "Zürich"}',
    "日本語のテキストと絵文字 😀🎉👩‍👩‍👧 mixed with English.",
    "Ελληνικά, русский, العربية, हिन्दी — and   spaces\n\tand tabs.",
    "  leading spaces, trailing ones  ",
]


def _stream(tokenizer, ids, context=()):
    detok = IncrementalDetokenizer(tokenizer, context_ids=context)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(text, smol_tokenizer, gemma_tokenizer, sp_tokenizer):
    for tokenizer in (smol_tokenizer, gemma_tokenizer, sp_tokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = _stream(tokenizer, ids)
        expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(deltas) == expected, type(tokenizer).__name__
        assert all("\ufffd" not in d for d in deltas), "no replacement characters for split UTF-8"


def test_random_token_streams(smol_tokenizer, gemma_tokenizer, sp_tokenizer):
    rng = random.Random(0)
    for tokenizer in (smol_tokenizer, gemma_tokenizer, sp_tokenizer):
        special = set(tokenizer.all_special_ids)
        vocab = [i for i in range(len(tokenizer)) if i not in special]
        for _ in range(20):
            ids = [rng.choice(vocab) for _ in range(rng.randint(1, 40))]
            expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert "".join(_stream(tokenizer, ids)) == expected, (type(tokenizer).__name__, ids)


def test_prompt_context_is_never_emitted_and_keeps_leading_spaces(gemma_tokenizer):
    prompt = gemma_tokenizer.encode("The answer is", add_special_tokens=False)
    output = gemma_tokenizer.encode("The answer is forty two", add_special_tokens=False)[len(prompt) :]
    deltas = _stream(gemma_tokenizer, output, context=prompt)
    assert "".join(deltas) == " forty two"


def test_split_emoji_is_held_back(smol_tokenizer):
    ids = smol_tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the 4 UTF-8 bytes
    detok = IncrementalDetokenizer(smol_tokenizer)
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "😀"
