"""Function calling: tool sources, their errors, the grammar of tools requests (matcher level, then every
output of a random-weight model), parsing whole and streamed, and the default model end to end."""

from __future__ import annotations

import copy
import functools
import json
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

import constrain
from constrain.match.bitmask import allocate_token_bitmask
from constrain.testing import accepts, allowed_ids, token_ids, walk
from constrain.tools.formats import TOOL_FORMATS


def get_weather(
    city: Annotated[str, Field(description="The city", max_length=20)],
    unit: Literal["celsius", "fahrenheit"] = "celsius",
) -> str:
    """Get the current weather in a city."""
    return f"22 degrees {unit} in {city}"


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: Annotated[str, Field(description="The city", max_length=20)]
    unit: Literal["celsius", "fahrenheit"] = "celsius"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["city"],
        },
    },
}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def call(name: str, arguments: str, fmt: str = "hermes") -> str:
    return TOOL_FORMATS[fmt].render([(name, arguments)])


def test_each_source_gives_the_same_tool():
    tools = [constrain.tool(WEATHER), constrain.tool(GetWeather, name="get_weather"), constrain.tool(get_weather)]
    assert tools[0].parameters == WEATHER["function"]["parameters"]
    assert tools[0].definition() == tools[1].definition() == tools[2].definition() == WEATHER
    grammars = {constrain.tool_calling([t]).constraint() for t in tools}
    assert len(grammars) == 1  # one grammar for the three
    assert constrain.tool(GetWeather).name == "GetWeather"
    assert constrain.tool(add, description="Sum.").description == "Sum."
    bare = constrain.tool({"type": "function", "function": {"name": "ping"}})  # no parameters: no arguments
    assert bare.validate("{}") == ({}, []) and bare.validate('{"x": 1}')[0] is None


def _untyped(city):
    return city


def _star(*cities: str) -> None:
    pass


@pytest.mark.parametrize(
    "source, match",
    [
        ({"type": "function", "function": {"name": "bad name!"}}, "'bad name!'.*1 to 64 letters"),
        ({"type": "tool", "function": {"name": "f"}}, '\'f\'.*"type": "function"'),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}, "'f'.*JSON object"),
        ({"type": "function", "function": {"name": "f", "parameters": "{}"}}, "'f'.*JSON Schema object"),
        (_untyped, "'_untyped'.*'city' has no type hint"),
        (_star, "'_star'.*'cities' cannot be passed by keyword"),
        (lambda x: x, "'<lambda>'.*1 to 64 letters"),
        ({"type": "function", "function": {"name": "auto"}}, "'auto'.*tool_choice values"),
        ({"type": "function", "function": {"name": "f", "foo": 1}}, "'f'.*unknown field 'function.foo'"),
        ({"type": "function", "function": {"name": "f"}, "extra": {}}, "'f'.*unknown field 'extra'"),
    ],
)
def test_bad_definitions_raise_tool_errors(source, match):
    with pytest.raises(constrain.ToolError, match=match):
        constrain.tool(source)


def test_bad_parameters_name_the_tool_and_the_keyword_path():
    malformed = {"type": "object", "properties": {"city": {"type": "strng"}}}
    with pytest.raises(constrain.ToolError, match=r"'f'.*'/properties/city/type'") as info:
        constrain.tool({"type": "function", "function": {"name": "f", "parameters": malformed}})
    assert isinstance(info.value.__cause__, constrain.SchemaError) and info.value.tool == "f"
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(constrain.ToolError, match=r"'g'.*'\$ref' at '/properties/a'") as info:
        constrain.tool({"type": "function", "function": {"name": "g", "parameters": remote}})
    assert isinstance(info.value.__cause__, constrain.UnsupportedSchemaError)


def test_bad_requests_are_refused():
    with pytest.raises(constrain.ToolError, match=r"'get_weather'.*two tools"):
        constrain.tool_calling([WEATHER, get_weather])
    with pytest.raises(constrain.ToolError, match=r"'nope'.*not among the tools"):
        constrain.tool_calling([WEATHER], tool_choice="nope")
    with pytest.raises(constrain.ToolError, match=r"'auto'.*not among"):  # the dict form names a tool
        constrain.tool_calling([WEATHER], tool_choice={"type": "function", "function": {"name": "auto"}})
    with pytest.raises(ValueError, match="tool_choice is"):
        constrain.tool_calling([WEATHER], tool_choice=3)
    with pytest.raises(ValueError, match="needs at least one tool"):
        constrain.tool_calling([], tool_choice="required")
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        constrain.tool_calling([WEATHER], parallel_tool_calls="yes")
    with pytest.raises(ValueError, match="a list of tools"):
        constrain.tool_calling(WEATHER)
    with pytest.raises(ValueError, match="Pydantic model class or a function"):
        constrain.tool(42)
    with pytest.raises(ValueError, match="drop constraint"):
        constrain.chat(None, [], tools=[WEATHER], constraint=constrain.regex("a"))


def test_formats_by_model_family():
    assert constrain.tool_format("smollm2-135m-instruct").name == "smollm2"
    assert constrain.tool_format("Qwen2.5-0.5B-Instruct").name == "hermes"
    assert constrain.tool_format(None).name == constrain.tool_format("SomeUnknownLM").name == "hermes"
    assert constrain.tool_format("json_list").name == "json_list"
    with pytest.raises(ValueError, match="trigger"):
        constrain.ToolFormat("x", "<call>", "<tool_call>", ",", "</tool_call>")


ONE = '{"city": "Paris"}'
TWO = '{"city": "Oslo", "unit": "fahrenheit"}'


@pytest.mark.parametrize("fmt", ["hermes", "smollm2", "json_list"])
def test_grammar_accepts_calls_and_rejects_violations(smol_tokenizer, fmt):
    def compiled(**kwargs):
        spec = constrain.tool_calling([get_weather, add], format=fmt, **kwargs)
        return constrain.compile(spec.constraint(), smol_tokenizer)

    def ok(grammar, text):
        return accepts(grammar, smol_tokenizer, text)

    spell = TOOL_FORMATS[fmt].render
    required, single = compiled(tool_choice="required"), compiled(tool_choice="required", parallel_tool_calls=False)
    auto, auto_single = compiled(), compiled(parallel_tool_calls=False)
    named = compiled(tool_choice={"type": "function", "function": {"name": "add"}})
    weather, weather2 = spell([("get_weather", ONE)]), spell([("get_weather", TWO)])
    sums = spell([("add", '{"a": 1, "b": -2}')])
    both = spell([("get_weather", ONE), ("add", '{"a": 1, "b": 2}')])
    for grammar in (required, single, auto, auto_single):
        assert ok(grammar, weather) and ok(grammar, weather2) and ok(grammar, sums)
        assert not ok(grammar, spell([("get_time", "{}")]))  # unknown tool
        assert not ok(grammar, spell([("get_weather", '{"city": 3}')]))  # wrong type
        assert not ok(grammar, spell([("get_weather", '{"unit": "celsius"}')]))  # required key missing
        assert not ok(grammar, spell([("get_weather", '{"city": "Paris", "country": "FR"}')]))  # closed
        assert not ok(grammar, spell([("get_weather", '{"city": "' + "x" * 21 + '"}')]))  # maxLength
        assert not ok(grammar, spell([("get_weather", '{"city":  "Paris"}')]))  # whitespace is bounded
    assert ok(required, both) and ok(auto, both)
    assert not ok(single, both) and not ok(auto_single, both)  # parallel_tool_calls=False: exactly one
    assert not ok(required, "It is sunny.") and not ok(required, "Sure. " + weather) and not ok(required, "")
    assert ok(auto, "It is sunny.") and ok(auto, "") and ok(auto, "Let me check. " + weather)
    assert not ok(auto, weather + " Done.")  # the calls end the reply
    assert ok(named, sums) and not ok(named, weather)
    forced = TOOL_FORMATS[fmt].begin + '{"name": "add", "arguments": {"a": '  # keys in schema order: forced too
    assert named.matcher().forced_text() == forced
    assert constrain.tool_calling([get_weather], tool_choice="none").constraint() is None


def test_auto_text_may_not_hold_the_trigger(smol_tokenizer):
    compiled = constrain.compile(constrain.tool_calling([get_weather]).constraint(), smol_tokenizer)
    assert accepts(compiled, smol_tokenizer, "Use <tool_ and [1, 2].")
    assert not accepts(compiled, smol_tokenizer, "Use <tool_call> tags.")


@pytest.mark.parametrize("fmt", ["hermes", "smollm2", "json_list"])
@pytest.mark.parametrize("parallel", [True, False])
def test_every_random_model_output_parses_into_valid_calls(tiny, fmt, parallel):
    messages = [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}]
    for seed in range(4):
        r = constrain.chat(tiny, messages, tools=[get_weather, add], tool_choice="required", tool_format=fmt,
                           parallel_tool_calls=parallel, max_tokens=96, seed=seed, temperature=1.3)  # fmt: skip
        assert r.valid and r.content == "", (r.generation.text, r.violations)
        assert len(r.tool_calls) >= 1 if parallel else len(r.tool_calls) == 1
        for c in r.tool_calls:
            assert c.arguments is not None and not c.violations
            assert json.loads(c.arguments_json).items() <= c.arguments.items()  # defaults filled in
            assert isinstance(c.run(), (int, str))


def test_random_model_in_auto_and_named_modes(tiny):
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    for seed in range(3):
        r = constrain.chat(tiny, messages, tools=[GetWeather, add], tool_format="json_list", max_tokens=24,
                           seed=seed, temperature=1.5)  # fmt: skip
        assert r.valid and r.content == r.generation.text and not r.tool_calls  # free text; no trigger
        named = constrain.chat(tiny, messages, tools=[GetWeather, add], tool_choice="GetWeather", max_tokens=64,
                               seed=seed, temperature=1.5)  # fmt: skip
        assert named.valid and [c.name for c in named.tool_calls] == ["GetWeather"] * len(named.tool_calls)
        assert all(isinstance(c.arguments, GetWeather) for c in named.tool_calls)
        assert named.finish_reason in ("tool_calls", "length")


PING = {"type": "function", "function": {"name": "ping", "description": "Check that the service is up."}}
SUM = '{"a": 1, "b": 2}'


def _token(tokenizer, text: str) -> int:
    (token,) = token_ids(tokenizer, text)
    return token


@pytest.mark.parametrize("fmt", ["hermes", "smollm2", "json_list"])
def test_a_named_tool_is_called_exactly_once(smol_tokenizer, fmt):
    """As OpenAI and vLLM do, whatever parallel_tool_calls says: the grammar admits one call, then the end."""
    spell, end = TOOL_FORMATS[fmt].render, TOOL_FORMATS[fmt].end
    for choice in ("add", {"type": "function", "function": {"name": "add"}}):
        spec = constrain.tool_calling([get_weather, add], tool_choice=choice, parallel_tool_calls=True, format=fmt)
        compiled = constrain.compile(spec.constraint(), smol_tokenizer)
        one = spell([("add", SUM)])
        assert accepts(compiled, smol_tokenizer, one)
        assert not accepts(compiled, smol_tokenizer, spell([("add", SUM), ("add", '{"a": 3, "b": 4}')]))
        ok, matcher = walk(compiled, token_ids(smol_tokenizer, one[: len(one) - len(end)]))
        assert ok and matcher.forced_text() == end  # after the call, only the end


def test_a_named_tool_is_called_once_by_a_model_that_would_go_on(tiny):
    comma = _token(tiny.tokenizer, ",")  # smollm2's separator: biased, the model would call again and again
    messages = [{"role": "user", "content": "Ping."}]
    for seed in range(2):
        r = constrain.chat(tiny, messages, tools=[add, PING], tool_choice="ping", tool_format="smollm2",
                           max_tokens=64, seed=seed, logit_bias={comma: 100.0})  # fmt: skip
        assert r.valid and [c.name for c in r.tool_calls] == ["ping"] and r.finish_reason == "tool_calls", r


def _allowed_after(grammar, tokenizer, text: str) -> set[int]:
    """The tokens allowed after ``text``: the grammar's mask, then the repeated-call filter."""
    compiled = constrain.compile(grammar, tokenizer)
    ok, matcher = walk(compiled, token_ids(tokenizer, text))
    assert ok, text
    calls = grammar.mask_filter(compiled.tokenizer)
    calls.feed(text)
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    calls.apply(matcher, "", bitmask[0])
    return allowed_ids(bitmask[0], compiled.vocab_size)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_mask_forbids_completing_a_call_identical_to_an_earlier_one(smol_tokenizer, choice):
    grammar = constrain.tool_calling([get_weather, add, PING], tool_choice=choice, format="smollm2").constraint()
    ids = functools.partial(_token, smol_tokenizer)
    start = "Sure. " if choice == "auto" else ""
    first = start + '<tool_call>[{"name": "add", "arguments": ' + SUM + '}, {"name": "add", "arguments": {"a": 1, "b": '
    repeat = _allowed_after(grammar, smol_tokenizer, first + "2")
    assert ids("}") not in repeat and ids("}}") not in repeat  # add(1, 2) again: forbidden
    assert ids("3") in repeat  # add(1, 23) is another call
    assert {ids("}"), ids("}}")} <= _allowed_after(grammar, smol_tokenizer, first + "3")  # add(1, 3): allowed
    assert ids("2") in _allowed_after(grammar, smol_tokenizer, first)
    # a tool without arguments: its name alone would repeat it, and is forbidden
    pinged = start + '<tool_call>[{"name": "ping", "arguments": {}}, {"name": "'
    names = _allowed_after(grammar, smol_tokenizer, pinged)
    assert ids("ping") not in names and ids("add") in names


def test_a_string_closed_before_a_forced_brace_cannot_repeat_a_call(smol_tokenizer):
    """A call's last argument a string: the ``"`` that closes it leaves ``}`` forced, where the filter does not
    act, so ``lookup(city="Paris")`` was written twice (greedy SmolLM2 wrote ``get_weather("Marlo Lopez")``
    twice). A token closing the string with a value an earlier call holds is now tried with its forced text."""
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    grammar = constrain.tool_calling([lookup], tool_choice="required", format="smollm2").constraint()
    quote = _token(smol_tokenizer, '"')
    second = (
        '<tool_call>[{"name": "lookup", "arguments": {"city": "Paris"}}, {"name": "lookup", "arguments": {"city": "'
    )
    assert quote not in _allowed_after(grammar, smol_tokenizer, second + "Paris")  # Paris again: forbidden
    assert quote in _allowed_after(grammar, smol_tokenizer, second + "Pari")  # Pari: another call
    assert quote in _allowed_after(grammar, smol_tokenizer, second + "Rome")


def test_when_only_a_repeat_could_follow_the_calls_end(smol_tokenizer):
    """The filter looks through the text the grammar forces: the separator is forbidden, the end is not."""
    grammar = constrain.tool_calling([PING], tool_choice="required", format="smollm2").constraint()
    allowed = _allowed_after(grammar, smol_tokenizer, '<tool_call>[{"name": "ping", "arguments": {}}')
    assert _token(smol_tokenizer, ",") not in allowed and _token(smol_tokenizer, "]") in allowed
    single = constrain.tool_calling([PING], tool_choice="required", parallel_tool_calls=False).constraint()
    assert single.mask_filter(constrain.compile(single, smol_tokenizer).tokenizer) is None  # one call: no filter


def test_a_token_past_forced_text_cannot_start_a_repeated_call(smol_tokenizer):
    """``get_time({})`` was written three times (greedy SmolLM2, through the server): after ``{}`` the ``}`` is
    forced, and the token ``},`` went on past it to choose the separator, where the filter did not act. Such
    tokens are now tried; those within the forced text and the end of the calls stay allowed."""
    grammar = constrain.tool_calling([PING], tool_choice="required", format="smollm2").constraint()
    inside = '<tool_call>[{"name": "ping", "arguments": {}'
    compiled = constrain.compile(grammar, smol_tokenizer)
    ok, matcher = walk(compiled, token_ids(smol_tokenizer, inside))
    assert ok and matcher.forced_text() == "}"
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    again, brace, end = (_token(smol_tokenizer, text) for text in ("},", "}", "}]"))
    assert {again, brace, end} <= set(allowed_ids(bitmask[0], compiled.vocab_size))  # the grammar's choice
    allowed = _allowed_after(grammar, smol_tokenizer, inside)
    assert again not in allowed and {brace, end} <= allowed


@pytest.mark.parametrize(("fmt", "separator"), [("smollm2", ","), ("hermes", "\n")])
def test_a_model_biased_to_call_again_does_not_repeat_a_call(tiny, fmt, separator):
    bias = {_token(tiny.tokenizer, separator): 100.0}
    messages = [{"role": "user", "content": "Ping."}]
    for seed in range(2):
        r = constrain.chat(tiny, messages, tools=[PING], tool_choice="required", tool_format=fmt, max_tokens=64,
                           seed=seed, logit_bias=bias)  # fmt: skip
        assert r.valid and [c.name for c in r.tool_calls] == ["ping"] and r.finish_reason == "tool_calls", r


def test_streamed_parse_equals_the_whole_parse(tiny):
    spec = constrain.tool_calling([get_weather, add], tool_choice="required", format="smollm2")
    for seed in range(3):
        events = list(constrain.stream(tiny, "Call:", constraint=spec.constraint(), max_tokens=96, seed=seed,
                                       temperature=1.3))  # fmt: skip
        parser = spec.parser()
        deltas = [parser.feed(e.delta) for e in events[:-1]] + [parser.finish()]
        streamed, whole = parser.result(), spec.parse(events[-1].text)
        assert streamed.valid and whole.valid and whole.tool_calls
        assert [(c.name, c.arguments, c.arguments_json) for c in streamed.tool_calls] == [
            (c.name, c.arguments, c.arguments_json) for c in whole.tool_calls
        ]
        pieces = [d for delta in deltas for d in delta.tool_calls]
        for index, c in enumerate(streamed.tool_calls):
            mine = [d for d in pieces if d.index == index]
            assert mine[0].name == c.name and mine[0].id == c.id and mine[0].arguments == ""
            assert all(d.name is None for d in mine[1:]) and "".join(d.arguments for d in mine) == c.arguments_json


def test_parser_by_character_holds_back_a_possible_trigger():
    spec = constrain.tool_calling([get_weather, add])
    text = "Check <tool_ first. " + TOOL_FORMATS["hermes"].render([("get_weather", ONE), ("add", '{"a": 1, "b": 2}')])
    parser = spec.parser()
    deltas = [parser.feed(ch) for ch in text]
    assert "".join(d.content for d in deltas) == "Check <tool_ first. "
    assert deltas[text.index("_ first")].content == ""  # "<tool" could still start the trigger
    assert parser.finish().content == ""
    reply = parser.result()
    assert reply.valid and [c.name for c in reply.tool_calls] == ["get_weather", "add"]
    assert [c.run() for c in reply.tool_calls] == ["22 degrees celsius in Paris", 3]
    held = spec.parser()
    assert held.feed("Almost <tool_c").content == "Almost " and held.finish().content == "<tool_c"
    assert held.result().content == "Almost <tool_c" and held.result().valid


def test_parse_reports_violations():
    spec = constrain.tool_calling([get_weather, WEATHER | {"function": {"name": "raw", "parameters": {}}}])
    bad = spec.parse(call("get_weather", '{"city": 3}'))
    assert bad.tool_calls[0].arguments is None and "tool call 0 (get_weather): /city" in bad.violations[0]
    with pytest.raises(ValueError, match="invalid arguments"):
        bad.tool_calls[0].run()
    raw = spec.parse(call("raw", '{"x": [1, "}"]}'))
    assert raw.valid and raw.tool_calls[0].arguments == {"x": [1, "}"]}
    with pytest.raises(ValueError, match="not given as a Python function"):
        raw.tool_calls[0].run()
    assert "unknown tool 'nope'" in spec.parse(call("nope", "{}")).violations[0]
    broken = spec.parse(call("raw", '{"x": [1}'))
    assert broken.violations[0].startswith("the arguments are not JSON: expected ',' or ']', got '}' at character")
    assert broken.tool_calls[0].arguments_json == '{"x": [1' and broken.tool_calls[0].arguments is None
    assert "expected the arguments' JSON object" in spec.parse(call("raw", " {}")).violations[0]
    cut = spec.parse(call("get_weather", ONE)[:-20])
    assert "ended inside the tool calls" in cut.violations[0] and cut.tool_calls[0].arguments is None
    assert "text after the tool calls" in spec.parse(call("get_weather", ONE) + " ok").violations[0]
    required = constrain.tool_calling([get_weather], tool_choice="required")
    assert "calls no tool" in required.parse("").violations[0]
    assert "expected" in required.parse("Sure!").violations[0]
    none = constrain.tool_calling([get_weather], tool_choice="none")
    assert none.parse(call("get_weather", ONE)).content == call("get_weather", ONE)  # "none" parses no call
    with pytest.raises(ValueError, match="finish"):
        spec.parser().result()


def test_prompt_falls_back_to_a_system_message(smol_tokenizer):
    spec = constrain.tool_calling([get_weather], format="smollm2")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": ONE}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 degrees"},
    ]  # fmt: skip
    before = copy.deepcopy(messages)
    prompt = spec.prompt(smol_tokenizer, messages)
    assert messages == before  # not mutated
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call the following tools")
    assert json.dumps([constrain.tool(get_weather).definition()]) in prompt
    assert '<tool_call>[{"name": "tool_name", "arguments": {"argument": "value"}}, {"name": "other_tool"' in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
        in prompt
    )
    assert "<|im_start|>user\n<tool_response>\n22 degrees\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    alone = constrain.tool_calling([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    prompt = alone.prompt(smol_tokenizer, [{"role": "user", "content": "Hi"}])
    assert "You must call the tool 'get_weather'." in prompt and "other_tool" not in prompt


def test_prompt_uses_a_template_that_takes_tools(smol_tokenizer):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}[{{ m.content }}]{% endfor %}TOOLS={{ tools | tojson }}"
    prompt = constrain.tool_calling([add]).prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert prompt == "[Hi]TOOLS=" + json.dumps([constrain.tool(add).definition()])


def test_prompt_drops_the_bos_that_encoding_adds(gemma_tokenizer):
    tokenizer = copy.deepcopy(gemma_tokenizer)
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    prompt = constrain.tool_calling([add], tool_choice="none").prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert prompt.startswith("You can call") and tokenizer.encode(prompt).count(tokenizer.bos_token_id) == 1


@pytest.mark.real_model
def test_default_model_calls_tools_end_to_end(smollm2):
    handle = smollm2
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    for choice in ("required", "get_weather"):
        r = constrain.chat(handle, messages, tools=[get_weather, add], tool_choice=choice, temperature=0,
                           max_tokens=60)  # fmt: skip
        assert r.valid and r.finish_reason == "tool_calls", r
        assert r.generation.text.startswith('<tool_call>[{"name": "')  # SmolLM2's format, from its name
        assert r.tool_calls and all(c.arguments is not None for c in r.tool_calls)
        if choice == "get_weather":
            assert [c.name for c in r.tool_calls] == ["get_weather"] and "degrees" in r.tool_calls[0].run()


@pytest.mark.real_model
@pytest.mark.parametrize("prompt", ["What's the weather in Tokyo?", "Tell me a joke."])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_tools_under_speculation_give_plain_decodings_reply(smollm2, prompt, parallel):
    """``tool_choice="auto"`` with every draft fed (a free forward pass): prompt lookup copies the chat
    template's end of turn, which terminates the tools grammar; drafts stop short of it (this raised
    xgrammar's "terminated ... trying to find the next token mask"), and the reply is plain decoding's."""
    from constrain.models.cost import ForwardCost

    ask = functools.partial(constrain.chat, smollm2, [{"role": "user", "content": prompt}], tools=[WEATHER],
                            tool_choice="auto", parallel_tool_calls=parallel, temperature=0, max_tokens=48)  # fmt: skip
    drafted, plain = ask(forward_cost=ForwardCost((1, 64), (1.0, 1.0))), ask(speculative=False, jump_forward=False)
    assert drafted.generation.token_ids == plain.generation.token_ids
    assert (drafted.content, drafted.tool_calls, drafted.finish_reason) == (plain.content, plain.tool_calls,
                                                                             plain.finish_reason)  # fmt: skip
    assert drafted.violations == []


BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "day": {"type": "string", "format": "date"},
                "at": {"type": "string", "format": "date-time"},
            },
            "required": ["day", "at"],
        },
    },
}


@pytest.mark.parametrize("choice", ["required", "book"])
def test_a_forced_call_with_dated_arguments_fits_its_budget(tiny, choice):
    """The closing search takes its hints from the arguments' schemas too (a date's example): without
    them it found no way through a date's pattern, and every forced call of such a tool was refused up
    front, "no valid output fits" (instructor's default mode on a model with a ``date`` field)."""
    from constrain.match.hints import hints

    spec = constrain.tool_calling([BOOK], tool_choice=choice)
    matcher = constrain.compile(spec.constraint(), tiny.tokenizer).matcher()
    assert {"2000-01-01", "2000-01-01T00:00:00Z"} <= set(hints(matcher))
    for seed in range(2):
        r = constrain.chat(tiny, [{"role": "user", "content": "Book it."}], tools=[BOOK], tool_choice=choice,
                           max_tokens=120, seed=seed, temperature=1.3)  # fmt: skip
        assert r.valid and [c.name for c in r.tool_calls] == ["book"], (r.generation.text, r.violations)


def test_a_stop_string_inside_a_call_ends_the_reply_with_stop(tiny):
    """The calls are not whole: ``"tool_calls"`` would tell a client to run them (it said so, with the
    arguments cut at the stop string); ``"stop"``, and the violations say what is missing."""
    whole = constrain.chat(tiny, [{"role": "user", "content": "Weather?"}], tools=[get_weather],
                           tool_choice="required", max_tokens=64, temperature=0)  # fmt: skip
    assert whole.finish_reason == "tool_calls" and whole.valid
    cut = whole.generation.text[: whole.generation.text.index('"city"') + 8]  # inside the first argument
    r = constrain.chat(tiny, [{"role": "user", "content": "Weather?"}], tools=[get_weather], tool_choice="required",
                       max_tokens=64, temperature=0, stop=[whole.generation.text[len(cut):len(cut) + 2]])  # fmt: skip
    assert r.finish_reason == "stop" and not r.valid, (r.generation.text, r.finish_reason)
    assert "the reply ended inside the tool calls" in r.violations
