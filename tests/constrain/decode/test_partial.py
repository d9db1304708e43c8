"""Typed partial values while streaming (constrain.decode.partial): complete pointers against a reference built
with the text, typed snapshots, and a stream whose tokens arrive one character at a time."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field, field_validator, model_validator

import constrain
from constrain.constraints.schema_refs import pointer_token
from constrain.decode.partial import PartialJson, resolve

# --- a reference: the JSON text written with the span of every value -------------------------------


class Spans:
    """``json.dumps``-compatible text of a value with every value's (pointer, start, end, is_scalar,
    depth); ``pad`` is written between every two tokens (JSON whitespace)."""

    def __init__(self, value: Any, *, pad: str = "", ensure_ascii: bool = True, spaced: bool = True) -> None:
        self.pad, self.ensure_ascii, self.spaced = pad, ensure_ascii, spaced
        self.parts: list[str] = []
        self.length = 0
        self.spans: list[tuple[str, int, int, bool, int]] = []
        self._write(self.pad)
        self._dump(value, "", 0)
        self._write(self.pad)
        self.text = "".join(self.parts)

    def _write(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)

    def _dump(self, value: Any, pointer: str, depth: int) -> None:
        start = self.length
        if isinstance(value, dict):
            self._write("{")
            for i, (key, member) in enumerate(value.items()):
                self._write(self.pad + (", " if i and self.spaced else "," if i else ""))
                self._write(json.dumps(key, ensure_ascii=self.ensure_ascii) + self.pad)
                self._write(": " if self.spaced else ":")
                self._write(self.pad)
                self._dump(member, f"{pointer}/{pointer_token(key)}", depth + 1)
            self._write(self.pad + "}")
        elif isinstance(value, list):
            self._write("[")
            for i, member in enumerate(value):
                self._write(self.pad + (", " if i and self.spaced else "," if i else "") + self.pad)
                self._dump(member, f"{pointer}/{i}", depth + 1)
            self._write(self.pad + "]")
        else:
            self._write(json.dumps(value, ensure_ascii=self.ensure_ascii))
        is_scalar = not isinstance(value, dict | list | str)
        self.spans.append((pointer, start, self.length, is_scalar, depth))

    def completes_at(self) -> list[tuple[int, int, str]]:
        """(index of the character that completes it, -depth, pointer) of every value, sorted: a string
        or container completes at its last character, a number or literal at the next one (at the end
        of the text: index ``len(text)``, the final flag)."""
        return sorted((end if is_scalar else end - 1, -depth, p) for p, _, end, is_scalar, depth in self.spans)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def feed_in_chunks(text: str, cuts: list[int], python_type: Any = None) -> list[tuple[int, tuple[str, ...], Any]]:
    """Feed ``text`` cut at ``cuts``; (end of the piece, pointers completed, value) per piece."""
    parser, out = PartialJson(python_type), []
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {len(text)})
    start = 0
    for end in bounds:
        done = parser.feed(text[start:end], final=end == len(text))
        out.append((end, done, parser.value))
        start = end
    return out


def pointers_in(value: Any, pointer: str = "") -> set[str]:
    found = {pointer}
    if isinstance(value, dict):
        for key, member in value.items():
            found |= pointers_in(member, f"{pointer}/{pointer_token(key)}")
    elif isinstance(value, list):
        for i, member in enumerate(value):
            found |= pointers_in(member, f"{pointer}/{i}")
    return found


# --- the scanner against the reference -----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    value=json_values,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    pad=st.sampled_from(["", " ", "\n\t "]),
    ensure_ascii=st.booleans(),
    spaced=st.booleans(),
)
def test_completed_pointers_match_the_reference(value, cuts, pad, ensure_ascii, spaced):
    ref = Spans(value, pad=pad, ensure_ascii=ensure_ascii, spaced=spaced)
    assert json.loads(ref.text) == value  # the reference writes JSON
    expected = ref.completes_at()
    seen: list[str] = []
    start = 0
    for end, done, partial in feed_in_chunks(ref.text, cuts):
        # the values that complete within this piece, innermost first, in text order
        assert list(done) == [p for at, _, p in expected if start <= at < end or (at == end == len(ref.text))]
        seen += done
        for p in seen:
            assert resolve(partial, p) == resolve(value, p)
        open_containers = {p for p, s, e, is_scalar, _ in ref.spans if s < end and not is_scalar and p not in seen}
        if partial is not None:  # nothing but complete values and open containers
            assert pointers_in(partial) <= set(seen) | open_containers
        start = end
    assert sorted(seen) == sorted(p for p, *_ in ref.spans)  # each value completes exactly once
    assert partial == value


@settings(max_examples=100, deadline=None)
@given(value=json_values)
def test_one_character_at_a_time(value):
    text = json.dumps(value)
    parser = PartialJson()
    done = [parser.feed(c, final=i == len(text) - 1) for i, c in enumerate(text)]
    ref = Spans(value)
    expected = ref.completes_at()
    for i, pointers in enumerate(done):
        assert list(pointers) == [p for at, _, p in expected if at == i or (i == len(text) - 1 and at == len(text))]
    assert parser.done and parser.value == value


@pytest.mark.parametrize(
    "text, pointers",
    [
        ('{"a/b~c": 1}', ["/a~1b~0c", ""]),
        ('{"\\u00e9\\"\\/": [true, null]}', ['/é"~1/0', '/é"~1/1', '/é"~1', ""]),
        ('{"\\ud83d\\ude00": "x"}', ["/\U0001f600", ""]),
        ("[[], {}, [[1]]]", ["/0", "/1", "/2/0/0", "/2/0", "/2", ""]),
        ('"a\\\\"', [""]),
    ],
)
def test_keys_are_decoded_and_escaped(text, pointers):
    parser = PartialJson()
    assert [p for c in text for p in parser.feed(c)] == pointers


def test_numbers_and_literals_wait_for_a_delimiter():
    parser = PartialJson()
    assert parser.feed("[12") == ()
    assert parser.value == []  # a number being written is left out
    assert parser.feed("3") == ()
    assert parser.feed(",") == ("/0",)
    assert parser.value == [123]
    top = PartialJson()
    assert top.feed("12") == () and top.value is None
    assert top.feed("", final=True) == ("",) and top.value == 12
    assert PartialJson().feed("[1", final=True) == ()  # inside an unclosed container, final completes nothing


@pytest.mark.parametrize("text", ['{"a" 1}', "[1,]x", "{,}", '{"a": tru}', "1 2", "]"])
def test_text_that_is_not_json_raises(text):
    with pytest.raises(ValueError, match="JSON"):
        PartialJson().feed(text, final=True)


# --- typed values ----------------------------------------------------------------------------------------


class Address(BaseModel):
    city: str
    zip_code: str | None = Field(alias="zip/code")


class Item(BaseModel):
    name: str
    qty: int = Field(ge=0)


class Order(BaseModel):
    customer: str
    vip: bool
    address: Address
    items: list[Item]
    tags: list[str]
    note: str | None = None

    @field_validator("customer")
    @classmethod
    def shout(cls, v: str) -> str:
        return v.upper()


ORDER = {
    "customer": 'ann "a" lee',
    "vip": True,
    "address": {"city": "Paris~1", "zip/code": None},
    "items": [{"name": "pen", "qty": 2}, {"name": "ink", "qty": 10}],
    "tags": ["x", "y/z"],
    "note": None,
}


def check_stream(python_type: Any, text: str, final: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Feed ``text`` one character at a time; every completed pointer resolves, in that step's value,
    to the final value there; each completes once. Returns (completed, value) per character."""
    parser, steps, seen = PartialJson(python_type), [], set()
    for i, c in enumerate(text):
        done = parser.feed(c, final=i == len(text) - 1)
        value = parser.value
        for p in done:
            assert p not in seen
            seen.add(p)
        for p in seen:
            assert resolve(value, p) == resolve(final, p), p
        steps.append((done, value))
    return steps


def test_pydantic_partial_instances():
    text = json.dumps(ORDER)
    final = Order.model_validate_json(text)
    steps = check_stream(Order, text, final)
    assert steps[-1][1] == final and isinstance(steps[-1][1], Order)
    values = [v for _, v in steps]
    assert all(isinstance(v, Order) for v in values)
    first = next(v for done, v in steps if "/customer" in done)
    assert first.customer == 'ANN "A" LEE'  # the field validator ran as soon as the field completed
    assert (first.vip, first.address, first.items, first.note) == (None, None, None, None)
    assert first.model_fields_set == {"customer"}
    in_address = values[text.index('"zip/code"')]  # the nested model being written: a partial instance
    assert isinstance(in_address.address, Address)
    assert (in_address.address.city, in_address.address.zip_code) == ("Paris~1", None)
    second_item = values[text.index('"ink"') + 4]  # the list being written holds its complete items
    assert second_item.items == [Item(name="pen", qty=2), Item.model_construct(name="ink", qty=None)]
    assert second_item.address == Address(city="Paris~1", **{"zip/code": None})
    assert values[text.index('"y/z"')].tags == ["x"]  # a string being written is left out


def test_dict_schema_partial_values():
    text = json.dumps(ORDER)
    steps = check_stream(None, text, ORDER)
    values = [v for _, v in steps]
    assert values[text.index('"vip"')] == {"customer": ORDER["customer"]}
    assert values[text.index('"qty": 10') + 6] == {**{k: ORDER[k] for k in ["customer", "vip", "address"]},
                                                    "items": [ORDER["items"][0], {"name": "ink"}]}  # fmt: skip
    assert values[-1] == ORDER


@pytest.mark.parametrize(
    "python_type, value",
    [
        (list[int], [1, 22, 333]),
        (tuple[int, str], [7, "a"]),
        (dict[str, Item], {"a": {"name": "pen", "qty": 1}, "b": {"name": "ink", "qty": 3}}),
        (list[Item] | None, [{"name": "pen", "qty": 1}]),
        (int, 42),
    ],
)
def test_plain_types(python_type, value):
    import pydantic

    text = json.dumps(value)
    final = pydantic.TypeAdapter(python_type).validate_python(value)
    steps = check_stream(python_type, text, final)
    assert steps[-1][1] == final


def test_complete_members_of_plain_containers_are_validated():
    parser = PartialJson(dict[str, Item])
    parser.feed('{"a": {"name": "pen", "qty": 1}, "b": {"name": "i')
    assert parser.value == {"a": Item(name="pen", qty=1), "b": Item.model_construct(name=None, qty=None)}
    assert isinstance(parser.value["b"], Item)


def test_a_member_that_fails_validation_keeps_its_json_value():
    class Range(BaseModel):
        low: int
        high: int

        @model_validator(mode="after")
        def ordered(self) -> Range:
            if self.low is None or self.high is None or self.low > self.high:
                raise ValueError("low > high")
            return self

    parser = PartialJson(Range)
    parser.feed('{"low": "1", ')
    assert parser.value.low == "1"  # the model validator rejects the half-built object: the JSON value
    parser.feed('"high": 2}')
    assert parser.value == Range(low=1, high=2)  # complete: validated as a whole


def test_resolve():
    order = Order.model_validate(ORDER)
    assert resolve(order, "/address/zip~1code") is None
    assert resolve(order, "/items/1/name") == "ink"
    assert resolve(ORDER, "/tags/1") == "y/z"
    assert resolve(order, "") is order
    with pytest.raises(LookupError):
        resolve(order, "/nope")
    with pytest.raises(LookupError):
        resolve(ORDER, "/tags/x")
    with pytest.raises(ValueError, match="starts with"):
        resolve(ORDER, "tags")


def test_random_chunks_of_a_typed_value_give_the_same_final_value():
    text = json.dumps(ORDER)
    rng = random.Random(0)
    for _ in range(20):
        steps = feed_in_chunks(text, rng.sample(range(len(text)), 8), Order)
        assert sorted(p for _, done, _ in steps for p in done) == sorted(p for p, *_ in Spans(ORDER).spans)
        assert steps[-1][2] == Order.model_validate(ORDER)


# --- a stream whose tokens arrive one character at a time -----------------------------------------------


def scripted_model(tokenizer: Any, text: str) -> Any:
    """A tiny Llama whose logits put all the mass on the one-character token of the next character of
    ``text`` (then EOS): greedy decoding writes ``text`` one character per step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    script = [tokenizer.encode(c, add_special_tokens=False) for c in text]
    assert all(len(ids) == 1 for ids in script), "every character should be one token"
    targets = torch.tensor([ids[0] for ids in script] + [tokenizer.eos_token_id])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = LlamaForCausalLM(config)
    forward, start = model.forward, []

    def scripted(*args: Any, position_ids: Any, **kwargs: Any) -> Any:
        out = forward(*args, position_ids=position_ids, **kwargs)
        if not start:  # the prefill: the prompt ends at the last position
            start.append(int(position_ids[0, -1]) + 1)
        positions = position_ids[:, -out.logits.shape[1] :]  # [b, t]: the positions whose logits came out
        index = (positions + 1 - start[0]).clamp(0, len(script))  # [b, t]: which character each predicts
        logits = torch.full_like(out.logits, -1e4)  # [b, t, V]
        logits.scatter_(-1, targets[index].unsqueeze(-1), 0.0)
        out.logits = logits
        return out

    model.forward = scripted  # on the instance: the loop reads the cache keyword from the class
    return constrain.load_model((model, tokenizer))


@pytest.mark.parametrize("typed", [True, False], ids=["pydantic", "json-schema"])
def test_stream_one_character_per_token(smol_tokenizer, typed):
    text = json.dumps(ORDER)  # generation mode writes json.dumps' formatting, keys in the schema's order
    model = scripted_model(smol_tokenizer, text)
    # (a schema text of its own: the compile cache keys on the text, and would hand back Order's python_type)
    schema = Order if typed else Order.model_json_schema()
    events = list(constrain.stream(model, "Write the order as JSON:", schema=schema, temperature=0,
                                   jump_forward=False, speculative=False, max_tokens=200))  # fmt: skip
    result = events[-1]
    assert isinstance(result, constrain.GenerationResult) and result.valid and result.text == text
    stream_events = events[:-1]
    assert all(len(e.delta) == 1 for e in stream_events if e.token_ids)  # one character per token
    final = result.value
    assert (final == Order.model_validate(ORDER)) if typed else (final == ORDER)
    seen: list[str] = []
    written = ""
    for event in stream_events:
        written += event.delta
        assert not set(event.completed) & set(seen)  # each pointer completes once
        seen += event.completed
        for p in event.completed:
            assert resolve(event.value, p) == resolve(final, p), p
        if typed and event.value is not None:
            assert isinstance(event.value, Order)
            for name in Order.model_fields:  # a field neither complete nor an open container is None
                opened = f'"{name}": {{' in written or f'"{name}": [' in written
                if f"/{name}" not in seen and not opened:
                    assert getattr(event.value, name) is None
    assert sorted(seen) == sorted(p for p, *_ in Spans(ORDER).spans)
    assert stream_events[-1].value == final and stream_events[-1].completed[-1] == ""


def test_a_top_level_number_completes_at_the_finish(smol_tokenizer):
    model = scripted_model(smol_tokenizer, "4217")
    events = list(constrain.stream(model, "Write the number:", schema=int, temperature=0, jump_forward=False,
                                   speculative=False, max_tokens=10))  # fmt: skip
    result, stream_events = events[-1], events[:-1]
    assert result.value == 4217
    assert [e.completed for e in stream_events] == [(), (), (), (), ("",)]  # "421" may still become "4217"
    assert [e.value for e in stream_events] == [None, None, None, None, 4217]
