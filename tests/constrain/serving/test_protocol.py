"""The request bodies' translation into :class:`~constrain.generation.Request` s: no field silently ignored.

Every field of both request bodies (nested ones too, found by walking ``model_fields``, so that a field
added later without a decision fails :func:`test_every_field_has_a_decision`) has cases below: given
a sample value, it either changes the built request ("generation"), leaves it alone and is listed in
``SERVED_FIELDS`` (what it does there is tested in ``test_server.py``: "served"), or is refused with an
error whose ``field`` is its dotted path ("refused"). The fields of ``REFUSED_FIELDS`` (vLLM's, declared
so that their 400 says why) have refused cases only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import constrain
from constrain.errors import BeamSearchError
from constrain.generation import resolve_constraint
from constrain.serving.protocol import (
    REFUSED_FIELDS,
    SERVED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    chat_requests,
    completion_requests,
    request_labels,
)
from constrain.testing import WEATHER_TOOL

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "m", "prompt": "Hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
SCHEMA_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
NO_SCHEMA_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
TOOLS = {"tools": [WEATHER_TOOL]}
BEAMS = {"use_beam_search": True, "n": 2}
SO_JSON = {"structured_outputs": {"json": SCHEMA}}
SO_REGEX = {"structured_outputs": {"regex": "a+"}}

# (dotted path, the other fields given, the path's sample value, its effect)
path__beside__value__effect__common = [
    ("model", {}, "other", "served"),
    ("max_tokens", {}, 7, "generation"),
    ("temperature", {}, 0.5, "generation"),
    ("top_p", {}, 0.9, "generation"),
    ("top_k", {}, 5, "generation"),
    ("min_p", {}, 0.1, "generation"),
    ("frequency_penalty", {}, 0.5, "generation"),
    ("presence_penalty", {}, 0.5, "generation"),
    ("repetition_penalty", {}, 1.1, "generation"),
    ("logit_bias", {}, {"5": 1.0}, "generation"),
    ("logit_bias", {}, {"five": 1.0}, "refused"),
    ("seed", {}, 3, "generation"),
    ("stop", {}, ["x"], "generation"),
    ("stop", {}, "", "refused"),  # it was dropped, as if no stop had been given
    ("stop", {}, ["x", ""], "refused"),
    ("n", {}, 2, "generation"),
    ("stream", {}, True, "served"),
    ("stream_options", {"stream": True}, {"include_usage": True}, "served"),
    ("stream_options", {}, {"include_usage": True}, "refused"),
    ("stream_options", {"stream": False}, {}, "refused"),
    ("stream_options.include_usage", {"stream": True, "stream_options": {}}, True, "served"),
    ("regex", {}, "a+", "generation"),
    ("grammar", {}, 'root ::= "a"', "generation"),
    ("choices", {}, ["a", "b"], "generation"),
    ("reasoning", {}, True, "generation"),
    ("reasoning_effort", {}, "low", "generation"),
    ("reasoning_effort", {"reasoning": True}, "low", "refused"),
    ("user", {}, "u-1", "served"),
    ("metadata", {}, {"session": "s-1"}, "served"),
    ("store", {}, False, "served"),
    ("store", {}, True, "refused"),
    ("service_tier", {}, "auto", "served"),
    ("service_tier", {}, "default", "served"),
    ("service_tier", {}, "flex", "refused"),
    ("use_beam_search", {"n": 2}, True, "generation"),
    ("best_of", {"use_beam_search": True}, 3, "generation"),
    ("best_of", {}, 3, "refused"),
    ("length_penalty", BEAMS, 0.5, "generation"),
    ("length_penalty", {}, 0.5, "refused"),
    ("length_penalty", {}, 1.0, "refused"),  # given, though the default: it would still do nothing
    # vLLM's constraint fields
    ("structured_outputs", {}, {"regex": "a+"}, "generation"),
    ("structured_outputs", {}, {}, "refused"),  # no constraint in it
    ("structured_outputs", {}, {"disable_any_whitespace": True}, "refused"),
    ("structured_outputs.json", {}, SCHEMA, "generation"),
    ("structured_outputs.json", {}, '{"type": "integer"}', "generation"),  # JSON text
    ("structured_outputs.json", {}, {"type": "nope"}, "refused"),
    ("structured_outputs.json", {"regex": "a"}, SCHEMA, "refused"),  # two constraints
    ("structured_outputs.regex", {}, "a+", "generation"),
    ("structured_outputs.regex", {}, "(ab", "refused"),
    ("structured_outputs.regex", {"structured_outputs": {"json": SCHEMA}}, "a+", "refused"),
    ("structured_outputs.choice", {}, ["a", "b"], "generation"),
    ("structured_outputs.choice", {"choices": ["c"]}, ["a", "b"], "refused"),
    ("structured_outputs.grammar", {}, 'root ::= "a"', "generation"),
    ("structured_outputs.grammar", {}, "root ::= (", "refused"),
    ("structured_outputs.json_object", {}, True, "generation"),
    ("structured_outputs.json_object", {}, False, "refused"),
    ("structured_outputs.disable_any_whitespace", SO_JSON, True, "generation"),
    ("structured_outputs.disable_any_whitespace", {"structured_outputs": {"json_object": True}}, True, "generation"),
    ("structured_outputs.disable_any_whitespace", SO_REGEX, True, "refused"),
    ("structured_outputs.disable_additional_properties", SO_JSON, True, "served"),
    ("structured_outputs.disable_additional_properties", SO_JSON, False, "served"),
    ("structured_outputs.whitespace_pattern", SO_JSON, r"[ ]?", "refused"),
    ("structured_outputs.structural_tag", SO_JSON, "{}", "refused"),
    ("guided_json", {}, SCHEMA, "generation"),
    ("guided_json", {"regex": "a"}, SCHEMA, "refused"),
    ("guided_json", SO_REGEX, SCHEMA, "refused"),
    ("guided_regex", {}, "a+", "generation"),
    ("guided_regex", {}, "(ab", "refused"),
    ("guided_regex", {"guided_json": SCHEMA}, "a+", "refused"),
    ("guided_choice", {}, ["a", "b"], "generation"),
    ("guided_choice", {}, ["a", "a"], "refused"),
    ("guided_grammar", {}, 'root ::= "a"', "generation"),
    ("guided_grammar", {"grammar": "json"}, 'root ::= "a"', "refused"),
    ("guided_decoding_backend", {}, "auto", "served"),
    ("guided_decoding_backend", {"guided_json": SCHEMA}, "auto", "served"),
    ("guided_decoding_backend", {}, "xgrammar", "refused"),
    ("guided_whitespace_pattern", {"guided_json": SCHEMA}, r"[ ]?", "refused"),
]

path__beside__value__effect__chat = [
    *path__beside__value__effect__common,
    ("messages", {}, [{"role": "user", "content": "Bye"}], "generation"),
    ("max_completion_tokens", {}, 7, "generation"),
    ("max_tokens", {"max_completion_tokens": 7}, 8, "refused"),
    ("logprobs", {}, True, "generation"),
    ("top_logprobs", {"logprobs": True}, 2, "generation"),
    ("top_logprobs", {}, 2, "refused"),
    ("top_logprobs", {"logprobs": False}, 0, "refused"),
    ("response_format", {}, {"type": "json_object"}, "generation"),
    ("response_format", TOOLS, {"type": "json_object"}, "refused"),
    ("response_format", {"regex": "a"}, {"type": "json_object"}, "refused"),
    ("response_format", SO_JSON, {"type": "json_object"}, "refused"),
    ("response_format", {"guided_regex": "a"}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "refused"),
    ("response_format.type", {"response_format": {"type": "text"}}, "json_object", "generation"),
    ("response_format.json_schema", {"response_format": {"type": "json_schema"}}, {"schema": SCHEMA}, "generation"),
    ("response_format.json_schema", {"response_format": {"type": "json_object"}}, {"name": "x"}, "refused"),
    ("response_format.json_schema", {"response_format": {"type": "text"}}, {"schema": SCHEMA}, "refused"),
    ("response_format.json_schema.name", SCHEMA_FORMAT, "person", "served"),
    ("response_format.json_schema.description", SCHEMA_FORMAT, "A person", "served"),
    ("response_format.json_schema.schema", NO_SCHEMA_FORMAT, SCHEMA, "generation"),
    ("response_format.json_schema.schema", NO_SCHEMA_FORMAT, True, "generation"),  # any JSON value, not an object
    ("response_format.json_schema.strict", SCHEMA_FORMAT, True, "generation"),
    ("tools", {}, [WEATHER_TOOL], "generation"),
    ("tool_choice", TOOLS, "required", "generation"),
    ("tool_choice", {}, "none", "refused"),
    ("tool_choice", {"tools": []}, "auto", "refused"),
    ("parallel_tool_calls", {**TOOLS, "tool_choice": "required"}, False, "generation"),
    ("parallel_tool_calls", {}, True, "refused"),
    ("structured_outputs.regex", TOOLS, "a", "refused"),  # beside tools that may be called
    ("guided_choice", {**TOOLS, "tool_choice": "none"}, ["a"], "generation"),  # beside tools that may not
]

path__beside__value__effect__completion = [
    *path__beside__value__effect__common,
    ("prompt", {}, "Bye", "generation"),
    ("prompt", {}, ["Hi", "Bye"], "generation"),
    ("prompt", {}, [], "refused"),
    ("logprobs", {}, 1, "generation"),
]

ENDPOINTS = {  # name: (request body, base body, cases)
    "chat": (ChatCompletionRequest, CHAT, path__beside__value__effect__chat),
    "completion": (CompletionRequest, COMPLETION, path__beside__value__effect__completion),
}


def field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """The dotted paths (wire names) of ``model``'s fields and of the fields of the bodies they hold."""
    out = set()
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        out.add(path)
        for arg in typing.get_args(info.annotation) or (info.annotation,):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out |= field_paths(arg, path + ".")
    return out


def _merged(base: dict[str, Any], beside: dict[str, Any], path: str | None = None, value: Any = None) -> dict:
    """``base`` with ``beside``'s fields, then (with ``path``) ``value`` at ``path`` (a fresh dict)."""
    body = copy.deepcopy({**base, **beside})
    if path is not None:
        *parents, last = path.split(".")
        node = body
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return body


def _outcome(endpoint: str, body: dict[str, Any], handle: constrain.ModelHandle) -> Any:
    """The request(s) ``body`` builds, or ``("refused", the error's field)``."""
    try:
        if endpoint == "chat":
            return chat_requests(ChatCompletionRequest.model_validate(body), handle)[0]
        return completion_requests(CompletionRequest.model_validate(body))
    except (FieldError, BeamSearchError) as err:
        return ("refused", err.field)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_every_field_has_a_decision(endpoint):
    """Every field has a case, and at least one where it is accepted but those of ``REFUSED_FIELDS``: a field
    added without a decision fails."""
    model, _, cases = ENDPOINTS[endpoint]
    assert {path for path, *_ in cases} == field_paths(model)
    accepted = {path for path, _, _, effect in cases if effect != "refused"}
    assert set(REFUSED_FIELDS) <= field_paths(model)
    assert accepted == field_paths(model) - set(REFUSED_FIELDS)


def test_served_fields_are_the_fields_that_leave_generation_alone():
    served = {path for _, _, cases in ENDPOINTS.values() for path, _, _, effect in cases if effect == "served"}
    assert served == set(SERVED_FIELDS)


@pytest.mark.parametrize(
    ("endpoint", "path", "beside", "value", "effect"),
    [(endpoint, *case) for endpoint, (_, _, cases) in sorted(ENDPOINTS.items()) for case in cases],
)
def test_a_field_changes_the_request_is_served_or_is_refused_by_name(tiny, endpoint, path, beside, value, effect):
    _, base, _ = ENDPOINTS[endpoint]
    without = _outcome(endpoint, _merged(base, beside), tiny)
    given = _outcome(endpoint, _merged(base, beside, path, value), tiny)
    if effect == "refused":
        assert given == ("refused", path)
        return
    assert not isinstance(given, tuple), given  # built: a Request, or a list of them
    if effect == "generation":
        assert given != without
    else:
        assert given == without and path in SERVED_FIELDS


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def test_json_schema_without_schema_is_a_json_object(tiny):
    """Issue 28: a json_schema format without a schema got any JSON value, which a chat model fills with
    a quoted sentence. Without one (or with a null), it is ``json_object``'s constraint, strict or not."""
    json_object = chat_requests(_chat(response_format={"type": "json_object"}), tiny)[0]
    assert json_object.constraint == constrain.json_schema({"type": "object"})
    for fmt in ({"name": "x"}, {"name": "x", "schema": None}, {"name": "x", "strict": True}, {}):
        spec = chat_requests(_chat(response_format={"type": "json_schema", "json_schema": fmt}), tiny)[0]
        assert spec == json_object, fmt
    explicit = {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}
    assert chat_requests(_chat(response_format=explicit), tiny)[0].schema.schema == "true"  # as written


def test_a_null_is_not_given(tiny):
    plain = chat_requests(_chat(), tiny)[0]
    nulls = {"stream_options": None, "top_logprobs": None, "tool_choice": None, "store": None, "service_tier": None}
    assert chat_requests(_chat(**nulls), tiny)[0] == plain


def test_max_tokens_beside_an_equal_max_completion_tokens_is_accepted(tiny):
    alone = chat_requests(_chat(max_completion_tokens=7), tiny)[0]
    assert alone.max_tokens == 7 and chat_requests(_chat(max_tokens=7, max_completion_tokens=7), tiny)[0] == alone


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"content": "Hi"}], "messages.0.role"),
        ([{"role": "user", "content": "Hi"}, {"role": "user", "content": [{"type": "image_url"}]}],
         "messages.1.content.0"),
        ([{"role": "wizard", "content": "Hi"}], "messages.0.role"),
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": 5}], "messages.0.content"),
        ([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "22"}], "messages.1.tool_call_id"),
    ],
)  # fmt: skip
def test_a_bad_message_is_named_by_its_path(tiny, messages, field):
    with pytest.raises(FieldError) as info:
        chat_requests(_chat(messages=messages), tiny)
    assert info.value.field == field and str(info.value).startswith(field + ": ")


def test_an_assistant_message_of_calls_alone_needs_no_content(tiny):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]  # fmt: skip
    assert chat_requests(_chat(messages=messages), tiny)[0].prompt


@pytest.mark.parametrize("name", ["", "has space", "x" * 65, "é"])
def test_a_json_schema_name_follows_openais_rule(name):
    with pytest.raises(ValidationError, match="name"):
        _chat(response_format={"type": "json_schema", "json_schema": {"name": name}})


def test_user_and_metadata_are_the_request_labels():
    assert request_labels(_chat()) == {}
    assert request_labels(_chat(user="u-1", metadata={"k": "v"})) == {"user": "u-1", "metadata": {"k": "v"}}
    assert request_labels(CompletionRequest.model_validate({**COMPLETION, "user": "u-2"})) == {"user": "u-2"}


def _constraint(body: dict[str, Any], handle: constrain.ModelHandle) -> Any:
    """The constraint the chat request ``body`` (CHAT's fields beside) generates under."""
    r = chat_requests(_chat(**body), handle)[0]
    return resolve_constraint(r.schema, r.regex, r.grammar, r.choices, r.constraint)


SCHEMA_AS_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}

# (vLLM's fields, the request without them that generates under the same constraint)
vllm__same_as = [
    ({"structured_outputs": {"json": SCHEMA}}, SCHEMA_AS_FORMAT),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, SCHEMA_AS_FORMAT),
    ({"guided_json": SCHEMA}, SCHEMA_AS_FORMAT),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "auto"}, SCHEMA_AS_FORMAT),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}, SCHEMA_AS_FORMAT),
    ({"structured_outputs": {"json_object": True}}, {"response_format": {"type": "json_object"}}),
    ({"structured_outputs": {"regex": r"\d+"}}, {"regex": r"\d+"}),
    ({"guided_regex": r"\d+"}, {"regex": r"\d+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choices": ["a", "b"]}),
    ({"guided_choice": ["a", "b"]}, {"choices": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"grammar": 'root ::= "a" | "b"'}),
    ({"guided_grammar": "json"}, {"grammar": "json"}),
]


@pytest.mark.parametrize(("vllm", "same_as"), vllm__same_as)
def test_vllms_fields_are_the_same_constraints_as_ours(tiny, vllm, same_as):
    assert _constraint(vllm, tiny) == _constraint(same_as, tiny) is not None


def test_disable_any_whitespace_writes_json_without_whitespace(tiny):
    for fields in ({"json": SCHEMA}, {"json_object": True}):
        plain = _constraint({"structured_outputs": fields}, tiny)
        compact = _constraint({"structured_outputs": {**fields, "disable_any_whitespace": True}}, tiny)
        assert (plain.whitespace, compact.whitespace) == ("dumps", "compact")
        assert dataclasses.replace(compact, whitespace="dumps") == plain


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex",
         ["structured_outputs.json", "structured_outputs.regex"]),
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "response_format",
         ["guided_json", "response_format"]),
        ({"regex": "a", "guided_regex": "b", "structured_outputs": {"choice": ["c"]}}, "guided_regex",
         ["regex", "structured_outputs.choice", "guided_regex"]),
    ],
)  # fmt: skip
def test_two_constraints_are_refused_naming_them(tiny, fields, param, named):
    with pytest.raises(FieldError) as info:
        chat_requests(_chat(**fields), tiny)
    assert info.value.field == param and all(name in str(info.value) for name in named), str(info.value)


@pytest.mark.parametrize("path", sorted(REFUSED_FIELDS))
def test_a_refused_vllm_field_says_why(tiny, path):
    body = _merged(CHAT, SO_JSON if path.startswith("structured_outputs.") else {"guided_json": SCHEMA}, path, "x")
    with pytest.raises(FieldError) as info:
        chat_requests(ChatCompletionRequest.model_validate(body), tiny)
    assert info.value.field == path and str(info.value) == f"{path}: {REFUSED_FIELDS[path]}"
