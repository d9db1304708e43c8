"""Reasoning mode: free thinking between tags, then the constrained answer (constrain.decode.reasoning)."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
import torch

import constrain
from constrain.backends.tokenizer import tokenizer_info
from constrain.decode.reasoning import Thinking, _thinking_masks, template_tags
from constrain.errors import ReasoningError
from constrain.testing import WEATHER_TOOL, LocalServer, allowed_ids

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
"""A template that opens the thinking itself, as Qwen3's and DeepSeek-R1's do."""


def _tiny(tokenizer, seed: int = 0) -> constrain.ModelHandle:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=2)  # fmt: skip
    return constrain.load_model((LlamaForCausalLM(config), tokenizer))


@pytest.fixture(scope="module")
def thinker(smol_tokenizer):
    """The tiny random model with a chat template that opens ``<think>``."""
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    return _tiny(tokenizer)


def _split(handle: constrain.ModelHandle, result: constrain.GenerationResult, end: str = "</think>") -> str:
    """The decoded output, checked to hold the reasoning, the end tag and the answer in that order."""
    text = handle.tokenizer.decode(result.token_ids)
    assert end in text
    before, after = text.split(end, 1)
    assert before.endswith(result.reasoning)
    assert after.strip() == result.text
    return text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_template_opens_thinking_budget_forces_end_and_answer_is_valid(thinker, seed):
    messages = [{"role": "user", "content": "How much is 6 x 7?"}]
    result = constrain.generate(thinker, messages, schema=SCHEMA, reasoning={"max_tokens": 24}, max_tokens=40,
                                seed=seed, temperature=1.0)  # fmt: skip
    text = _split(thinker, result)
    assert not text.startswith("<think>"), "the template opened the thinking: no start tag is written"
    assert result.valid and set(result.value) == {"answer", "sure"}
    jsonschema.validate(result.value, SCHEMA)
    assert result.usage.reasoning_tokens <= 24
    assert result.usage.completion_tokens == len(result.token_ids) > result.usage.reasoning_tokens
    # the random model never ends its thinking by itself: the budget did
    assert result.usage.reasoning_tokens >= 24 - 3


def test_the_answer_closes_within_what_the_thinking_left_of_the_context_window(thinker):
    """The answer's budget was ``max_tokens`` whatever the thinking took: past the window's end the output was
    cut, invalid. It is now cut, where the thinking ends, to what the window still holds."""
    messages = [{"role": "user", "content": "word " * 1980}]
    room = 2048 - len(constrain.generation.prompt_ids(thinker, messages))  # the thinker's window: 2048 positions
    assert 40 < room < 80
    text = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": False}
    for seed in range(2):
        result = constrain.generate(thinker, messages, schema=text, reasoning={"max_tokens": room - 16},
                                    max_tokens=room, seed=seed, temperature=1.0)  # fmt: skip
        assert result.valid and result.closed_early and len(result.token_ids) <= room, result
        assert result.usage.reasoning_tokens >= room - 16 - 3  # the random model thinks until the budget ends it


def test_start_tag_is_forced_where_the_prompt_does_not_open_it(tiny):
    result = constrain.generate(tiny, "Question:", regex="(yes|no)", reasoning={"max_tokens": 12}, seed=3,
                                temperature=1.0)  # fmt: skip
    text = _split(tiny, result)
    assert text.startswith("<think>")
    assert result.text in ("yes", "no") and result.valid


def test_without_reasoning_the_constraint_applies_from_the_first_token(tiny):
    result = constrain.generate(tiny, "Question:", regex="(yes|no)", seed=3, temperature=1.0)
    assert result.reasoning is None and result.usage.reasoning_tokens == 0
    assert result.text in ("yes", "no")


def test_stream_parts_concatenate_to_reasoning_and_answer(thinker):
    events = list(constrain.stream(thinker, [{"role": "user", "content": "Hi"}], schema=SCHEMA,
                                   reasoning={"max_tokens": 16}, max_tokens=40, seed=5, temperature=1.0))  # fmt: skip
    final = events[-1]
    assert isinstance(final, constrain.GenerationResult)
    parts = [e.part for e in events[:-1] if e.delta]
    assert parts == sorted(parts, key=lambda p: p == "answer"), "every reasoning delta comes before the answer"
    assert "".join(e.delta for e in events[:-1] if e.part == "reasoning") == final.reasoning
    assert "".join(e.delta for e in events[:-1] if e.part == "answer") == final.text
    assert final.valid


def test_explicit_tags(tiny):
    result = constrain.generate(tiny, "Q:", choices=["red", "blue"], seed=0, temperature=1.0,
                                reasoning={"start": "[THINK]", "end": "[/THINK]", "max_tokens": 15})  # fmt: skip
    text = _split(tiny, result, end="[/THINK]")
    assert text.startswith("[THINK]") and result.text in ("red", "blue")


def test_thinking_masks_forbid_eos_and_running_past_the_end_tag(smol_tokenizer):
    info = tokenizer_info(smol_tokenizer)
    end = "</think>"
    masks = _thinking_masks(info, end, (2,))
    vocab = smol_tokenizer.get_vocab()
    texts = {i: smol_tokenizer.convert_tokens_to_string([t]) for t, i in vocab.items()}
    closing_with_text = [i for i, t in texts.items() if t.startswith(">") and t[1:].strip()]
    closing_with_space = [i for i, t in texts.items() if t.startswith(">") and not t[1:].strip()]  # ">" and ">\n"...
    assert closing_with_text and closing_with_space
    after_tag_body = allowed_ids(masks[len("</think")], info.vocab_size)  # the text ends with "</think"
    fresh = allowed_ids(masks[0], info.vocab_size)
    assert 2 not in after_tag_body and 2 not in fresh
    assert not set(closing_with_text) & after_tag_body
    assert set(closing_with_space) <= after_tag_body
    assert set(closing_with_text) <= fresh, "'>x' ends no tag unless '</think' came before"
    assert len(fresh) == info.vocab_size - 1


class _ByteInfo:
    """The fields of a TokenizerInfo that Thinking reads, for a vocabulary of the 256 bytes."""

    vocab_size = 256
    xgr_info = type("X", (), {"decoded_vocab": [bytes([i]) for i in range(256)]})()


def _bytes(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_thinking_feed_holds_back_a_possible_end_tag():
    thinking = Thinking(_ByteInfo(), ("<think>", "</think>"), 100, _bytes, opened=True, eos=[0])  # type: ignore[arg-type]
    deltas = [thinking.feed(ord(c), c) for c in "a</b</thi"]
    assert "".join(d for d, _ in deltas) == "a</b"
    assert all(a is None for _, a in deltas)
    delta, answer = thinking.feed(0, "nk>  {")
    assert (delta, answer) == ("", "{") and not thinking.open and thinking.text == "a</b"


@pytest.mark.parametrize(("free", "expected"), [("x" * 20, "xxxxxx</t>"), ("xxxxx<x" + "x" * 20, "xxxxx</t>")])
def test_budget_forces_the_end_tag_token_by_token_within_the_budget(free, expected):
    thinking = Thinking(_ByteInfo(), ("<t>", "</t>"), 10, _bytes, opened=True, eos=[0], separator="")  # type: ignore[arg-type]
    row = torch.zeros(8, dtype=torch.int32)
    written = ""
    while thinking.open:
        thinking.fill(row)
        allowed = allowed_ids(row, 256)
        assert 0 not in allowed, "never EOS while thinking"
        token = next(iter(allowed)) if len(allowed) == 1 else ord(free[len(written)])
        written += chr(token)
        thinking.feed(token, chr(token))
    assert written == expected and thinking.tokens <= 10


def test_template_tags():
    class Tok:
        def __init__(self, template: str, vocab: dict[str, int]) -> None:
            self.chat_template, self.vocab = template, vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    assert template_tags(Tok("{{ '<|START_THINKING|>' }}..{{ '<|END_THINKING|>' }}", {})) == (
        "<|START_THINKING|>",
        "<|END_THINKING|>",
    )
    assert template_tags(Tok("", {"<thinking>": 5, "</thinking>": 6})) == ("<thinking>", "</thinking>")
    assert template_tags(Tok("no tags here", {})) == ("<think>", "</think>")


def test_special_token_tags_are_recognised_by_id(smol_tokenizer):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.chat_template = THINKING_TEMPLATE
    handle = _tiny(tokenizer, seed=1)
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    result = constrain.generate(handle, [{"role": "user", "content": "?"}], regex="[0-9]{2}",
                                reasoning={"max_tokens": 10}, seed=0, temperature=1.0)  # fmt: skip
    assert end_id in result.token_ids
    assert result.token_ids.index(end_id) == result.usage.reasoning_tokens - 1
    assert len(result.text) == 2 and result.text.isdigit()


@pytest.mark.parametrize(
    ("reasoning", "culprit"),
    [({"max_tokens": 0}, "max_tokens"), ({"budget": 5}, "budget"), ("yes", "str"), ({"max_tokens": 2}, "max_tokens")],
)
def test_bad_options_fail_up_front(tiny, reasoning, culprit):
    with pytest.raises(ReasoningError, match=culprit):
        constrain.generate(tiny, "Q:", regex="a", reasoning=reasoning)


def test_server_reasoning_content_streaming_and_tools(thinker):
    server = LocalServer(thinker)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        plain = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=40, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
            extra_body={"reasoning": {"max_tokens": 16}},
        )  # fmt: skip
        message = plain.choices[0].message
        assert message.reasoning_content and json.loads(message.content).keys() == {"answer", "sure"}
        assert plain.usage.completion_tokens_details.reasoning_tokens <= 16

        chunks = list(client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=40, seed=1, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
            extra_body={"reasoning": {"max_tokens": 16}},
        ))  # fmt: skip
        thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert (thought, answer) == (message.reasoning_content, message.content), "same seed, same output"

        called = client.chat.completions.create(
            model=server.model, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=80,
            seed=2, extra_body={"reasoning": {"max_tokens": 16}},
        )  # fmt: skip
        call = called.choices[0].message
        assert call.reasoning_content is not None and call.tool_calls
        assert call.tool_calls[0].function.name == WEATHER_TOOL["function"]["name"]
        json.loads(call.tool_calls[0].function.arguments)

        effort = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=8, seed=3, reasoning_effort="minimal",
            extra_body={"choices": ["a", "b"]},
        )  # fmt: skip
        assert effort.choices[0].message.content in ("a", "b")
        assert 0 < effort.usage.completion_tokens_details.reasoning_tokens <= 64  # "minimal": 64 tokens
        with pytest.raises(openai.BadRequestError, match="not both"):
            client.chat.completions.create(model=server.model, messages=messages, reasoning_effort="low",
                                           extra_body={"reasoning": True})  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model=server.model, messages=messages,
                                           extra_body={"reasoning": {"max_tokens": -1}})  # fmt: skip
    finally:
        server.stop()


@pytest.mark.real_model
def test_default_model_thinks_then_answers(smollm2):
    from pydantic import BaseModel

    class Apples(BaseModel):
        apples: int

    model = smollm2
    messages = [
        {"role": "system", "content": "Think step by step inside <think></think> tags, then give the answer as JSON."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"},
    ]
    result = constrain.generate(model, messages, schema=Apples, reasoning={"max_tokens": 30}, max_tokens=20,
                                temperature=0)  # fmt: skip
    assert result.reasoning and "3 + 4" in result.reasoning, "it thought freely, as asked"
    assert isinstance(result.value, Apples) and result.valid  # (a 135M model may still answer 3)
    _split(model, result)
    assert model.tokenizer.decode(result.token_ids).startswith("<think>")
