"""vLLM's request extras against ``constrain serve``: a client written for vLLM's server, unchanged.

``structured_outputs`` (vLLM 0.32) and the older top-level ``guided_*`` fields, sent as vLLM's users send
them (the ``openai`` client's ``extra_body``), through the real server on the tiny random-weight model
(its text is noise, but every constrained output must still be valid). What each field maps to is
tested in ``test_protocol.py``; here, that the server honours it, and refuses what it cannot with a 400
whose ``param`` names the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

import constrain
from constrain.testing import PERSON_SCHEMA as PERSON
from constrain.testing import WEATHER_TOOL as WEATHER
from constrain.testing import LocalServer

NUMBERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "maxItems": 3,
           "items": {"type": "integer"}}}, "required": ["a", "b"]}  # fmt: skip
DATE = r"\d{4}-\d{2}-\d{2}"
YES_NO = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def server(tiny: constrain.ModelHandle) -> Iterator[LocalServer]:
    s = LocalServer(tiny)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(server: LocalServer, client: openai.OpenAI, extra_body: dict, **kwargs) -> str:
    kwargs = {"max_tokens": 60, "seed": 3, **kwargs}
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], extra_body=extra_body, **kwargs
    )
    return reply.choices[0].message.content or ""


def _is_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


# (vLLM's fields, a check of the content)
fields__check = [
    ({"structured_outputs": {"json": PERSON}}, _is_person),
    ({"structured_outputs": {"json": json.dumps(PERSON)}}, _is_person),
    ({"guided_json": PERSON}, _is_person),
    ({"guided_json": PERSON, "guided_decoding_backend": "auto"}, _is_person),
    ({"structured_outputs": {"json_object": True}}, lambda text: isinstance(json.loads(text), dict)),
    ({"structured_outputs": {"regex": DATE}}, lambda text: re.fullmatch(DATE, text)),
    ({"guided_regex": DATE}, lambda text: re.fullmatch(DATE, text)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda text: text in ("red", "green")),
    ({"guided_choice": ["red", "green"]}, lambda text: text in ("red", "green")),
    ({"structured_outputs": {"grammar": YES_NO}}, lambda text: text in ("yes", "no")),
    ({"guided_grammar": YES_NO}, lambda text: text in ("yes", "no")),
    ({"structured_outputs": {"grammar": "json"}}, lambda text: json.loads(text) == json.loads(text)),  # JSON text
]


@pytest.mark.parametrize(("fields", "check"), fields__check)
def test_vllms_constraint_fields_are_honoured(server, client, fields, check):
    text = _chat(server, client, fields)
    assert check(text), text


def test_the_completions_endpoint_takes_them_too(server, client):
    for fields in ({"structured_outputs": {"regex": DATE}}, {"guided_regex": DATE}):
        reply = client.completions.create(model=server.model, prompt="Today:", max_tokens=20, seed=1, extra_body=fields)
        assert re.fullmatch(DATE, reply.choices[0].text), reply.choices[0].text


def test_a_stream_is_constrained_alike(server, client):
    whole = _chat(server, client, {"structured_outputs": {"json": PERSON}})
    chunks = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=60, seed=3, stream=True,
        extra_body={"structured_outputs": {"json": PERSON}},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_disable_any_whitespace_writes_json_without_whitespace(server, client):
    """``NUMBERS`` holds no strings, so any whitespace would be formatting: ``json.dumps``'s by default."""
    plain = _chat(server, client, {"structured_outputs": {"json": NUMBERS}})
    compact = _chat(server, client, {"structured_outputs": {"json": NUMBERS, "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(compact), NUMBERS)
    assert ": " in plain and not re.search(r"\s", compact), (plain, compact)


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"structured_outputs": {"json": PERSON, "regex": DATE}}, "structured_outputs.regex",
         "structured_outputs.json, structured_outputs.regex"),
        ({"guided_json": PERSON, "response_format": {"type": "json_object"}}, "response_format",
         "guided_json, response_format"),
        ({"regex": DATE, "guided_regex": DATE}, "guided_regex", "regex, guided_regex"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["b"]}, "guided_choice",
         "structured_outputs.choice, guided_choice"),
        ({"structured_outputs": {}}, "structured_outputs", "json, regex, choice, grammar, json_object"),
        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json", "/type"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "guided_json",
         "/properties/a"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "true only"),
        ({"structured_outputs": {"regex": DATE, "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace", "only with json"),
        ({"structured_outputs": {"json": PERSON, "whitespace_pattern": "[ ]?"}},
         "structured_outputs.whitespace_pattern", "not a pattern"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "structural tags"),
        ({"guided_json": PERSON, "guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern", "not a pattern"),
        ({"guided_json": PERSON, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "xgrammar"),
        ({"structured_outputs": {"regex": DATE}, "tools": [WEATHER]}, "structured_outputs.regex", "tool_choice"),
        ({"structured_outputs": {"jsn": PERSON}}, "structured_outputs.jsn", "Extra inputs"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, client, fields, param, needle):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(server, client, fields, max_tokens=4)
    error = info.value.body
    assert error["param"] == param and needle in error["message"], error


def test_the_server_goes_on_after_a_refusal(server, client):
    with pytest.raises(openai.BadRequestError):
        _chat(server, client, {"structured_outputs": {"json": PERSON, "choice": ["a"]}}, max_tokens=4)
    assert _is_person(_chat(server, client, {"structured_outputs": {"json": PERSON}}))
