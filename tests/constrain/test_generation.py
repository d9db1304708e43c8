"""The decode loop on a tiny random-weight model with the real SmolLM2 tokenizer (fast), and end to end on
the default model (a few)."""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import math
import threading
from pathlib import Path

import pytest
import torch

import constrain
from constrain.generation import agenerate, astream, generate, prompt_ids, stream
from constrain.models.cost import ForwardCost, cache_keyword
from constrain.sampler import InvalidSamplingParamsError

SMALL = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"enum": ["x", "y"]},
        "c": {"type": "boolean"},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


def test_schema_result_is_valid_and_typed(tiny):
    for seed in range(3):
        r = generate(tiny, "JSON:", schema=SMALL, max_tokens=64, seed=seed)
        assert r.finish_reason == "stop" and r.valid, r
        assert r.value == json.loads(r.text) and set(r.value) == {"a", "b", "c"}
        assert r.usage.completion_tokens == len(r.token_ids) > 0


def test_llguidance_engine_in_the_loop(tiny):
    """A schema "auto" gives to llguidance, batched beside one xgrammar serves: both results valid."""
    heavy = {"type": "object", "properties": {"bio": {"type": "string", "maxLength": 130}, "n": {"type": "integer"}},
             "required": ["bio", "n"], "additionalProperties": False}  # fmt: skip
    compiled = constrain.compile(constrain.json_schema(heavy, property_order="schema"), tiny.tokenizer)
    assert compiled.engine == "llguidance"
    requests = [constrain.Request("Bio:", schema=heavy, max_tokens=200, sampling={"seed": 4}),
                constrain.Request("JSON:", schema=SMALL, max_tokens=64, sampling={"seed": 5})]  # fmt: skip
    results = generate(tiny, requests)
    for r in results:
        assert r.finish_reason == "stop" and r.valid, r
    assert set(results[0].value) == {"bio", "n"} and set(results[1].value) == {"a", "b", "c"}


def test_regex_choices_grammar_end_when_complete(tiny):
    r = generate(tiny, "Code:", regex=r"\d{3}", seed=1)
    assert len(r.text) == 3 and r.text.isdigit() and r.finish_reason == "stop" and r.value == r.text
    r = generate(tiny, "Label:", choices=["positive", "negative", "neutral"], seed=2)
    assert r.text in ("positive", "negative", "neutral") and r.valid
    r = generate(tiny, "Expr:", grammar="arithmetic", max_tokens=40, seed=3)
    assert r.valid and r.value == r.text and len(r.token_ids) <= 40  # within budget, the closing path included
    assert r.finish_reason == "stop" or r.closed_early


def test_max_tokens_and_stop_strings(tiny):
    base = generate(tiny, "Once upon a time", max_tokens=30, temperature=0)
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    cut = base.text[len(base.text) // 3 : len(base.text) // 3 + 3]
    stopped = generate(tiny, "Once upon a time", max_tokens=30, temperature=0, stop=[cut])
    assert stopped.finish_reason == "stop"
    assert stopped.text == base.text[: base.text.index(cut)]


def test_max_tokens_fits_the_context_window(tiny):
    """``max_tokens=10**12`` ran until the context window was spent (two minutes on SmolLM2), and a constrained
    output was cut there, its closing budget unaware of the window: now a given ``max_tokens`` beyond the window
    is refused up front (as OpenAI's and vLLM's servers refuse it), and the default stops where the window ends."""
    prompt = "word " * 990
    room = 1024 - len(prompt_ids(tiny, prompt))  # the tiny model's window: 1024 positions
    assert 16 < room < 64
    with pytest.raises(ValueError, match=f"max_tokens={room + 1} does not fit.* at most {room} "):
        generate(tiny, prompt, max_tokens=room + 1)
    with pytest.raises(ValueError, match="max_tokens=1000000000000 does not fit"):
        generate(tiny, "Hi", max_tokens=10**12)
    free = generate(tiny, prompt, max_tokens=room, temperature=0)
    assert len(free.token_ids) <= room
    text = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": False}
    for seed in range(3):  # the random model writes the string until the budget closes it, in the window
        r = generate(tiny, prompt, schema=text, seed=seed)
        assert r.valid and len(r.token_ids) <= room and r.finish_reason == "length" and r.closed_early, r


def test_a_conversation_that_called_tools_goes_on_without_them(tiny):
    """The agent's last turn (a tool's result sent back, ``tools`` left out) failed in the chat template
    (``UndefinedError``, a 500 on the server): the calls and results are now written as a prompt with tools
    writes them, and the reply is generated."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    for assistant in ({"role": "assistant", "tool_calls": [call]}, {"role": "assistant", "content": None,
                                                                     "tool_calls": [call]}):  # fmt: skip
        messages = [{"role": "user", "content": "Weather in Paris?"}, assistant,
                    {"role": "tool", "tool_call_id": "c1", "content": "22C"}]  # fmt: skip
        text = tiny.tokenizer.decode(prompt_ids(tiny, messages))
        calls = text[text.index("<tool_call>") : text.index("</tool_call>")]  # in the model's tool format
        assert '"name": "get_weather"' in calls and '"arguments": {"city": "Paris"}' in calls
        assert text.endswith("<tool_response>\n22C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        r = generate(tiny, messages, max_tokens=5, seed=0)
        assert len(r.token_ids) == 5 and r.finish_reason == "length"


def test_a_developer_message_is_a_system_message_where_the_template_has_no_such_role(tiny):
    def ids(role):
        return prompt_ids(tiny, [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}])

    assert ids("developer") == ids("system")


def test_batch_n_and_seeds(tiny):
    results = generate(tiny, ["A:", "Bb:", [{"role": "user", "content": "hi"}]], schema=SMALL, max_tokens=64, seed=5)
    assert len(results) == 3 and all(r.valid for r in results)
    many = generate(tiny, "A:", schema=SMALL, n=3, seed=7, max_tokens=64)
    again = generate(tiny, "A:", schema=SMALL, n=3, seed=7, max_tokens=64)
    assert [r.text for r in many] == [r.text for r in again]
    assert len({r.text for r in many}) > 1  # seed, seed + 1, seed + 2
    grouped = generate(tiny, ["A:", "B:"], regex=r"[ab]{2}", n=2, seed=1)
    assert [len(g) for g in grouped] == [2, 2]


def test_mixed_batch_of_requests(tiny):
    results = generate(
        tiny,
        [
            constrain.Request("A:", schema=SMALL, max_tokens=64, sampling={"seed": 1}),
            constrain.Request("B:", regex=r"\d{4}", sampling={"temperature": 0}),
            constrain.Request("C:", choices=["yes", "no"], n=2, sampling={"seed": 2}),
            constrain.Request("D:", max_tokens=5),
        ],
    )
    assert results[0].valid and set(results[0].value) == {"a", "b", "c"}
    assert len(results[1].text) == 4 and results[1].text.isdigit()
    assert [r.text in ("yes", "no") for r in results[2]] == [True, True]
    assert results[3].finish_reason == "length" and len(results[3].token_ids) == 5


def test_logprobs(tiny):
    r = generate(tiny, "Code:", regex=r"\d{3}", seed=1, logprobs=2)
    assert len(r.logprobs) == len(r.token_ids) == 3
    assert all(lp <= 0 for lp in r.logprobs) and all(len(top) == 2 for top in r.top_logprobs)
    few = generate(tiny, "Code:", regex=r"[xy][01]", seed=1, logprobs=5)  # fewer than 5 tokens allowed a step
    tops = few.top_logprobs
    assert few.valid and all(0 < len(top) < 5 for top in tops), tops
    assert all(math.isfinite(lp) for top in tops for lp in top.values()), "masked tokens are no alternatives"
    assert all(token in top for token, top in zip(few.token_ids, tops, strict=True))


def test_an_empty_prompt_starts_from_the_bos_token(tiny):
    """An empty prompt encodes to no token: the model starts from its BOS alone, alone or in a batch (it
    was a raw torch error alone, and text in a batch)."""
    alone = generate(tiny, "", max_tokens=4, temperature=0, regex=r"\d{3}")
    batched = generate(tiny, ["", "x"], max_tokens=4, temperature=0, regex=r"\d{3}")
    assert alone.valid and alone.usage.prompt_tokens == 1 and alone.text == batched[0].text


@pytest.mark.skipif(not hasattr(Exception, "add_note"), reason="exception notes are Python 3.11's")
def test_a_bad_request_in_a_batch_is_named_by_its_place(tiny):
    """Bad input is refused before any token, for the whole call; the error says which request it was."""
    tight = constrain.Request("a", schema={"type": "object", "properties": {"n": {"type": "string"}},
                                           "required": ["n"]}, max_tokens=3)  # fmt: skip
    with pytest.raises(constrain.BudgetError) as info:
        generate(tiny, [constrain.Request("Phone: ", regex=r"\d{3}"), tight])
    assert info.value.__notes__ == ["request 1 of the 2 in this batch; none of them was run"]


def test_stream_deltas_concatenate_to_the_result(tiny):
    events = list(stream(tiny, "JSON:", schema=SMALL, max_tokens=64, seed=3))
    final = events[-1]
    assert isinstance(final, constrain.GenerationResult) and final.valid
    deltas = [e for e in events[:-1] if isinstance(e, constrain.StreamEvent)]
    assert "".join(e.delta for e in deltas) == final.text
    assert any(e.partial for e in deltas)  # partial JSON while fields complete


def test_stream_events_carry_their_tokens_logprobs(tiny):
    events = list(stream(tiny, "JSON:", schema=SMALL, max_tokens=40, seed=3, logprobs=2))
    final, deltas = events[-1], [e for e in events[:-1] if isinstance(e, constrain.StreamEvent)]
    assert [t for e in deltas for t in e.token_ids] == final.token_ids
    assert all(len(e.logprobs) == len(e.token_ids) for e in deltas)
    assert [lp for e in deltas for lp in e.logprobs] == final.logprobs
    assert [top for e in deltas for top in e.top_logprobs] == final.top_logprobs
    assert all(e.logprobs is None for e in stream(tiny, "JSON:", schema=SMALL, max_tokens=40, seed=3)
               if isinstance(e, constrain.StreamEvent))  # fmt: skip


def test_async_variants(tiny):
    async def main():
        r = await agenerate(tiny, "Code:", regex=r"\d{2}", seed=4)
        events = [e async for e in astream(tiny, "Code:", regex=r"\d{2}", seed=4)]
        return r, events

    r, events = asyncio.run(main())
    assert events[-1].text == r.text and len(r.text) == 2


def test_bad_arguments_fail_before_generating(tiny):
    with pytest.raises(ValueError, match="at most one"):
        generate(tiny, "x", regex="a", choices=["a"])
    with pytest.raises(ValueError, match="max_tokens"):
        generate(tiny, "x", max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got True"):
        generate(tiny, "x", max_tokens=True)  # a bool is no count
    with pytest.raises(InvalidSamplingParamsError, match="top_p"):
        generate(tiny, "x", top_p=2.0)
    with pytest.raises(constrain.RegexError):
        generate(tiny, "x", regex="a(")
    with pytest.raises(ValueError, match="one prompt"):
        list(stream(tiny, ["a", "b"]))
    with pytest.raises(ValueError, match="messages"):
        generate(tiny, [{"content": "no role"}])
    with pytest.raises(ValueError, match=r"prompt is a string, chat messages, a Request.*got int"):
        generate(tiny, 5)  # was a raw TypeError
    with pytest.raises(ValueError, match="a prompt is a string or a list of chat messages, got int"):
        generate(tiny, ["x", 5])
    for stop in ("", ["x", ""]):  # an empty string on its own was dropped, as if no stop had been given
        with pytest.raises(ValueError, match="stop strings must be non-empty"):
            generate(tiny, "x", stop=stop)


@pytest.mark.real_model
def test_default_model_end_to_end(smollm2):
    handle = smollm2
    prompt = [{"role": "user", "content": "Extract the person: Maria Lopez, 42, lives in Madrid. Answer in JSON."}]
    schema = json.loads((Path(__file__).parents[2] / "examples/data/person.json").read_text())
    r = generate(handle, prompt, schema=schema, max_tokens=80, temperature=0)
    assert r.valid and r.finish_reason == "stop"
    assert r.value["name"] == "Maria Lopez" and r.value["age"] == 42
    label = generate(handle, [{"role": "user", "content": "Is fire hot? Answer yes or no."}], choices=["yes", "no"])
    assert label.text in ("yes", "no") and label.valid


@pytest.mark.real_model
@pytest.mark.parametrize(
    "constraint",
    [
        {"schema": {"type": "object", "properties": {"a": {"enum": ["ключ", "дом"]}}, "required": ["a"]}},
        {"schema": {"type": "object", "properties": {"ключ": {"type": "string"}}, "required": ["ключ"]}},
        {"schema": {"type": "string", "pattern": "^дом[0-9]$"}},
        {"choices": ["да", "нет"]},
        {"regex": "привет|пока"},
    ],
    ids=["enum", "key", "pattern", "choices", "regex"],
)
def test_constraints_in_other_scripts(smollm2, constraint):
    """Texts whose characters SmolLM2 writes a byte at a time, and grammars that force a character's
    first byte alone (two words sharing it): each generation is valid (it raised a UnicodeDecodeError
    from xgrammar's forced text, in the budget's closing search)."""
    r = generate(smollm2, "Answer:", max_tokens=40, temperature=0, **constraint)
    assert r.valid and r.finish_reason in ("stop", "length") and r.text, (r.text, r.finish_reason)


@pytest.mark.real_model
def test_second_model_family_end_to_end(gemma3):
    """Gemma 3 270M (base, 262,144-token SentencePiece vocabulary): nothing assumes SmolLM2."""
    handle = gemma3
    assert handle.vocab_size >= 262_144 and handle.eos_token_ids
    prompt = "Maria Lopez is 42 years old and lives in Madrid.\nThe same facts as JSON:"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
              "age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["name", "age"]}  # fmt: skip
    r = generate(handle, prompt, schema=schema, max_tokens=40, temperature=0)
    assert r.valid and r.finish_reason == "stop", r
    assert {"name", "age"} <= set(r.value)  # an open object: the model may add keys
    date = generate(handle, "Apollo 11 landed on the Moon on (YYYY-MM-DD):", regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
                    temperature=0)  # fmt: skip
    assert date.valid and len(date.text) == 10
    events = list(stream(handle, "Is fire hot? Answer:", choices=["yes", "no"], temperature=0))
    assert "".join(e.delta for e in events[:-1]) == events[-1].text in ("yes", "no")


FORCED = {"type": "object", "properties": {"identifier": {"type": "integer"}, "description_text": {"enum":
          ["a long forced constant", "another"]}, "flag": {"type": "boolean"}}, "required": ["identifier",
          "description_text", "flag"], "additionalProperties": False}  # fmt: skip


def _counted(forward, calls, *args, **kwargs):
    calls.append(1)
    return forward(*args, **kwargs)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"seed": 7}, {"seed": 3, "top_p": 0.9, "repetition_penalty": 1.3}, {"seed": 1, "logprobs": 2}],
)
def test_jump_forward_speculation_and_overlap_change_no_token(tiny, sampling):
    """Forced text and n-gram proposals verified as drafts in one forward pass, and masks filled beside
    the forward: the tokens are those of plain decoding, for greedy and seeded sampling alike."""
    gen = importlib.import_module("constrain.generation")
    specs = [constrain.Request("JSON:", schema=FORCED, max_tokens=60, sampling=sampling),
             constrain.Request("JSON:", schema=SMALL, max_tokens=40, sampling=sampling),
             constrain.Request("Code:", regex=r"\d{3}-(abc|xyz)-\d{2}", sampling=sampling),
             constrain.Request("Free:", max_tokens=12, sampling=sampling)]  # fmt: skip
    outputs, logprobs, forwards = [], [], []
    original = tiny.model.forward
    for jump, overlap, speculative in ((False, False, False), (True, False, False), (True, True, True)):
        requests = [r for spec in specs for r in gen.admit(tiny, spec)]
        calls: list[int] = []
        tiny.model.forward = functools.partial(_counted, original, calls)
        try:
            constrain.decode.loop.run(tiny, requests, overlap=overlap, jump_forward=jump, speculative=speculative)
        finally:
            del tiny.model.forward
        outputs.append([(r.output_ids, r.text) for r in requests])
        logprobs.append([lp for r in requests for lp in r.logprobs])
        forwards.append(len(calls))
    assert outputs[0] == outputs[1] == outputs[2]
    assert all(ids for ids, _ in outputs[0])
    # a position computed inside a multi-token forward differs from a one-token forward in the last bits
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-4) and logprobs[0] == pytest.approx(logprobs[2], abs=1e-4)
    assert forwards[1] < forwards[0]  # the forced stretches took fewer forward passes


FILM = constrain.json_schema(
    {"type": "object", "additionalProperties": False, "required": ["title", "year", "director", "genres", "rating"],
     "properties": {"title": {"type": "string"}, "year": {"type": "integer"}, "director": {"type": "string"},
                    "genres": {"type": "array", "items": {"type": "string"}}, "rating": {"type": "number"}}},
    whitespace="compact",
)  # fmt: skip
FREE_PASSES = ForwardCost((1, 64), (1.0, 1.0))
"""A forward pass costs the same whatever its width: every draft on offer is fed."""
FILM_PROMPT = [{"role": "user", "content": "Describe the film Alien (1979) by Ridley Scott as JSON."}]


def _one_token_and_wide_logits(handle, prompt, output):  # -> ([n, V], [n, V]) float32
    """The logits before each of ``output``'s tokens: one token per forward pass (plain decoding's), and
    from one pass over the whole text (as a block of drafts computes them)."""
    from constrain.generation import prompt_ids

    ids, model = prompt_ids(handle, prompt), handle.model
    keyword = cache_keyword(model)
    with torch.inference_mode():
        wide = model(input_ids=torch.tensor([ids + output])).logits[0, len(ids) - 1 : -1].float()  # [n, V]
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        rows = [out.logits[0, -1]]
        for token in output[:-1]:
            out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{keyword: getattr(out, keyword)})
            rows.append(out.logits[0, -1])
    return torch.stack(rows).float(), wide


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_drafts_change_no_greedy_token_of_the_default_model(dtype):
    """Greedy decoding with jump-forward and speculation on or off writes the same tokens in float32 (the
    forced key of this schema was once said to come out as ``d ire c to r``; every token fed is one the
    sampler drew). In bfloat16 a block of drafts and a one-token pass round differently (logits apart by
    up to ~1 against ~1e-4 in float32), which flips exact ties: where the outputs differ, plain decoding's
    two choices were within that rounding of each other."""
    try:
        handle = constrain.load_model(dtype=dtype)
    except constrain.ModelNotFoundError as err:
        pytest.skip(f"the model package is not installed: {err}")
    run = functools.partial(generate, handle, FILM_PROMPT, schema=FILM, temperature=0, max_tokens=96)
    plain = run(jump_forward=False, speculative=False)
    assert plain.valid
    one_token, wide = _one_token_and_wide_logits(handle, FILM_PROMPT, plain.token_ids)
    rounding = (wide - one_token).abs().max().item()
    for jump, speculative in ((True, False), (False, True), (True, True)):
        drafted = run(jump_forward=jump, speculative=speculative, forward_cost=FREE_PASSES)
        assert drafted.valid
        if dtype == torch.float32:
            assert rounding < 1e-3 and drafted.token_ids == plain.token_ids, (jump, speculative, drafted.text)
            continue
        at = next((i for i, (a, b) in enumerate(zip(plain.token_ids, drafted.token_ids, strict=False)) if a != b), None)
        if at is not None:  # the cause: a tie within the rounding of a wide pass
            a, b = plain.token_ids[at], drafted.token_ids[at]
            assert abs(one_token[at, a] - one_token[at, b]).item() <= rounding, (at, a, b, rounding)


def test_jump_forward_keeps_the_sampled_distribution(smol_tokenizer, monkeypatch):
    """Unseeded sampling draws fresh randomness per call, so jump-forward (fewer calls) changes the
    draws: the distribution over outputs must not change. Chi-square on 600 samples each, fixed seeds:
    the model's, and the entropy the sampler's own generator starts from (the OS's otherwise, which
    made this test fail one run in a few). The control: the same test tells temperature 1.5 from 0.8."""
    import random
    from types import SimpleNamespace

    from scipy.stats import chi2_contingency
    from transformers import LlamaConfig, LlamaForCausalLM

    import constrain.sampler.batch

    monkeypatch.setattr(constrain.sampler.batch, "secrets", SimpleNamespace(randbits=random.Random(7).getrandbits))

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(15)  # logits with a spread, so that the model's choices matter
    handle = constrain.load_model((model, smol_tokenizer))
    options = ["alpha beta gamma one", "alpha beta gamma two", "alpha delta", "omega"]
    counts = []
    for jump, temperature in ((False, 1.5), (True, 1.5), (True, 0.8)):
        torch.manual_seed(1234)
        results = generate(handle, "Pick:", choices=options, n=600, temperature=temperature, jump_forward=jump)
        counts.append([sum(r.text == o for r in results) for o in options])
    assert all(sum(c) == 600 for c in counts) and min(counts[0]) >= 20, counts
    assert chi2_contingency(counts[:2]).pvalue > 0.01, counts
    assert chi2_contingency([counts[0], counts[2]]).pvalue < 1e-3, counts  # the test can tell a change


def test_closing_a_stream_early_cancels_its_request(tiny, monkeypatch):
    """The worker stops decoding once the caller has closed the iterator: it does not run to max_tokens."""
    import constrain.decode.loop

    finished, ended = [], threading.Event()
    original = constrain.decode.loop.InFlight.finish

    def finish(self, reason, error=None):
        finished.append(reason)
        original(self, reason, error)
        ended.set()

    monkeypatch.setattr(constrain.decode.loop.InFlight, "finish", finish)
    steps = []
    monkeypatch.setattr(
        constrain.decode.loop.DecodeLoop, "step", _counting(constrain.decode.loop.DecodeLoop.step, steps)
    )
    iterator = constrain.stream(tiny, "Hello", max_tokens=1000, temperature=1.0, seed=0, speculative=False)
    for i, _ in enumerate(iterator):
        if i == 3:
            break
    iterator.close()
    assert ended.wait(30) and finished == ["cancelled"]
    assert len(steps) < 100, "decoding stopped soon after the close, far from max_tokens"


def _counting(method, calls):
    def counted(self, *args, **kwargs):
        calls.append(1)
        return method(self, *args, **kwargs)

    return counted
