"""The OpenAI-compatible server, started on a loopback port and driven with the official ``openai`` client.

Most tests serve the tiny random-weight model (its text is noise, but every constrained output must
still be valid); two serve the default model end to end.
"""

from __future__ import annotations

import dataclasses
import gc
import http.client
import json
import logging
import socket
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import regex as regex_module

import constrain
from constrain.testing import PERSON_SCHEMA as PERSON
from constrain.testing import WEATHER_TOOL as WEATHER
from constrain.testing import LocalServer

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
REMOTE_REF = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}


class Server(LocalServer):
    """The real server (uvicorn on a free loopback port) and an ``openai`` client for it."""

    def __init__(self, handle: constrain.ModelHandle, **options) -> None:
        super().__init__(handle, **options)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def raw(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
        """(status, JSON body) of a plain HTTP request (bodies the openai client would not send)."""
        conn = http.client.HTTPConnection(self.url.removeprefix("http://"), timeout=60)
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        try:
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server(tiny) -> Iterator[Server]:
    s = Server(tiny)
    yield s
    s.stop()


def _chat(server, content="Hi", **kwargs):
    return server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": content}], **kwargs
    )


def test_health_and_models(server):
    assert server.raw("GET", "/health") == (200, {"status": "ok"})
    assert [m.id for m in server.client.models.list().data] == [server.model]
    assert server.client.models.retrieve(server.model).id == server.model  # was a 404
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")


def test_null_means_the_default(server):
    """Clients that send every field send null for the defaults: was a 400 for these four."""
    base = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    fields = {"n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None}
    status, body = server.raw("POST", "/v1/chat/completions", json.dumps({**base, **fields}).encode())
    assert status == 200 and len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None, body


def test_completions_take_token_ids(server):
    tokenizer = server.app.state.engine.handle.tokenizer
    ids = tokenizer.encode("One, two,", add_special_tokens=False)
    by_text = server.client.completions.create(model=server.model, prompt="One, two,", max_tokens=5, temperature=0)
    by_ids = server.client.completions.create(model=server.model, prompt=ids, max_tokens=5, temperature=0)
    two = server.client.completions.create(model=server.model, prompt=[ids, ids[:1]], max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text == two.choices[0].text and len(two.choices) == 2
    assert by_ids.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=server.model, prompt=[10**9], max_tokens=2)


def test_plain_chat_with_usage_and_length(server):
    r = _chat(server, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_json_schema_response_format_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = _chat(server, response_format=fmt, max_tokens=60, temperature=1.0, seed=3, n=3)
    assert len(r.choices) == 3
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = _chat(server, response_format={"type": "json_object"}, max_tokens=40, seed=1)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choices_and_grammar_extensions(server):
    r = _chat(server, extra_body={"regex": r"\d{3}-[a-z]{2}"}, seed=2)
    assert regex_module.fullmatch(r"\d{3}-[a-z]{2}", r.choices[0].message.content)
    r = _chat(server, extra_body={"choices": ["red", "green", "blue"]}, seed=2)
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = _chat(server, extra_body={"grammar": "arithmetic"}, max_tokens=30, seed=2)
    arithmetic = constrain.compile(constrain.grammar("arithmetic"), server.app.state.engine.handle.tokenizer)
    assert arithmetic.validate(r.choices[0].message.content) == []  # complete even when closed in budget


def test_seeds_reproduce_and_n_choices_differ(server):
    a = _chat(server, max_tokens=12, seed=11, n=2, temperature=1.0)
    b = _chat(server, max_tokens=12, seed=11, n=2, temperature=1.0)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content


def test_logprobs(server):
    r = _chat(server, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)  # greedy took the top token


def test_constrained_logprobs_list_only_allowed_tokens(server):
    """Where the mask allows fewer tokens than asked for (an enum's forced text), fewer come back: a
    masked token is no alternative, and its -inf is no number JSON carries (it was a 500)."""
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"]}
    kwargs = {"max_tokens": 20, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    content = _chat(server, **kwargs).choices[0].logprobs.content
    assert any(len(t.top_logprobs) < 3 for t in content)
    assert all(1 <= len(t.top_logprobs) <= 3 and t.logprob > -9999 for t in content)
    streamed = [c for c in _chat(server, stream=True, **kwargs) if c.choices and c.choices[0].logprobs]
    assert sum(len(c.choices[0].logprobs.content) for c in streamed) == len(content)


def test_streamed_logprobs_match_the_whole_response(server):
    kwargs = {"max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = _chat(server, **kwargs).choices[0].logprobs.content
    chunks = [c for c in _chat(server, stream=True, **kwargs) if c.choices and c.choices[0].logprobs]
    streamed = [t for c in chunks for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in whole]
    assert len(streamed) == len(whole) > 0 and all(len(t.top_logprobs) == 2 for t in streamed)


def test_logprobs_bytes_are_the_tokens_own_and_every_logprob_a_number(server):
    """A token holding part of a character: its ``bytes`` were U+FFFD's; they now join into the content's
    UTF-8. A token the budget forced had a null logprob, which broke ``sum``; each is now a number."""
    r = _chat(server, extra_body={"choices": ["🎉🚀", "ok"]}, logit_bias=None, seed=0, logprobs=True, max_tokens=12)
    choice = r.choices[0]
    assert b"".join(bytes(t.bytes) for t in choice.logprobs.content) == choice.message.content.encode()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    closed = [_chat(server, response_format=fmt, max_tokens=12, seed=seed, temperature=1.0, logprobs=True).choices[0]
              for seed in range(4)]  # fmt: skip
    assert any(c.model_extra.get("closed_early") for c in closed)
    assert all(isinstance(t.logprob, float) for c in closed for t in c.logprobs.content)


def test_a_stream_reports_violations_in_its_last_chunk(server):
    """A lenient schema cut by a stop string: the whole response's choice has ``violations``; the stream's
    last chunk had none (a client got broken JSON with ``finish_reason: "stop"`` and no signal)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kwargs = {"response_format": fmt, "max_tokens": 40, "seed": 3, "stop": ['"']}
    whole = _chat(server, **kwargs).choices[0]
    assert whole.model_extra.get("violations"), whole
    last = [c.choices[0] for c in _chat(server, stream=True, **kwargs) if c.choices][-1]
    assert last.model_extra.get("violations") == whole.model_extra["violations"]
    completion = {
        "model": server.model,
        "prompt": "One",
        "max_tokens": 20,
        "stop": ['"'],
        "extra_body": {"regex": 'a"b'},
    }
    done = server.client.completions.create(**completion).choices[0]
    streamed = [c.choices[0] for c in server.client.completions.create(stream=True, **completion) if c.choices][-1]
    assert (
        done.model_extra.get("violations") and streamed.model_extra.get("violations") == done.model_extra["violations"]
    )


def test_streaming_matches_the_whole_response(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = _chat(server, response_format=fmt, max_tokens=60, seed=5)
    chunks = list(_chat(server, response_format=fmt, max_tokens=60, seed=5, stream=True,
                        stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices


def test_a_developer_message_is_a_system_message(server):
    """OpenAI's ``developer`` role: was rendered under its own name, beside the template's default system prompt."""
    usage = [server.client.chat.completions.create(model=server.model, max_tokens=1, messages=[
                 {"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]).usage.prompt_tokens
             for role in ("developer", "system")]  # fmt: skip
    assert usage[0] == usage[1]


def test_a_negative_seed_is_openais_and_reproducible(server):
    """OpenAI's seed is a signed 64-bit integer: ``seed=-1`` was a 400. It is the seed ``2**63 - 1``."""
    runs = [server.client.completions.create(model=server.model, prompt="One", max_tokens=8, seed=seed, temperature=1)
            for seed in (-1, -1, 2**63 - 1)]  # fmt: skip
    assert runs[0].choices[0].text == runs[1].choices[0].text == runs[2].choices[0].text
    with pytest.raises(openai.BadRequestError, match="seed"):
        server.client.completions.create(model=server.model, prompt="One", max_tokens=2, seed=2**63)


def test_completions_endpoint(server):
    r = server.client.completions.create(model=server.model, prompt=["One", "Two"], max_tokens=6, n=2, seed=4,
                                         logprobs=1)  # fmt: skip
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in r.choices)
    streamed = server.client.completions.create(model=server.model, prompt="One", max_tokens=6, seed=4, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "status", "needle"),
    [
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 2}, 400, "top_p"),
        ({"extra_body": {"temprature": 0.5}}, 400, "temprature"),
        ({"extra_body": {"regex": "(ab"}}, 400, "regex"),
        ({"extra_body": {"grammar": "root ::= ("}}, 400, "grammar"),
        ({"extra_body": {"choices": []}}, 400, "choices"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
            400,
            "/properties/a",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "strict": True, "schema": REMOTE_REF},
                }
            },
            400,
            "/properties/a",
        ),
        ({"response_format": {"type": "xml"}}, 400, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "get_time"}, 400, "get_time"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "word " * 1100}]}, 400, "context window"),
        ({"max_tokens": 10**12}, 400, "max_tokens=1000000000000 does not fit"),  # was run until the window was spent
        ({"n": 0}, 400, "n"),
        ({"model": "gpt-4"}, 404, "gpt-4"),
    ],
)
def test_bad_requests_get_openai_errors(server, kwargs, status, needle):
    kwargs = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        server.client.chat.completions.create(**kwargs)
    assert info.value.status_code == status
    error = info.value.body
    assert needle in error["message"] and error["type"] == "invalid_request_error", error


def test_a_tool_result_sent_back_without_tools_gets_a_reply(server):
    """The agent's last turn, ``tools`` left out: was a 500 (the chat template knew no tool messages)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "22C"}]  # fmt: skip
    r = server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=6, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0


def test_json_schema_without_schema_returns_a_json_object(server):
    """Issue 28: it got any JSON value (a quoted sentence from a chat model); now ``json_object``'s constraint."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer"}}
    r = _chat(server, "Tell me about Paris.", response_format=fmt, max_tokens=40, seed=1, n=3)
    assert all(isinstance(json.loads(choice.message.content), dict) for choice in r.choices)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"tool_choice": "none"}, "tool_choice"),
        ("/v1/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
         "response_format.json_schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
        ("/v1/chat/completions", {"length_penalty": 0.5}, "length_penalty"),
        ("/v1/chat/completions", {"max_completion_tokens": 5}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"stop": [1]}, "stop"),  # was "stop.str", a union member's name
        ("/v1/completions", {"stop": {"a": 1}}, "stop"),
        ("/v1/chat/completions", {"max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),  # were coerced: 1, 2, a stream, 5
        ("/v1/chat/completions", {"n": "2"}, "n"),
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"max_tokens": 5.0}, "max_tokens"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": []}, "prompt"),
    ],
)  # fmt: skip
def test_a_field_that_would_do_nothing_is_refused_by_name(server, path, fields, param):
    """A field given where it cannot act is a 400 whose ``param`` names it (protocol's module docstring)."""
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    body = {"model": server.model, "max_tokens": 4, **base, **fields}
    status, error = server.raw("POST", path, json.dumps(body).encode())
    assert status == 400 and error["error"]["param"] == param, error
    assert error["error"]["message"].startswith(param + ": ") and error["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "fields", "param", "needle"),
    [
        ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "tool_choice names a tool"),  # was "tools"
        ("/v1/chat/completions", {"max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": PERSON}}}, "max_tokens", "no valid output fits"),  # was null
        ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice",
         "tool_choice is"),  # was null
        ("/v1/chat/completions", {"grammar": 'root ::= "a" root'}, "grammar", "matches no finite text"),
        ("/v1/chat/completions", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json",
         "invalid JSON Schema"),
        ("/v1/completions", {"regex": "a("}, "regex", "invalid regex"),
        ("/v1/chat/completions", {"max_tokens": 10**5}, "max_tokens", "does not fit"),  # was null
        ("/v1/completions", {"max_tokens": 10**5}, "max_tokens", "does not fit"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1100}]}, "messages",
         "context window"),  # was null
        ("/v1/completions", {"prompt": "word " * 1100}, "prompt", "context window"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": BAD_SCHEMA}}}, "response_format.json_schema.schema", "invalid JSON Schema"),
    ],
)  # fmt: skip
def test_an_admission_error_names_the_field_at_fault(server, path, fields, param, needle):
    """A constraint, tool or budget refused when the request is admitted: the 400's ``param`` is the field
    that carried it."""
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    status, error = server.raw("POST", path, json.dumps({"model": server.model, **base, **fields}).encode())
    assert status == 400 and error["error"]["param"] == param and needle in error["error"]["message"], error


def test_malformed_body_and_unknown_path(server):
    status, body = server.raw("POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    truncated = json.dumps({"model": server.model, "messages": [{"role": "user", "content": "Hi"}]})[:-1].encode()
    status, body = server.raw("POST", "/v1/chat/completions", truncated)  # its param was the offset
    assert status == 400 and body["error"]["param"] is None, body
    assert (
        body["error"]["message"].startswith("the request body is not JSON: ")
        and "(character" in body["error"]["message"]
    )
    status, body = server.raw("GET", "/v1/nothing")
    assert status == 404 and "error" in body


def test_tool_choice_required_named_and_auto(server):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = _chat(server, "Weather in Paris?", tools=[WEATHER, TIME], tool_choice=choice, seed=1, max_tokens=80)
        message = r.choices[0].message
        # a random model may go on calling: the budget then closes the last call, still valid ("tool_calls",
        # closed_early); "length" only where a call is cut
        assert r.choices[0].finish_reason in ("tool_calls", "length"), r
        assert message.tool_calls and all(c.id and c.type == "function" for c in message.tool_calls)
        for call in message.tool_calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        if isinstance(choice, dict):
            assert {c.function.name for c in message.tool_calls} == {"get_time"}
    r = _chat(server, "Hello", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=2)
    assert len(r.choices[0].message.tool_calls) == 1
    r = _chat(server, "Hello", tools=[WEATHER], tool_choice="auto", seed=3, max_tokens=20)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_named_tool_choice_gives_one_call_even_with_parallel_calls(server):
    """LangChain's ``bind_tools(..., tool_choice=name)``: one call of that tool, as OpenAI and vLLM give."""
    again = server.app.state.engine.handle.tokenizer.encode("\n", add_special_tokens=False)[0]
    for choice in ("get_time", {"type": "function", "function": {"name": "get_time"}}):
        r = _chat(server, "Time in Oslo?", tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=True,
                  seed=4, max_tokens=120, logit_bias={str(again): 100})  # the bias asks for another call  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"] and r.choices[0].finish_reason == "tool_calls", r


def test_a_budget_closed_result_finishes_with_stop_and_says_so(server):
    """Complete and valid, but closed by the termination budget: ``stop`` (clients keep the object), with
    ``closed_early`` and ``forced_tokens`` on the choice; streamed and not, chat and completions."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = {"response_format": fmt, "max_tokens": 12, "seed": 1, "temperature": 1.0}
    choice = _chat(server, **kwargs).choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop" and choice.model_extra["closed_early"] is True
    assert choice.model_extra["forced_tokens"] > 0
    last = [c.choices[0] for c in _chat(server, stream=True, **kwargs) if c.choices][-1]
    assert last.finish_reason == "stop" and last.model_extra["closed_early"] is True
    assert last.model_extra["forced_tokens"] == choice.model_extra["forced_tokens"]
    email = {"model": server.model, "prompt": "One", "max_tokens": 6, "seed": 0,
             "extra_body": {"regex": r"[a-z]{1,30}@[a-z]{1,30}\.com"}}  # fmt: skip
    done = server.client.completions.create(**email).choices[0]
    assert regex_module.fullmatch(r"[a-z]{1,30}@[a-z]{1,30}\.com", done.text)
    assert done.finish_reason == "stop" and done.model_extra["closed_early"] is True
    last = [c.choices[0] for c in server.client.completions.create(stream=True, **email) if c.choices][-1]
    assert last.finish_reason == "stop" and last.model_extra["closed_early"] is True
    plain = _chat(server, max_tokens=3, temperature=0).choices[0]  # cut by max_tokens: still "length"
    assert plain.finish_reason == "length" and "closed_early" not in plain.model_extra


def test_only_a_complete_valid_closed_result_becomes_stop():
    from constrain.serving.protocol import finish_fields

    closed = constrain.GenerationResult("{}", {}, "length", [1], constrain.Usage(1, 1), closed_early=True,
                                        forced_tokens=2)  # fmt: skip
    assert finish_fields(closed, None) == {"finish_reason": "stop", "closed_early": True, "forced_tokens": 2}
    broken = dataclasses.replace(closed, violations=["/age: required"])
    assert finish_fields(broken, None) == {"finish_reason": "length", "closed_early": True, "forced_tokens": 2}
    cut = dataclasses.replace(closed, closed_early=False, forced_tokens=0)
    assert finish_fields(cut, None) == {"finish_reason": "length"}


def test_streamed_tool_calls_reassemble(server):
    kwargs = {"tools": [WEATHER, TIME], "tool_choice": "required", "seed": 6, "max_tokens": 80}
    whole_choice = _chat(server, "Weather?", **kwargs).choices[0]
    whole = whole_choice.message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in _chat(server, "Weather?", stream=True, **kwargs):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert reasons[-1] == whole_choice.finish_reason and all(c["id"] for c in calls.values())


def test_a_client_that_disconnects_is_cancelled(server):
    engine = server.app.state.engine
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    messages = [{"role": "user", "content": "Go on"}]
    body = {"model": server.model, "stream": True, "messages": messages, "max_tokens": 900}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    response = conn.getresponse()
    for line in response:
        if line.startswith(b"data:") and b'"content": ""' not in line:
            break  # the first generated text: the request is running
    assert engine.running
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert engine.wait_idle(timeout=10)  # cancelled: its row left the batch long before 900 tokens


def test_concurrent_clients_all_complete_valid(server):
    """32 clients x 3 requests with mixed constraints: none lost, every output valid, and batched."""
    engine = server.app.state.engine

    def client(k: int) -> list[bool]:
        ok = []
        for j in range(3):
            kind = (k + j) % 4
            if kind == 0:
                fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
                r = _chat(server, response_format=fmt, seed=k * 10 + j, max_tokens=60)
                jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
            elif kind == 1:
                r = _chat(server, extra_body={"regex": r"[a-z]{2}\d{2}"}, seed=k)
                ok.append(bool(regex_module.fullmatch(r"[a-z]{2}\d{2}", r.choices[0].message.content)))
                continue
            elif kind == 2:
                r = _chat(server, tools=[WEATHER], tool_choice="required", seed=k, max_tokens=80)
                assert r.choices[0].message.tool_calls
            else:
                r = _chat(server, max_tokens=10, seed=k)
            ok.append(r.choices[0].finish_reason in ("stop", "length", "tool_calls"))
        return ok

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client, range(32)))
    assert all(all(r) and len(r) == 3 for r in results)
    assert engine.running == 0 and engine.waiting == 0
    assert engine.peak_batch >= 8  # requests shared the batch


@pytest.mark.real_model
def test_default_model_end_to_end(smollm2):
    handle = smollm2
    s = Server(handle)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        r = _chat(s, "Extract: Maria Lopez is 42.", response_format=fmt, temperature=0)
        value = json.loads(r.choices[0].message.content)
        jsonschema.validate(value, PERSON)
        assert value["age"] == 42
        r = _chat(s, "What is the weather in Paris, in celsius?", tools=[WEATHER], tool_choice="required",
                  temperature=0)  # fmt: skip
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    finally:
        s.stop()


def test_serve_freezes_the_startup_heap(tiny, monkeypatch):
    """``constrain serve`` moves the objects loaded at startup out of the collector's full passes."""
    import gc

    import uvicorn

    from constrain.serving.server import serve

    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: ran.append((app, options)))
    gc.unfreeze()
    with warnings.catch_warnings():  # what earlier tests left for the collector (a client's socket) is theirs
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    try:
        serve(tiny, port=1, prefix_cache_bytes=1 << 20)
        assert ran and ran[0][1]["port"] == 1
        assert ran[0][0].state.engine._new_loop().prefixes.max_bytes == 1 << 20  # the setting reaches the loop
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        for app, _ in ran:
            for handler in app.router.on_shutdown:  # the engine's thread
                handler()


def test_an_internal_value_error_is_a_500_not_a_400(server, monkeypatch):
    """Only errors raised while admitting a request are the client's: a ValueError later is our bug."""
    import constrain.serving.server

    def broken(*args, **kwargs):
        raise ValueError("a bug of ours")

    monkeypatch.setattr(constrain.serving.server, "_chat_choice", broken)
    with pytest.raises(openai.InternalServerError) as caught:
        _chat(server, max_tokens=4, seed=1)
    assert caught.value.status_code == 500 and "a bug of ours" not in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="temperature"):  # admission errors stay 400s
        _chat(server, max_tokens=4, temperature=-1.0)


@pytest.mark.real_model
def test_parallel_tools_request_with_drafts_fed(smollm2_float32):
    """instructor's ``Mode.PARALLEL_TOOLS`` request (``tool_choice="auto"``), alone on a server that feeds
    every draft: a 200 with plain decoding's reply (drafts once ran past the grammar's end: a 500). In
    float32, where drafts change no token."""
    smollm2 = smollm2_float32
    from constrain.models.cost import ForwardCost
    from constrain.serving.engine import Engine

    replies = []
    for options in ({"forward_cost": ForwardCost((1, 64), (1.0, 1.0))}, {"speculative": False, "jump_forward": False}):
        s = Server(smollm2, engine=Engine(smollm2, **options))
        try:
            r = _chat(s, "What's the weather in Paris and in Rome?", tools=[WEATHER], tool_choice="auto",
                      max_tokens=120, temperature=0)  # fmt: skip
            message = r.choices[0].message
            for call in message.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            replies.append((message.content, calls))
        finally:
            s.stop()
    assert replies[0] == replies[1]


@pytest.mark.parametrize("stage", ["mask", "advance", "detokenize", "sample"])
def test_a_fault_in_one_request_of_eight_is_its_500_alone(tiny, stage):
    """8 concurrent requests, one of them failing inside the step: 7 valid 200s, one 500 (an error event
    when streaming), and the next request is served."""
    from constrain.testing.faults import by_user

    s = Server(tiny, faults=by_user(tiny.vocab_size), max_batch=8)
    try:
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}

        def one(k: int):
            try:
                return _chat(s, f"Number {k}", max_tokens=24, seed=k, response_format=fmt,
                             user=f"fault:{stage}" if k == 3 else None)  # fmt: skip
            except openai.InternalServerError as err:
                return err

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(one, range(8)))
        assert isinstance(replies[3], openai.InternalServerError) and replies[3].status_code == 500
        for k, r in enumerate(replies):
            if k != 3:
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        stream = s.client.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=24, response_format=fmt, stream=True,
                                                  user=f"fault:{stage}")  # fmt: skip
        with pytest.raises(openai.APIError, match="internal error"):
            list(stream)
        engine = s.app.state.engine
        assert engine.wait_idle(30) and engine.running == engine.waiting == 0 and engine.failures == 2
        after = _chat(s, "Number 0", max_tokens=24, seed=0, response_format=fmt)
        assert after.choices[0].message.content == replies[0].choices[0].message.content
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_ended_by_a_fault_goes_once_answered(tiny, stream, monkeypatch):
    """Once its 500 (or error event) is sent, a request a fault ended is freed with its last reference:
    the fault, raised again in the server's frames, does not keep them and the request in a cycle, nor
    does a streamed request's ``on_event`` (which holds the HTTP call's submission, which holds it)."""
    from constrain.testing.faults import by_user

    inject, admitted = by_user(tiny.vocab_size), []

    def faults(body, requests):
        inject(body, requests)
        admitted.append(weakref.ref(requests[0]))

    s = Server(tiny, faults=faults, max_batch=4)
    for name in ("constrain.serving.server", "constrain.decode.loop"):  # (pytest's log capture keeps every
        monkeypatch.setattr(logging.getLogger(name), "disabled", True)  # record, with its traceback's frames)
    gc.disable()
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}}
        with pytest.raises(openai.APIError, match="internal error"):
            list(_chat(s, max_tokens=8, response_format=fmt, user="fault:advance", stream=stream))
        _chat(s, max_tokens=4, seed=1)  # (the engine thread's locals move on to it)
        assert s.app.state.engine.wait_idle(30)
        assert admitted[0]() is None
    finally:
        gc.enable()
        s.stop()


def test_user_and_metadata_are_logged_with_the_response_id(server, caplog):
    with caplog.at_level(logging.INFO, logger="constrain.serving.server"):
        r = _chat(server, max_tokens=4, seed=1, user="alice", metadata={"team": "search"})
    logged = [rec.getMessage() for rec in caplog.records]
    assert f"{r.id} {{'user': 'alice', 'metadata': {{'team': 'search'}}}}" in logged
