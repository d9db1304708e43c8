"""constrain as vLLM's structured-output backend (``constrain.integrations.vllm_backend``), with standard
requests: ``structured_outputs`` in the engine, ``response_format`` and ``tools`` through vLLM's own OpenAI
server, from the ``openai`` client, instructor and LangChain. ``make test-vllm``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import jsonschema  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402

from constrain.constraints.constraint import json_schema  # noqa: E402
from constrain.integrations import vllm_backend  # noqa: E402
from constrain.integrations.guide import Guide, GuideSpec  # noqa: E402
from constrain.match.bitmask import allocate_token_bitmask  # noqa: E402
from constrain.models.loading import load_tokenizer  # noqa: E402

# what vLLM's own backends refuse ("Unimplemented keys: uniqueItems") or do not enforce (multipleOf on floats)
BASKET = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "fruit": {"type": "array", "items": {"enum": ["apple", "banana", "cherry", "pear"]}, "uniqueItems": True,
              "minItems": 1, "maxItems": 4},
    "price": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 100}},
    "required": ["name", "fruit", "price"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"]}}}  # fmt: skip
TOOLS = {"get_weather": WEATHER, "get_time": CLOCK}
SIX = {"type": "object", "properties": {k: {"type": "string"} for k in "abcdef"}, "required": list("abcdef")}


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    hobbies: list[str] = Field(max_length=3)


def valid(schema: Any, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def chat(llm: LLM, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return str(llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def structured(temperature: float = 0.0, max_tokens: int = 80, seed: int | None = None, **constraint: Any) -> Any:
    outputs = StructuredOutputsParams(**constraint)
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, structured_outputs=outputs)


# -- the switch and the version check ---------------------------------------------------------------------


@pytest.mark.parametrize("switch", ["", "1"])
def test_the_entry_point_installs_the_backend_only_when_switched_on(switch: str) -> None:
    """vLLM runs every ``vllm.general_plugins`` entry point in each of its processes: constrain's changes
    nothing unless ``CONSTRAIN_VLLM=1``, so installing constrain never changes a vLLM server."""
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.v1.structured_output import StructuredOutputManager as M\n"
        "print(hasattr(M.grammar_init, '__wrapped__'))"
    )
    env = {**os.environ, vllm_backend.ENV_SWITCH: switch}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(switch == "1")


def test_an_unknown_vllm_version_fails_loudly_before_hooking_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    monkeypatch.setattr(vllm_backend, "_originals", {})
    before = StructuredOutputManager.grammar_init
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(vllm_backend.VllmVersionError, match=r"needs vLLM 0\.32\.0; this is vLLM 0\.33\.0"):
        vllm_backend.install()
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    monkeypatch.setattr(StructuredOutputManager, "_create_grammar", lambda self, request, extra: None)
    with pytest.raises(vllm_backend.VllmVersionError, match="_create_grammar takes"):
        vllm_backend.install()
    assert StructuredOutputManager.grammar_init is before and not vllm_backend._originals


# -- the grammar vLLM drives ------------------------------------------------------------------------------


def _allowed(row: torch.Tensor) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")).tolist())


def test_the_grammar_follows_vllms_speculative_protocol() -> None:
    """What vLLM's manager does with drafts: fill, take a draft token, fill the next slot, ..., then roll
    back; ``validate_tokens`` leaves the state as it was. Every row equals a fresh guide's row at that
    prefix, and padding ids past the tokenizer are never allowed."""
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    vocab = len(tokenizer) + 64  # a padded embedding
    spec = GuideSpec(json_schema(BASKET))

    def fresh(prefix: list[int]) -> Guide:
        guide = Guide(spec, tokenizer, vocab_size=vocab, eos_token_ids=[2], max_tokens=200)
        guide.advance(prefix)
        return guide

    grammar = vllm_backend.grammar_class()(fresh([]), None, False)
    text = '{"name": "Fruit basket", "fruit": ["apple", "pear"], "price": 2.5}'
    ids = [*tokenizer.encode(text, add_special_tokens=False), 2]
    rows = allocate_token_bitmask(6, vocab)  # [6, ceil(V / 32)] int32
    expected = allocate_token_bitmask(1, vocab)
    for at, token in enumerate(ids):
        drafts = ids[at : at + 4]
        assert grammar.validate_tokens([*drafts, 0]) == drafts  # token 0 (special) never follows
        grammar.fill_bitmask(rows, 0)
        taken = 0
        for draft in drafts:
            assert grammar.accept_tokens("r", [draft])
            taken += 1
            if grammar.is_terminated():  # vLLM fills no mask past the end
                break
            grammar.fill_bitmask(rows, taken)
            fresh(ids[: at + taken]).fill(expected, 0)
            assert torch.equal(rows[taken], expected[0]), (at, taken)
        grammar.rollback(taken)
        fresh(ids[:at]).fill(expected, 0)
        assert torch.equal(rows[0], expected[0]), at
        assert not _allowed(rows[0]) & set(range(len(tokenizer), vocab))
        assert grammar.accept_tokens("r", [token])
    assert grammar.is_terminated()
    grammar.reset()
    assert not grammar.is_terminated() and grammar.validate_tokens(ids) == ids


# -- in the engine ----------------------------------------------------------------------------------------


def test_structured_outputs_of_every_kind_in_one_batch(llm: LLM) -> None:
    prompt = chat(llm, "Fill a fruit basket: a name, some fruit and a price.")
    requests = {
        "basket": structured(json=BASKET),
        "basket sampled": structured(1.0, seed=3, json=BASKET),
        "regex": structured(regex=r"[A-Z][a-z]{2,8} \d{2}"),
        "choice": structured(choice=["yes", "no", "maybe"]),
        "grammar": structured(grammar='root ::= "fruit: " ("apple" | "pear") ("," " " ("apple" | "pear"))*'),
        "object": structured(json_object=True),
    }
    outs = llm.generate([prompt] * len(requests), list(requests.values()), use_tqdm=False)
    text = {name: out.outputs[0].text for name, out in zip(requests, outs, strict=True)}
    assert valid(BASKET, text["basket"]) and valid(BASKET, text["basket sampled"]), text
    assert valid({"type": "object"}, text["object"]), text["object"]
    assert text["choice"] in ("yes", "no", "maybe")
    assert __import__("re").fullmatch(r"[A-Z][a-z]{2,8} \d{2}", text["regex"]), text["regex"]
    assert __import__("re").fullmatch(r"fruit: (apple|pear)(, (apple|pear))*", text["grammar"]), text["grammar"]
    assert all(out.outputs[0].finish_reason == "stop" for out in outs)


def test_sampled_outputs_close_within_max_tokens(llm: LLM) -> None:
    """A budget the model's own ending would overrun: every output is complete and valid, none longer."""
    prompt = chat(llm, "Fill a fruit basket.")
    params = [structured(1.2, seed=seed, max_tokens=budget, json=BASKET) for seed in range(6) for budget in (24, 32)]
    for out, p in zip(llm.generate([prompt] * len(params), params, use_tqdm=False), params, strict=True):
        assert len(out.outputs[0].token_ids) <= p.max_tokens
        assert out.outputs[0].finish_reason == "stop" and valid(BASKET, out.outputs[0].text), out.outputs[0].text


def test_a_bad_constraint_is_refused_at_admission_naming_it(llm: LLM) -> None:
    prompt = chat(llm, "Fill a fruit basket.")
    bad = {"type": "object", "properties": {"price": {"type": "number", "minimum": "zero"}}}
    with pytest.raises(VLLMValidationError, match="/properties/price/minimum"):
        llm.generate([prompt], structured(json=bad), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="RegexError"):
        llm.generate([prompt], structured(regex="(unclosed"), use_tqdm=False)
    (out,) = llm.generate([prompt], structured(json=BASKET), use_tqdm=False)
    assert valid(BASKET, out.outputs[0].text)


# -- through vLLM's OpenAI server -------------------------------------------------------------------------


def _messages(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def _reply(client: openai.OpenAI, prompt: str, response_format: Any, **sampling: Any) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=_messages(prompt), response_format=response_format, **sampling
    )


def test_openai_parse_and_json_object(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none")
    reply = client.chat.completions.parse(
        model="smollm2", messages=_messages("Describe a person."), response_format=Person, temperature=0, max_tokens=100
    )
    assert isinstance(reply.choices[0].message.parsed, Person)
    reply = client.chat.completions.create(
        model="smollm2",
        messages=_messages("Give me JSON."),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_a_schema_vllms_backends_refuse_is_served_and_a_bad_one_is_a_400(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none")
    schema = BASKET  # uniqueItems: vLLM's guidance refuses it; multipleOf 0.25: xgrammar ignores it
    basket = {"type": "json_schema", "json_schema": {"name": "basket", "schema": schema}}
    for seed in range(3):
        reply = _reply(client, "Fill a fruit basket.", basket, temperature=1.0, seed=seed, max_tokens=80)
        assert valid(schema, reply.choices[0].message.content or ""), reply.choices[0].message.content
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"minimum": "no"}}}}}
    with pytest.raises(openai.BadRequestError, match="/properties/a/minimum"):
        client.chat.completions.create(model="smollm2", messages=_messages("x"), response_format=bad, max_tokens=5)


def test_max_tokens_is_never_overrun(server: str) -> None:
    """A six-key object at 40 tokens (vLLM's own backend cut it off into invalid JSON)."""
    client = openai.OpenAI(base_url=server, api_key="none")
    six = {"type": "json_schema", "json_schema": {"name": "six", "schema": SIX}}
    for budget in (26, 40):
        reply = _reply(client, "List six things.", six, temperature=0, max_tokens=budget)
        assert reply.usage is not None and reply.usage.completion_tokens <= budget
        assert reply.choices[0].finish_reason == "stop" and valid(SIX, reply.choices[0].message.content or "")


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tool_choice", ["required", "auto", "named"])
def test_tool_calls_with_vllms_hermes_parser(server: str, tool_choice: str, parallel: bool) -> None:
    client = openai.OpenAI(base_url=server, api_key="none")
    choice: Any = {"type": "function", "function": {"name": "get_time"}} if tool_choice == "named" else tool_choice
    reply = client.chat.completions.create(
        model="smollm2", messages=_messages("What's the weather in Paris? And the time in Berlin?"),
        tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=parallel, temperature=0, max_tokens=120,
    )  # fmt: skip
    message = reply.choices[0].message
    calls = message.tool_calls or []
    if tool_choice != "auto":
        assert calls, message.content
    if not parallel:
        assert len(calls) <= 1
    if tool_choice == "named":
        assert {c.function.name for c in calls} == {"get_time"}  # type: ignore[union-attr]
    for call in calls:
        schema = TOOLS[call.function.name]["function"]["parameters"]  # type: ignore[union-attr]
        assert valid(schema, call.function.arguments), call  # type: ignore[union-attr]


def test_sixteen_concurrent_requests_are_all_valid(server: str) -> None:
    client = openai.AsyncOpenAI(base_url=server, api_key="none")
    schemas = [BASKET, SIX, Person.model_json_schema(), {"type": "integer", "minimum": 10, "maximum": 99}]

    async def one(i: int) -> bool:
        schema = schemas[i % len(schemas)]
        reply = await client.chat.completions.create(
            model="smollm2", messages=_messages(f"Request {i}: give me a value."), temperature=1.0, seed=i,
            max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}},
        )  # fmt: skip
        return valid(schema, reply.choices[0].message.content or "")

    async def all_of_them() -> list[bool]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    assert all(asyncio.run(all_of_them()))


def test_instructor_tools_and_json_schema_modes(server: str) -> None:
    instructor = pytest.importorskip("instructor")
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=server, api_key="none"), mode=mode)
        person = client.chat.completions.create(
            model="smollm2",
            response_model=Person,
            max_retries=0,
            messages=_messages("Describe a person."),
            temperature=0,
            max_tokens=100,
        )
        assert isinstance(person, Person), mode


def test_langchain_structured_output_and_bound_tools(server: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(model="smollm2", base_url=server, api_key="none", temperature=0, max_tokens=100)
    for method in ("function_calling", "json_schema"):
        assert isinstance(model.with_structured_output(Person, method=method).invoke("Describe a person."), Person)

    def get_weather(city: str) -> str:
        """Get the weather of a city."""
        return city

    message = model.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
