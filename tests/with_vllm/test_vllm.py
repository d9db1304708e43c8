"""constrain inside vLLM (``constrain.integrations.vllm``), tested with vLLM's CPU build: ``make test-vllm``
builds its own environment (vLLM pins other transformers and llguidance versions than ours).

The model is the packaged SmolLM2 exported by ``constrain.export_model`` (the folder vLLM loads), in
float32 on both sides. Offline tests use ``vllm.LLM`` in this process; served tests start ``vllm serve``
and talk to it with the ``openai`` client. The processor is passed explicitly, as users do
(``logits_processors=[ConstrainLogitsProcessor]``, ``--logits-processors``): constrain registers no
``vllm.logits_processors`` entry point, which vLLM's V2 model runner would refuse at start-up.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from importlib.metadata import distribution, entry_points
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM runs in its own environment: make test-vllm")

import jsonschema  # noqa: E402
import openai  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

import constrain  # noqa: E402
from constrain.integrations.vllm import EXTRA_ARGS_KEY, PROCESSOR, ConstrainLogitsProcessor  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
COLORS = {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]}, "uniqueItems": True,
          "minItems": 2, "maxItems": 4}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}  # fmt: skip


def chat(llm: LLM, text: str) -> str:
    return str(llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True))  # fmt: skip


def params(args: object | None = None, **kwargs: object) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 80)
    return SamplingParams(extra_args=None if args is None else {EXTRA_ARGS_KEY: args}, **kwargs)


def test_no_vllm_entry_point_names_constrain() -> None:
    """Opt-in only: an entry point would load the processor into every vLLM engine of the environment,
    and vLLM's V2 model runner refuses V1-interface plugins at start-up (``vllm serve`` would not start)."""
    dist = distribution("constrain-llm")
    assert not [e for e in dist.entry_points if e.group == "vllm.logits_processors"]
    plugins = entry_points(group="vllm.logits_processors")
    assert not [e for e in plugins if "constrain" in e.value or (e.dist and "constrain" in e.dist.name)], plugins


def test_the_v2_runners_plugin_loader_starts_with_constrain_installed() -> None:
    """What the V2 model runner (vLLM's default where Triton is present, GPUs) runs at start-up, in the
    frontend and in each worker, raised ``ValueError: LogitsProcessor plugin constrain is not a subclass
    ...`` while constrain registered its entry point. It needs no GPU: it only loads and checks classes."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_plugins,
        build_custom_logits_processors_params_validator,
    )

    assert not [cls for cls in _load_v2_logitsprocs_plugins() if cls.__module__.startswith("constrain")]
    build_custom_logits_processors_params_validator(None)  # the frontend's call when no processor is named


def test_the_v2_runner_refuses_the_processor_when_named() -> None:
    """Named explicitly, the processor needs the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0`` on GPUs): the V2
    runner's loader refuses V1-interface classes (docs/guides/vllm.md says so; this fails when that changes)."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    for named in (PROCESSOR, ConstrainLogitsProcessor):
        with pytest.raises(ValueError, match="not a subclass"):
            _load_v2_logitsprocs_by_fqcns([named])


def test_the_exported_folder_gives_constrains_greedy_tokens(llm: LLM, folder: Path) -> None:
    """vLLM on the exported folder decodes what constrain decodes from the packaged model (unconstrained)."""
    handle = constrain.load_model(str(folder), dtype="float32")
    for text in ("What is the capital of France?", "Name three colours."):
        mine = constrain.generate(handle, [{"role": "user", "content": text}], temperature=0, max_tokens=16)
        (out,) = llm.generate([chat(llm, text)], params(max_tokens=16))
        assert list(out.outputs[0].token_ids)[: len(mine.token_ids)] == mine.token_ids, (out.outputs[0].text, mine.text)


def test_mixed_constraints_in_one_batch(llm: LLM) -> None:
    """JSON Schema, regex, a shipped grammar, choices, tools and an unconstrained request, side by side."""
    prompt = chat(llm, "Describe a person, then say which colours they like.")
    requests = {
        "schema": params({"json_schema": PERSON}),
        "unique": params({"json_schema": COLORS}, temperature=1.0, seed=1),
        "regex": params({"regex": r"[A-Z][a-z]{2,8} \d{2}"}),
        "grammar": params({"grammar": "json"}, max_tokens=60),
        "choices": params({"choices": ["yes", "no", "maybe"]}),
        "tools": params(json.dumps({"tools": [WEATHER], "tool_choice": "required"})),
        "free": params(max_tokens=24),
    }
    outs = dict(zip(requests, llm.generate([prompt] * len(requests), list(requests.values())), strict=True))
    text = {name: out.outputs[0].text for name, out in outs.items()}
    jsonschema.validate(json.loads(text["schema"]), PERSON)
    colours = json.loads(text["unique"])
    jsonschema.validate(colours, COLORS)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} \d{2}", text["regex"]), text["regex"]
    json.loads(text["grammar"])
    assert text["choices"] in ("yes", "no", "maybe")
    parser = constrain.tool_calling([WEATHER], tool_choice="required", format="hermes").parser()
    parser.feed(text["tools"])
    parser.finish()
    reply = parser.result()
    assert reply.tool_calls and reply.valid and reply.tool_calls[0].name == "get_weather", text["tools"]
    assert outs["free"].outputs[0].finish_reason == "length" and text["free"]


def test_sampled_outputs_end_valid_within_max_tokens(llm: LLM) -> None:
    """A budget the model's own ending would overrun: the closing path keeps every output valid."""
    prompt = chat(llm, "Describe a person.")
    outs = llm.generate([prompt] * 8, [params({"json_schema": PERSON}, temperature=1.2, seed=s, max_tokens=24)
                                       for s in range(8)])  # fmt: skip
    for out in outs:
        assert len(out.outputs[0].token_ids) <= 24
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_a_bad_constraint_is_refused_and_the_engine_goes_on(llm: LLM) -> None:
    prompt = chat(llm, "Describe a person.")
    with pytest.raises(VLLMValidationError, match="/type"):  # validate_params' ValueError, as vLLM re-raises it
        llm.generate([prompt], params({"json_schema": {"type": "nope"}}))
    with pytest.raises(VLLMValidationError, match="exactly one"):
        llm.generate([prompt], params({"regex": "a", "choices": ["b"]}))
    (out,) = llm.generate([prompt], params({"json_schema": PERSON}))
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_the_offline_example_runs(folder: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "vllm" / "offline.py"
    result = subprocess.run([sys.executable, str(example), str(folder)], capture_output=True, text=True,
                            timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"person: name='[^']*' age=\d+", result.stdout), result.stdout


# -- served -----------------------------------------------------------------------------------------------


def xargs(args: object) -> dict[str, object]:
    """What a client puts in ``extra_body``: the server takes strings and numbers, so the arguments as JSON."""
    return {"vllm_xargs": {EXTRA_ARGS_KEY: json.dumps(args)}}


def test_served_generation_with_the_openai_client(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none")
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person."}], temperature=0, max_tokens=80,
        extra_body=xargs({"json_schema": PERSON}),
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)


def test_sixteen_concurrent_requests_are_all_valid(server: str) -> None:
    client = openai.AsyncOpenAI(base_url=server, api_key="none")
    schemas = [PERSON, COLORS, {"type": "integer", "minimum": 10, "maximum": 99}, {"enum": ["a", "b"]}]

    async def one(i: int) -> object:
        schema = schemas[i % len(schemas)]
        reply = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Request {i}: give me a value."}],
            temperature=1.0, seed=i, max_tokens=48, extra_body=xargs({"json_schema": schema}),
        )  # fmt: skip
        value = json.loads(reply.choices[0].message.content or "")
        jsonschema.validate(value, schema)
        return value

    async def all_of_them() -> list[object]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    assert len(asyncio.run(all_of_them())) == 16


def test_a_bad_schema_is_a_400_and_the_server_keeps_serving(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none")
    messages = [{"role": "user", "content": "Describe a person."}]
    with pytest.raises(openai.BadRequestError, match="/type"):
        client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                       extra_body=xargs({"json_schema": {"type": "nope"}}))  # fmt: skip
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=80,
                                           extra_body=xargs({"json_schema": PERSON}))  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)
