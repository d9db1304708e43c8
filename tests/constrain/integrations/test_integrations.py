"""constrain inside other engines: the per-request guide and the transformers logits processor (the vLLM
processor is tested against vLLM itself: tests/with_vllm, ``make test-vllm``)."""

from __future__ import annotations

import json

import pytest
import torch

import constrain
from constrain.integrations import Guide, guide_spec
from constrain.integrations.guide import SLACK
from constrain.integrations.transformers import ConstrainLogitsProcessor

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "add", "parameters": PERSON}}


@pytest.mark.parametrize(
    ("args", "kind"),
    [
        ({"json_schema": PERSON}, constrain.JsonSchema),
        (json.dumps({"json_schema": json.dumps(PERSON), "mode": "specification"}), constrain.JsonSchema),
        ({"regex": r"\d{3}"}, constrain.Regex),
        ({"grammar": 'root ::= "a" | "b"'}, constrain.Grammar),
        ({"choices": ["yes", "no"], "close_in_budget": 0}, constrain.Choice),
        ({"tools": json.dumps([TOOL]), "tool_choice": "add"}, constrain.Grammar),
    ],
)
def test_request_arguments_name_one_constraint(args, kind):
    assert isinstance(guide_spec(args).constraint, kind)


@pytest.mark.parametrize(
    ("args", "error", "names"),
    [
        ("{not json", ValueError, "not valid JSON"),
        (["json_schema"], ValueError, "mapping"),
        ({"json_schema": PERSON, "regex": "a"}, ValueError, "exactly one"),
        ({}, ValueError, "exactly one"),
        ({"json_schema": PERSON, "temperature": 1}, ValueError, "temperature"),
        ({"json_schema": {"type": "nope"}}, constrain.SchemaError, "/type"),
        ({"regex": "(unclosed"}, constrain.RegexError, "unclosed"),
        ({"regex": 3}, ValueError, "regex must be a string"),
        ({"json_schema": PERSON, "close_in_budget": "yes"}, ValueError, "close_in_budget"),
        ({"tools": [TOOL], "tool_choice": "nothere"}, constrain.ToolError, "nothere"),
    ],
)
def test_bad_request_arguments_are_refused_with_the_culprit(args, error, names):
    with pytest.raises(error, match=names):
        guide_spec(args)


def _mask(guide, vocab_size):
    bitmask = constrain.allocate_token_bitmask(1, vocab_size)
    guide.matcher.fill_next_token_bitmask(bitmask)
    guide.restrict(bitmask[0])
    words = bitmask[0].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def test_the_guide_forces_the_closing_path_near_the_end(smol_tokenizer):
    """Far from the end the grammar's mask; within the closing length plus SLACK, only its next token."""
    vocab = len(smol_tokenizer)
    spec = guide_spec({"json_schema": PERSON})
    far = Guide(spec, smol_tokenizer, vocab_size=vocab, eos_token_ids=[2], max_tokens=200)
    opened = smol_tokenizer.encode('{"name": "Al', add_special_tokens=False)
    far.advance(opened)
    assert len(_mask(far, vocab)) > 100  # free text
    near = Guide(spec, smol_tokenizer, vocab_size=vocab, eos_token_ids=[2], max_tokens=len(opened) + SLACK)
    near.advance(opened)
    (only,) = _mask(near, vocab)
    assert smol_tokenizer.decode([only]).startswith('"')  # closing the name


def test_near_the_end_a_token_with_no_closing_after_it_is_refused(smol_tokenizer):
    """A complete reply with parallel calls allowed: another call does not fit in the 20 tokens left, so
    only EOS remains (the mask vets the few allowed tokens); with room for it, the call stays allowed."""
    vocab = len(smol_tokenizer)
    spec = guide_spec({"tools": [TOOL], "tool_choice": "required"})
    reply = smol_tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"name": "A", "age": 1}}\n</tool_call>',
                                  add_special_tokens=False)  # fmt: skip
    tight = Guide(spec, smol_tokenizer, vocab_size=vocab, eos_token_ids=[2], max_tokens=len(reply) + 20)
    tight.advance(reply)
    assert _mask(tight, vocab) == {2}
    roomy = Guide(spec, smol_tokenizer, vocab_size=vocab, eos_token_ids=[2], max_tokens=len(reply) + 200)
    roomy.advance(reply)
    assert len(_mask(roomy, vocab)) > 1


def test_the_repetition_guard_follows_the_output(smol_tokenizer):
    """Three identical items: the separator that would start a fourth is forbidden, so the array closes."""
    vocab = len(smol_tokenizer)
    spec = guide_spec({"json_schema": {"type": "array", "items": {"type": "string"}}})
    guide = Guide(spec, smol_tokenizer, vocab_size=vocab, eos_token_ids=[2], max_tokens=500)
    comma = smol_tokenizer.encode(",", add_special_tokens=False)[0]
    guide.advance(smol_tokenizer.encode('["the same item", "the same item"', add_special_tokens=False))
    assert comma in _mask(guide, vocab)  # two copies: another item may follow
    guide.advance(smol_tokenizer.encode('["the same item", "the same item", "the same item"', add_special_tokens=False))
    assert comma not in _mask(guide, vocab) and guide.guard is not None and guide.guard.steps


def test_a_refused_token_leaves_only_eos(smol_tokenizer):
    vocab = len(smol_tokenizer)
    guide = Guide(guide_spec({"regex": r"\d+"}), smol_tokenizer, vocab_size=vocab, eos_token_ids=[2], max_tokens=50)
    guide.advance(smol_tokenizer.encode("12a", add_special_tokens=False))
    assert guide.failed and _mask(guide, vocab) == {2}


def _generate(tiny, processor, **kwargs):
    prompt = tiny.tokenizer("Tell me about a person.", return_tensors="pt").input_ids
    out = tiny.model.generate(prompt, logits_processor=[processor], pad_token_id=2, eos_token_id=[2], **kwargs)
    return [tiny.tokenizer.decode(row[prompt.shape[1] :], skip_special_tokens=True) for row in out]


@pytest.mark.parametrize("max_new_tokens", [14, 60])
def test_transformers_generate_under_a_schema(tiny, max_new_tokens):
    """A random model sampling under the processor: every output valid, even with a budget that only
    the closing path fits."""
    torch.manual_seed(0)
    processor = ConstrainLogitsProcessor({"json_schema": PERSON}, tiny.tokenizer, max_new_tokens=max_new_tokens)
    texts = _generate(tiny, processor, do_sample=True, num_return_sequences=4, max_new_tokens=max_new_tokens)
    for text in texts:
        value = json.loads(text)
        assert isinstance(value["name"], str) and len(value["name"]) <= 12 and isinstance(value["age"], int), text


def test_transformers_beam_search_under_a_constraint(tiny):
    processor = ConstrainLogitsProcessor(constrain.regex(r"(cat|dog)s?"), tiny.tokenizer, max_new_tokens=8)
    texts = _generate(tiny, processor, num_beams=3, num_return_sequences=3, max_new_tokens=8, do_sample=False)
    assert all(t in ("cat", "cats", "dog", "dogs") for t in texts), texts


def test_the_processor_refuses_bad_arguments_up_front(tiny):
    with pytest.raises(constrain.SchemaError):
        ConstrainLogitsProcessor({"json_schema": {"type": 3}}, tiny.tokenizer, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ConstrainLogitsProcessor(constrain.regex("a"), tiny.tokenizer, max_new_tokens=0)
