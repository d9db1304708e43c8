"""Beam search under a grammar (``constrain.decode.beams``): against brute-force enumeration of every output the
grammar allows, scored by the same model; every finished beam valid; arguments; the server's options.

The model is the random-weight 2-layer Llama (``tiny``): its text is noise, but its log-probabilities
are what beam search and the enumeration must agree on.
"""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

import constrain
from constrain.decode.beams import BeamSearch
from constrain.errors import BeamSearchError
from constrain.match.bitmask import allocate_token_bitmask
from constrain.sampler.ops.bitmask import bitmask_penalty
from constrain.testing import LocalServer

PROMPT = "Pick one:"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 40}, "c": {"enum": ["red", "blue"]}},
    "required": ["n", "c"],
}


def _compiled(handle, constraint):
    return constrain.compile(constraint, handle.tokenizer, vocab_size=handle.vocab_size,
                             eos_token_ids=list(handle.eos_token_ids))  # fmt: skip


def _step_logprobs(handle, ids, matcher):
    """``[V]`` float64: the model's next-token log-softmax after ``ids`` (one full forward pass, no
    cache), renormalised over what ``matcher`` allows (None: everything)."""
    with torch.inference_mode():
        logits = handle.model(input_ids=torch.tensor([ids])).logits[0, -1].double()  # [V]
    if matcher is None:
        return torch.log_softmax(logits, -1)
    mask = allocate_token_bitmask(1, handle.vocab_size)  # [1, ceil(V / 32)]
    matcher.fill_next_token_bitmask(mask)
    return torch.log_softmax(logits + bitmask_penalty(mask, handle.vocab_size)[0].double(), -1)


def brute_force(handle, prompt_ids, compiled, max_tokens):
    """Every output the grammar allows within ``max_tokens`` (EOS included) as ``(tokens, logprob)``,
    the most prefixes (accepted token sequences, EOS excluded) of any one length, and every unfinished
    prefix as ``(tokens, logprob)``."""
    eos, found, prefixes, unfinished = set(handle.eos_token_ids), [], Counter(), []

    def visit(tokens, logprob, matcher):
        unfinished.append((tokens, logprob))
        logprobs = _step_logprobs(handle, prompt_ids + tokens, matcher)  # [V]
        allowed = torch.nonzero(logprobs > -math.inf).flatten().tolist()
        ends = [t for t in allowed if t in eos]
        if ends:  # the probability of ending: all EOS ids together
            found.append((tokens, logprob + float(logprobs[ends].logsumexp(-1))))
        for token in (t for t in allowed if t not in eos):
            child = matcher.fork()
            assert child.accept_token(token)
            prefixes[len(tokens) + 1] += 1
            extended = ([*tokens, token], logprob + float(logprobs[token]))
            if child.is_completed() and not child.can_continue():
                found.append(extended)
            elif len(tokens) + 1 < max_tokens:
                visit(*extended, child)

    visit([], 0.0, compiled.matcher())
    return found, max(prefixes.values()), unfinished


def length(handle, tokens):
    """An output's length: its text's tokens as the tokenizer writes it, at most ``len(tokens)``."""
    return min(len(handle.tokenizer.encode(handle.tokenizer.decode(tokens), add_special_tokens=False)), len(tokens))


def ranked(found, length_penalty, handle):
    """The ``found`` token sequences as ``(score, tokens, logprob)``, best first."""
    scored = [
        (logprob / max(length(handle, tokens), 1) ** length_penalty, tokens, logprob) for tokens, logprob in found
    ]
    return sorted(scored, key=lambda s: -s[0])


def distinct_texts(ranked_sequences, handle):
    """The first (best) sequence of each text, in order (beam search keeps distinct texts)."""
    out, seen = [], set()
    for item in ranked_sequences:
        text = handle.tokenizer.decode(item[1])
        if text not in seen:
            seen.add(text)
            out.append(item)
    return out


CASES = [  # (constraint, max_tokens, length_penalty)
    (constrain.choice(["a", "ab", "abc", "b"]), 3, 1.0),  # EOS after "a" and "ab", "abc" ends by its token
    (constrain.choice(["a", "ab", "abc", "b"]), 2, 0.0),  # a+b+c cannot finish within 2 tokens
    (constrain.choice(["no", "yes", "not at all"]), 4, 2.5),
    (constrain.choice(["yes", "no", "maybe"]), 4, -0.5),  # the bound of length_penalty <= 0
    (constrain.regex(r"x[yz]{1,2}"), 3, 1.0),
    (constrain.regex(r"[a-z0-9]|long one"), 8, 2.0),  # W short ones finish first: the stopping bound decides
]


@pytest.mark.parametrize(("constraint", "max_tokens", "length_penalty"), CASES)
def test_beam_search_finds_the_brute_force_best(tiny, constraint, max_tokens, length_penalty):
    prompt_ids = list(tiny.tokenizer.encode(PROMPT))
    found, widest, _ = brute_force(tiny, prompt_ids, _compiled(tiny, constraint), max_tokens)
    expected = distinct_texts(ranked(found, length_penalty, tiny), tiny)[:widest]
    results = constrain.generate(tiny, PROMPT, constraint=constraint, max_tokens=max_tokens, num_beams=widest,
                                 length_penalty=length_penalty, n=widest)  # fmt: skip
    beams = results[0].beams
    assert len({b.text for b in beams}) == len(beams), "distinct texts"
    for b in beams:  # a text ranks by its likeliest tokenization, however many pieces the others take
        assert b.logprob == pytest.approx(max(lp for t, lp in found if tiny.tokenizer.decode(t) == b.text), abs=1e-4)
    assert [b.token_ids for b in beams] == [tokens for _, tokens, _ in expected]
    assert [b.score for b in beams] == pytest.approx([score for score, _, _ in expected], abs=1e-4)
    assert [b.logprob for b in beams] == pytest.approx([logprob for _, _, logprob in expected], abs=1e-4)
    assert [r.token_ids for r in results] == [b.token_ids for b in beams[: len(results)]]
    assert all(r.finish_reason == "stop" and r.valid and r.text == r.value for r in results)


@pytest.mark.parametrize("length_penalty", [-1.0, 0.0, 0.5, 1.0, 3.0])
def test_the_stopping_bound_holds_for_every_prefix(tiny, length_penalty):
    """The search stops once no live beam can beat the W-th finished one, by ``BeamSearch.bound``: no
    output the grammar allows may score above the bound of any of its prefixes."""
    constraint, prompt_ids = constrain.choice(["no", "yes", "not at all"]), list(tiny.tokenizer.encode(PROMPT))
    compiled = _compiled(tiny, constraint)
    found, _, unfinished = brute_force(tiny, prompt_ids, compiled, 5)
    search = BeamSearch(tiny, prompt_ids, compiled, num_beams=1, length_penalty=length_penalty, max_tokens=5)
    for prefix, logprob in unfinished:
        scores = [search.score(lp, length(tiny, tokens)) for tokens, lp in found if tokens[: len(prefix)] == prefix]
        assert max(scores, default=-math.inf) <= search.bound(logprob) + 1e-9


def test_length_penalty_changes_the_best(tiny):
    """Short answers win on likelihood alone (every token costs), long ones under a strong penalty."""
    constraint, prompt_ids = constrain.choice(["no", "yes", "not at all"]), list(tiny.tokenizer.encode(PROMPT))
    found, widest, _ = brute_force(tiny, prompt_ids, _compiled(tiny, constraint), 4)
    best = {}
    for penalty in (0.0, 3.0):
        expected = ranked(found, penalty, tiny)[0]
        r = constrain.generate(tiny, PROMPT, constraint=constraint, max_tokens=4, num_beams=widest,
                               length_penalty=penalty)  # fmt: skip
        assert r.token_ids == expected[1] and r.beams[0].score == pytest.approx(expected[0], abs=1e-4)
        best[penalty] = r.text
    assert best == {0.0: best[0.0], 3.0: "not at all"} and best[0.0] != "not at all"


def _rescored(handle, prompt_ids, compiled, tokens):
    """``tokens``' logprob by full forward passes, each step renormalised over its mask, ending included,
    and the matcher after them."""
    matcher = compiled.matcher() if compiled is not None else None
    total = 0.0
    for k, token in enumerate(tokens):
        total += float(_step_logprobs(handle, prompt_ids + tokens[:k], matcher)[token])
        if matcher is not None:
            assert matcher.accept_token(token)
    if matcher is not None and not matcher.can_continue():
        return total, matcher  # it ended by its last token
    logprobs = _step_logprobs(handle, prompt_ids + tokens, matcher)
    return total + float(logprobs[list(handle.eos_token_ids)].logsumexp(-1)), matcher


@pytest.mark.parametrize("constrained", [True, False], ids=["json-schema", "free-text"])
def test_every_finished_beam_is_complete_valid_and_scored_as_the_model_would(tiny, constrained):
    """With a KV cache reordered every step, each beam's logprob is what full forward passes give; every
    beam the schema constrains is accepted by a fresh matcher, complete, and its value validates."""
    compiled = _compiled(tiny, constrain.json_schema(SCHEMA)) if constrained else None
    r = constrain.generate(tiny, PROMPT, schema=SCHEMA if constrained else None, num_beams=4, max_tokens=24,
                           length_penalty=0.5)  # fmt: skip
    assert r.valid and r.finish_reason == "stop" and 2 <= len(r.beams) <= 4
    assert len({b.text for b in r.beams}) == len(r.beams), "distinct outputs"
    assert [b.score for b in r.beams] == sorted((b.score for b in r.beams), reverse=True)
    assert (r.text, r.token_ids) == (r.beams[0].text, r.beams[0].token_ids)
    prompt_ids = list(tiny.tokenizer.encode(PROMPT))
    for beam in r.beams:
        logprob, matcher = _rescored(tiny, prompt_ids, compiled, beam.token_ids)
        assert beam.logprob == pytest.approx(logprob, abs=1e-4)
        assert beam.score == pytest.approx(beam.logprob / max(length(tiny, beam.token_ids), 1) ** 0.5)
        assert beam.text == tiny.tokenizer.decode(beam.token_ids, skip_special_tokens=True)
        if constrained:
            assert matcher.is_completed()
            jsonschema.validate(beam.value, SCHEMA)
            assert beam.value == json.loads(beam.text)


def test_nothing_finished_is_one_unfinished_result_never_valid(tiny):
    r = constrain.generate(tiny, PROMPT, schema=SCHEMA, num_beams=2, max_tokens=3)
    assert r.finish_reason == "length" and r.beams == [] and not r.valid and r.violations
    assert len(r.token_ids) == 3


def test_forked_matchers_are_independent(tiny):
    parent = _compiled(tiny, constrain.choice(["ab", "ba"])).matcher()
    first, second = parent.fork(), parent.fork()
    a, b = (tiny.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "b"))
    assert first.accept_token(a) and second.accept_token(b)
    assert (parent.num_accepted, first.num_accepted, second.num_accepted) == (0, 1, 1)
    masks = allocate_token_bitmask(3, tiny.vocab_size)
    for row, m in enumerate((parent, first, second)):
        m.fill_next_token_bitmask(masks, row)
    allowed = [set(torch.nonzero(bitmask_penalty(masks[k : k + 1], tiny.vocab_size)[0] == 0).flatten().tolist())
               for k in range(3)]  # fmt: skip
    assert b in allowed[1] and a not in allowed[1] and a in allowed[2] and b not in allowed[2]
    assert a in allowed[0] and b in allowed[0]  # the parent is where it was


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 2.5}, "num_beams"),
        ({"num_beams": True}, "num_beams"),
        ({"num_beams": "3"}, "num_beams"),
        ({"num_beams": 1, "length_penalty": math.nan}, "length_penalty"),
        ({"length_penalty": math.inf}, "length_penalty"),
        ({"length_penalty": "1"}, "length_penalty"),
        ({"n": 4}, "n"),
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"seed": 1}, "seed"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["b"]}, "stop"),
        ({"reasoning": True}, "reasoning"),
    ],
)
def test_bad_arguments_raise_before_any_forward(tiny, kwargs, field):
    calls = []
    tiny.model.forward = lambda *a, **k: calls.append(1)  # the instance's: any forward pass is counted
    try:
        with pytest.raises(BeamSearchError, match=f"^{field}:") as info:
            constrain.generate(tiny, [constrain.Request(PROMPT, choices=["a"]), PROMPT], choices=["a"],
                               **{"num_beams": 3, **kwargs})  # a good request first: nothing runs  # fmt: skip
    finally:
        del tiny.model.forward
    assert info.value.field == field and isinstance(info.value, ValueError) and not calls


def test_neutral_sampling_values_are_accepted_and_stream_refuses_beams(tiny):
    r = constrain.generate(tiny, PROMPT, choices=["a", "b"], num_beams=2, temperature=0, top_p=1.0)
    assert r.value in ("a", "b")
    with pytest.raises(BeamSearchError, match="num_beams"):
        next(constrain.stream(tiny, PROMPT, choices=["a", "b"], num_beams=2))


def test_a_batch_mixes_beam_search_and_sampling(tiny):
    requests = [constrain.Request(PROMPT, choices=["a", "b"], num_beams=2),
                constrain.Request(PROMPT, choices=["c"], sampling={"temperature": 0})]  # fmt: skip
    beam, sampled = constrain.generate(tiny, requests)
    assert beam.beams and beam.value in ("a", "b") and sampled.beams is None and sampled.value == "c"


@pytest.fixture(scope="module")
def server(tiny):
    s = LocalServer(tiny)
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield s
    s.stop()


def test_server_use_beam_search_returns_the_n_best_beams(server, tiny):
    messages = [{"role": "user", "content": "Pick one."}]
    choices = ["no", "yes", "not at all"]
    r = server.client.chat.completions.create(model=server.model, messages=messages, n=2, max_tokens=4,
                                              extra_body={"use_beam_search": True, "best_of": 3, "choices": choices,
                                                          "length_penalty": 0.5})  # fmt: skip
    expected = constrain.generate(tiny, messages, choices=choices, max_tokens=4, num_beams=3, n=2, length_penalty=0.5)
    assert [c.message.content for c in r.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"] and r.usage.completion_tokens > 0
    text = server.client.completions.create(model=server.model, prompt=[PROMPT, "Other:"], n=2, max_tokens=4, best_of=3,
                                            extra_body={"use_beam_search": True, "choices": choices})  # fmt: skip
    expected = [e for p in (PROMPT, "Other:") for e in constrain.generate(tiny, p, choices=choices, max_tokens=4,
                                                                          num_beams=3, n=2)]  # fmt: skip
    assert [c.text for c in text.choices] == [e.text for e in expected] and 2 <= len(expected) <= 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True, "stream": True}, "stream"),
        ({"use_beam_search": True, "best_of": 1, "n": 2}, "best_of"),
        ({"use_beam_search": True, "best_of": 0}, "best_of"),
        ({"use_beam_search": True, "temperature": 0.5}, "temperature"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_server_refuses_bad_beam_options(server, extra, param):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    try:
        headers = {"content-type": "application/json"}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        status, error = response.status, json.loads(response.read())["error"]
    finally:
        conn.close()
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_loops_projection_hook_leaves_other_threads_alone(tiny):
    """The decode loop narrows the output layer to its draft slots during its forward; a beam search on
    the server's worker thread, running the same model at that moment, must get every position."""
    from constrain.decode.loop import project_only

    slots = (torch.tensor([0]), torch.tensor([1]))
    ids = torch.tensor([tiny.tokenizer.encode(PROMPT)])  # [1, T]
    with torch.inference_mode(), project_only(tiny.model, slots) as projected:
        assert projected and tiny.model(input_ids=ids).logits.shape[:2] == (1, 1)  # this thread: narrowed
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(lambda: tiny.model(input_ids=ids).logits.shape[:2]).result()
    assert other == tuple(ids.shape)
