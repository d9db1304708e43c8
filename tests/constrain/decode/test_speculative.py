"""Draft proposers (prompt lookup, a draft model) verified by the loop without changing a token, and
the policy that feeds their drafts only where they pay: forward cost, acceptance, per-step plan."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
from types import SimpleNamespace

import pytest
import torch

import constrain
from constrain.decode.loop import DecodeLoop, run
from constrain.decode.speculative import (
    Acceptance,
    DraftModelProposer,
    NgramProposer,
    expected_tokens,
    ngram_proposal,
    plan_drafts,
    probe_width,
    shortening,
)
from constrain.generation import admit, generate
from constrain.models.cost import ForwardCost, forward_cost, measure_forward_cost, non_decreasing
from constrain.models.loading import prepack_linears

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 6},
                   "note": {"type": "string", "maxLength": 30}},
    "required": ["items", "note"],
    "additionalProperties": False,
}  # fmt: skip

FREE = ForwardCost(tokens=(1,), seconds=(1.0,))
"""A device on which a pass costs the same whatever its width: every draft on offer is fed."""


def test_ngram_proposal():
    history = [5, 1, 2, 3, 9, 9, 1, 2]
    assert ngram_proposal(history, 2) == [3, 9]  # "1 2" occurred before, followed by 3 9
    assert ngram_proposal(history, 10) == [3, 9, 9, 1, 2]
    assert ngram_proposal([1, 2, 3], 2) == []  # no earlier occurrence of any suffix
    assert ngram_proposal([7], 3) == []
    assert NgramProposer(n_max=1).propose([4, 8], [4], 3, None) == [8, 4]  # prompt and output, one history
    with pytest.raises(ValueError, match="n_max"):
        NgramProposer(n_max=0)


def _random_model(tokenizer, seed: int) -> constrain.ModelHandle:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)  # fmt: skip
    return constrain.load_model((LlamaForCausalLM(config), tokenizer))


@contextlib.contextmanager
def _counted_forward(model):
    """Counts ``model.forward`` calls into the list it yields, while the block runs."""
    calls: list[int] = []
    original = model.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = counted
    try:
        yield calls
    finally:
        del model.forward


def _decode(handle, specs, speculative, cost=FREE):
    """(output ids and texts, forward passes of the target model) of one batched run."""
    requests = [r for spec in specs for r in admit(handle, spec)]
    with _counted_forward(handle.model) as calls:
        run(handle, requests, speculative=speculative, forward_cost=cost)
    return [(r.output_ids, r.text) for r in requests], len(calls)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"seed": 5}, {"seed": 2, "top_k": 20, "logprobs": 1}])
def test_draft_model_changes_no_token(tiny, smol_tokenizer, sampling):
    """Drafts from the target's own weights are the target's greedy choices (almost all accepted: far
    fewer passes); drafts from another random model are mostly rejected. Either way the tokens are
    those of plain decoding, constrained or not."""
    specs = [constrain.Request("JSON:", schema=SCHEMA, max_tokens=50, sampling=sampling),
             constrain.Request("Free text:", max_tokens=30, sampling=sampling),
             constrain.Request("Code:", regex=r"[a-z]{4}-\d{6}", sampling=sampling)]  # fmt: skip
    plain, plain_passes = _decode(tiny, specs, False)
    twin = DraftModelProposer((copy.deepcopy(tiny.model), smol_tokenizer), k=4)
    other = DraftModelProposer(_random_model(smol_tokenizer, seed=1), k=4)
    same, same_passes = _decode(tiny, specs, twin)
    mixed, _ = _decode(tiny, specs, other)
    assert same == plain and mixed == plain
    assert all(ids for ids, _ in plain)
    if sampling.get("temperature") == 0:  # the twin drafts exactly the greedy choice
        assert same_passes < 0.6 * plain_passes, (same_passes, plain_passes)


def test_draft_model_reuses_its_cache_and_obeys_the_grammar(tiny, smol_tokenizer):
    proposer = DraftModelProposer((copy.deepcopy(tiny.model), smol_tokenizer), k=3, max_cached=1)
    compiled = constrain.compile(constrain.regex(r"(ab|cd){2,5}"), smol_tokenizer)
    prompt = smol_tokenizer.encode("Letters:")
    matcher = compiled.matcher()
    drafts = proposer.propose(prompt, [], 3, matcher)
    assert drafts and compiled.matcher().accept_tokens(drafts) == len(drafts)
    kept = proposer.cached(prompt)
    assert kept is not None
    seen, cache = kept
    assert cache.get_seq_length() == len(seen) >= len(prompt)
    proposer.propose(prompt, drafts[:1], 3, None)  # continues from the cached prefix
    assert proposer.cached(prompt)[1] is cache  # type: ignore[index]
    proposer.propose([1, 2, 3], [], 2, None)
    assert proposer.cached_prompts == [(1, 2, 3)]  # max_cached=1: the older prompt's cache was dropped


def test_draft_model_caches_are_reported_together_and_go_with_their_proposer(tiny, smol_tokenizer):
    gc.collect()
    before = constrain.cache_stats()["caches"]["decode.speculative.draft_kv"]
    proposer = DraftModelProposer((copy.deepcopy(tiny.model), smol_tokenizer), k=2, max_cached=3)
    prompt = smol_tokenizer.encode("Letters:")
    drafts = proposer.propose(prompt, [], 2, None)
    proposer.propose(prompt, drafts[:1], 2, None)  # its cache found again
    cache = proposer.cached(prompt)[1]  # type: ignore[index]
    held = sum(t.nelement() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    during = constrain.cache_stats()["caches"]["decode.speculative.draft_kv"]
    assert during["instances"] == before["instances"] + 1 and during["entries"] == before["entries"] + 1
    assert during["bytes"] == before["bytes"] + held > before["bytes"]
    assert during["maxsize"] == (before["maxsize"] if before["instances"] else 0) + 3
    assert (during["hits"] - before["hits"], during["misses"] - before["misses"]) == (1, 1)
    del proposer, cache
    gc.collect()
    after = constrain.cache_stats()["caches"]["decode.speculative.draft_kv"]
    assert (after["instances"], after["entries"], after["bytes"]) == (
        before["instances"], before["entries"], before["bytes"]
    )  # fmt: skip


def test_draft_model_of_another_vocabulary_is_refused_up_front(tiny, sp_tokenizer):
    proposer = DraftModelProposer(_random_model(sp_tokenizer, seed=0))
    calls: list[int] = []
    tiny.model.forward = functools.partial(lambda *a, **k: calls.append(1))
    try:
        with pytest.raises(ValueError, match="vocabulary"):
            generate(tiny, "Hi", max_tokens=3, speculative=proposer)
    finally:
        del tiny.model.forward
    assert not calls
    with pytest.raises(ValueError, match="at least 1"):
        DraftModelProposer(tiny, k=0)


def test_expected_tokens():
    assert expected_tokens(0, 0.7) == 1.0  # the sampled token alone
    assert expected_tokens(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(3, 0.0) == 1.0
    assert expected_tokens(3, 0.5, run=0.9) == pytest.approx(1 + 0.5 * (1 + 0.9 + 0.81))  # a copy goes on
    assert plan_drafts([0], [16], [0.5], lambda width: 1.0 + 0.03 * (width - 1), [0.9]) == [16]
    assert plan_drafts([0], [16], [0.5], lambda width: 1.0 + 0.03 * (width - 1)) == [4]  # independent drafts


def test_plan_feeds_drafts_where_they_are_cheap_and_accepted():
    assert plan_drafts([0, 0], [4, 2], [0.8, 0.8], lambda width: 1.0) == [4, 2]  # a free pass: all of them
    assert plan_drafts([0], [4], [0.8], lambda width: 1.0 + 0.01 * (width - 1)) == [4]
    # at 0.5, a fourth draft adds 1/16 of a token for 5% more cost: three pay
    assert plan_drafts([0], [6], [0.5], lambda width: 1.0 + 0.05 * (width - 1)) == [3]


def test_plan_feeds_none_where_they_are_costly_or_rejected():
    widths: list[int] = []

    def linear(width: int) -> float:  # a pass costs its width: a draft never pays
        widths.append(width)
        return float(width)

    assert plan_drafts([0, 0], [4, 3], [0.9, 0.9], linear) == [0, 0]
    assert plan_drafts([0], [4], [0.0], lambda width: 1.0 + 0.01 * (width - 1)) == [0]  # never accepted
    assert plan_drafts([0], [4], [0.0], lambda width: 1.0) == [0]  # a tie: the narrowest pass
    widths.clear()
    assert plan_drafts([3, 0], [0, 2], [0.5, 0.1], linear) == [0, 2] and not widths  # no choice: no cost asked


def test_plan_shares_the_width_of_the_batch():
    cost = ForwardCost(tokens=(1, 8, 64), seconds=(1.0, 1.1, 4.0))  # flat up to 8 tokens, then steep
    # the same row is worth drafting for alone (one draft: 1.4% more cost), not beside 7 others
    assert plan_drafts([0], [3], [0.3], functools.partial(cost.relative, 1))[0] > 0
    assert plan_drafts([0] * 8, [3] * 8, [0.3] * 8, functools.partial(cost.relative, 8)) == [0] * 8
    # forced tokens widen the pass anyway: drafts up to that width ride along, none beyond it pays
    assert plan_drafts([4, 0, 0], [0, 2, 9], [0.5, 0.1, 0.1], float) == [0, 2, 4]  # cost: the width
    # one accepting row may widen the pass only if the whole batch gains
    assert plan_drafts([0] * 8, [4] + [0] * 7, [0.9] + [0.0] * 7, functools.partial(cost.relative, 8)) == [0] * 8
    with pytest.raises(ValueError, match="one entry per row"):
        plan_drafts([0], [1, 2], [0.5, 0.5], cost.relative)


def test_plan_weighs_drafts_by_the_share_that_shortens_the_batch():
    def cost(width: int) -> float:
        return 1.0 + 0.13 * (width - 1)

    rows = ([0] * 8, [4] * 2 + [0] * 6, [0.76] * 8, cost)
    assert plan_drafts(*rows) == [2] * 2 + [0] * 6  # each row on its own: two rows' drafts pay for the batch
    assert plan_drafts(*rows, weights=[1.0] * 8) == plan_drafts(*rows)
    assert plan_drafts(*rows, weights=[2 / 8] * 8) == [0] * 8  # a generate call's 8 rows, 6 left at one token
    with pytest.raises(ValueError, match="one entry per row"):
        plan_drafts(*rows, weights=[1.0])


def test_shortening_is_the_slowest_row_s_share_of_the_kept_drafts():
    assert shortening([0], 1) == shortening([5, 5, 5], 3) == 1.0  # one row, or rows that keep drafts alike
    assert shortening([0] * 8, 8) == 1.0  # no evidence, every row offered drafts: as if each were on its own
    assert shortening([0] * 8, 2) == 0.25  # 6 rows left at one token this pass: the end moves with them
    assert shortening([0, 4, 4, 4], 4) < 0.3  # a row that keeps none sets the end
    assert shortening([3, 4, 4, 5], 4) == pytest.approx(4 / 5)
    with pytest.raises(ValueError, match="at least one row"):
        shortening([], 0)
    with pytest.raises(ValueError, match="moving <= rows"):
        shortening([0], 2)


def test_a_generate_call_s_rows_are_planned_together(tiny):
    """``run`` (what ``generate`` calls) adds its requests as one group, weighed by the rows that move this
    pass; a server's requests stay each on its own."""
    greedy = admit(tiny, constrain.Request("Hi", max_tokens=4, n=3, sampling={"temperature": 0}))
    with DecodeLoop(tiny) as loop:
        loop.add(greedy, together=True)
        alone = admit(tiny, constrain.Request("Hi", max_tokens=4))
        loop.add(alone)
        assert len({r.group for r in greedy}) == 1 and greedy[0].group is not None and alone[0].group is None
        loop.step()  # the prefill: no draft kept yet
        forced = [2 if r is greedy[0] else 0 for r in loop.active]  # one row fed forced tokens, one offered drafts
        offered = [3 if r is greedy[1] else 0 for r in loop.active]
        shares = dict(zip(map(id, loop.active), loop._shortening(forced, offered) or [], strict=True))
        assert [shares[id(r)] for r in greedy + alone] == pytest.approx([2 / 3] * 3 + [1.0])
        while loop.busy:
            loop.step()
    assert all(r.finish_reason in ("length", "stop") for r in greedy + alone)


def test_acceptance_follows_the_drafts_kept():
    a = Acceptance(prior=0.5)
    assert a.rate == 0.5 == a.estimate_run(None)  # no evidence: the prior
    for _ in range(5):
        a.observe(fed=4, accepted=4)  # every draft kept
    high, high_run = a.rate, a.estimate_run(None)
    assert high > 0.8 and high_run > 0.85
    for _ in range(20):
        a.observe(fed=4, accepted=0)  # the first draft rejected: one trial, no acceptance; nothing past it tested
    assert a.rate < 0.5 < high and a.estimate_run(None) > 0.5  # the few runs seen all held
    a.observe(fed=3, accepted=1)  # kept the first, then a rejection: the run's 0 of 1
    low, low_run = a.rate, a.estimate_run(None)
    assert low_run < high_run
    for _ in range(100):
        a.observe(fed=0, accepted=0)  # no drafts fed: the evidence fades back to the prior
    assert low < a.rate == pytest.approx(0.5, abs=1e-3) and a.estimate_run(None) == pytest.approx(0.5, abs=1e-3)
    assert a.kept == 5 * 4 + 1  # drafts kept in all: they do not fade
    with pytest.raises(ValueError, match="accepted <= fed"):
        a.observe(fed=1, accepted=2)
    bad_evidence = ({"accepted": 2.0, "trials": 1.0}, {"run_accepted": 2.0, "run_trials": 1.0})
    for bad in ({"prior": 1.5}, {"decay": -0.1}, {"prior_weight": 0.0}, *bad_evidence):
        with pytest.raises(ValueError):
            Acceptance(**bad)
    with pytest.raises(ValueError, match="acceptance_prior"):
        NgramProposer(acceptance_prior=2.0)


def test_acceptance_keeps_a_copy_s_runs_apart_from_its_first_guesses():
    """A copy whose first guesses are rare but whose runs hold (a quote after free text) keeps a low first
    rate and a high run; mixed into one rate, the long runs would raise the first guess's chance and the
    rare runs would lower the copy's."""
    a = Acceptance(prior=0.5)
    for _ in range(3):
        for _ in range(3):
            a.observe(fed=1, accepted=0)  # three one-token guesses refused
        a.observe(fed=8, accepted=8)  # then a copy held for 8
    assert a.rate < 0.5 < 0.9 < a.estimate_run(None)
    assert a.estimate_run(0.2) < a.estimate_run(None) < a.estimate_run(0.9)  # a proposal's own run, weighed
    assert a.estimate_run(None, prior=0.1) < a.estimate_run(None)  # no run given: the proposal's prior


def test_acceptance_probes_with_one_draft_and_backs_off_after_rejections():
    a = Acceptance(prior=0.5)
    assert a.limit() == 1  # no evidence: one draft at most
    a.observe(fed=1, accepted=1)
    assert a.limit() == 1
    a.observe(fed=1, accepted=1)
    assert a.limit() is None  # two passes with drafts: as many as pay
    waits = []
    for _ in range(6):  # passes whose drafts are all rejected: wait 1, 2, 4, 8, 16, 16 steps
        a.observe(fed=2, accepted=0)
        waits.append(a.wait)
        while a.limit() == 0:
            a.observe(fed=0, accepted=0)
    assert waits == [1, 2, 4, 8, 16, 16]
    a.observe(fed=2, accepted=1)  # a draft kept: no more waiting
    assert a.wait == 0 and a.limit() is None and a.misses == 0
    assert Acceptance().limit(0.5) == 1 and Acceptance().limit(0.95) is None  # a confident proposal: no probe
    assert Acceptance().limit(0.5, probe=6) == 6  # a probe as wide as costs no more than one draft
    assert a.estimate(0.1) < a.rate < a.estimate(0.9)  # a proposal's own prior, weighed with the evidence


def test_a_probe_feeds_as_many_drafts_as_cost_no_more_than_one():
    avx2 = ForwardCost(tokens=(1, 2, 12, 16, 32), seconds=(0.09, 0.16, 0.16, 0.2, 0.3))  # a matrix product flat to 12
    assert probe_width(functools.partial(avx2.relative, 1), 16) == 11  # 12 tokens: the last token and 11 drafts
    assert probe_width(functools.partial(avx2.relative, 8), 16) == 1  # 8 rows: every draft per row costs more
    linear = ForwardCost(tokens=(1, 64), seconds=(1.0, 64.0))
    assert probe_width(functools.partial(linear.relative, 1), 16) == 1
    assert probe_width(functools.partial(FREE.relative, 8), 16) is None  # free drafts: nothing to bound


def test_ngram_drafts_carry_a_prior_by_the_length_and_place_of_their_match():
    from constrain.decode.speculative import NGRAM_PRIORS, ngram_proposal

    prior = {where: {length: p for length, p, _ in rows} for where, rows in NGRAM_PRIORS.items()}
    run = {where: {length: r for length, _, r in rows} for where, rows in NGRAM_PRIORS.items()}
    three = ngram_proposal([5, 6, 7, 8, 5, 6, 7], 2)
    assert three == [8, 5] and three.prior == prior["output"][3]
    assert ngram_proposal([1, 2, 9, 4, 2], 3).prior == prior["output"][1]  # only "2" was seen before
    copied = ngram_proposal([1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 5, 6], 2)  # "2 3 4 5 6" again: measured past n_max
    assert copied == [7, 9] and copied.prior == prior["output"][5]
    assert ngram_proposal([1, 2, 3], 3) == [] and ngram_proposal([1, 2, 3], 3).prior is None
    # the same history, its first 7 tokens the prompt: the drafts continue the prompt
    quoted = ngram_proposal([1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 5, 6], 2, prompt=7)
    assert quoted == [7, 9] and (quoted.prior, quoted.run) == (prior["prompt"][5], run["prompt"][5])
    two = ngram_proposal([1, 2, 3, 9, 5, 2, 3], 1, prompt=5)  # "2 3" found in the prompt, 2 tokens matched
    assert two == [9] and two.prior == prior["prompt"][2] > prior["output"][2]
    # the latest occurrence decides: "2 3" occurs in the prompt and, later, in the output
    assert ngram_proposal([1, 2, 3, 8, 2, 3, 9, 2, 3], 1, prompt=4).prior == prior["output"][2]
    for rows in NGRAM_PRIORS.values():  # the longer the match, the likelier its first draft
        assert [p for _, p, _ in rows] == sorted(p for _, p, _ in rows)
    assert NgramProposer().propose([1, 2, 3, 9], [2, 3], 1, None).prior == prior["prompt"][2]


def test_the_forward_cost_is_saved_and_read_by_the_next_process(smol_tokenizer, monkeypatch, tmp_path):
    """A later process reads the cost from disk (checking its one-token pass only), so its drafts, and
    seeded outputs, are the same; a cost that no longer matches the machine, was timed on a busy one, or
    stops short of the batch's passes, is measured again. On a clock that each pass advances by ``speed``
    x its tokens x 1 ms."""
    from constrain.models import cost

    monkeypatch.setenv("CONSTRAIN_CACHE", str(tmp_path))
    handle = _random_model(smol_tokenizer, seed=3)
    now, speed, passes = [0.0], [1.0], []
    original = handle.model.forward

    def timed(*args, **kwargs):
        if "position_ids" in kwargs:  # a timed pass (the contexts' come first, untimed)
            passes.append(tuple(kwargs["input_ids"].shape))
            now[0] += speed[0] * (1 + kwargs["input_ids"].numel()) * 1e-3
        return original(*args, **kwargs)

    monkeypatch.setattr(handle.model, "forward", timed)
    monkeypatch.setattr(cost, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    first = forward_cost(handle.model)
    assert cost.saved_cost_path(handle.model).is_file() and first.tokens[-1] >= 2
    cost._measured.clear()  # as in a new process
    passes.clear()
    assert forward_cost(handle.model) == first and passes == [(1, 1)] * 5  # the drift check: five one-token passes
    cost._measured.clear()
    speed[0] = 3.0  # another machine under the same name
    slower = forward_cost(handle.model)
    assert slower.seconds[0] == pytest.approx(3 * first.seconds[0])
    cost._measured.clear()
    speed[0] = 1.8  # faster than that table, within DRIFT: it was timed on a busy machine, and is timed again
    assert forward_cost(handle.model).seconds[0] == pytest.approx(1.8 * first.seconds[0])
    cost._measured.clear()
    speed[0] = 2.0  # slower than the table now, or a little faster: it stays
    assert forward_cost(handle.model).seconds[0] == pytest.approx(1.8 * first.seconds[0])
    cost._measured.clear()
    speed[0] = 1.6
    assert forward_cost(handle.model).seconds[0] == pytest.approx(1.8 * first.seconds[0])
    passes.clear()
    wide = forward_cost(handle.model, width=4 * first.tokens[-1])  # drafts wider than the table
    assert wide.tokens[-1] >= 4 * first.tokens[-1] and max(passes) >= (1, 4 * first.tokens[-1])
    cost._measured.clear()
    assert forward_cost(handle.model, width=4 * first.tokens[-1]) == wide  # saved as extended
    passes.clear()
    batch = forward_cost(handle.model, batch=11, width=3)  # timed on 8 rows: 11 is read from 8's size class
    assert (
        {rows for rows, _ in passes} == {1, 8} and (8, 3) in passes and cost.saved_cost_path(handle.model, 8).is_file()
    )
    assert batch.tokens[:3] == (1, 8, 16) and batch != wide
    passes.clear()
    assert forward_cost(handle.model, batch=8, width=3) is batch and not passes  # the same class, remembered


def test_a_prepacked_model_s_forward_cost_is_saved_apart(smol_tokenizer, monkeypatch, tmp_path):
    """Prepacked linear layers change a pass's cost (drafts cost far less on an AVX2 CPU): a table measured
    on the plain model is not read for the packed one, nor the reverse."""
    from constrain.models import cost

    monkeypatch.setenv("CONSTRAIN_CACHE", str(tmp_path))
    plain = _random_model(smol_tokenizer, seed=3).model
    packed = copy.deepcopy(plain)
    prepack_linears(packed)
    assert cost.saved_cost_path(packed) != cost.saved_cost_path(plain)
    assert cost.saved_cost_path(copy.deepcopy(plain)) == cost.saved_cost_path(plain)  # not the weights' values


def test_forward_cost_table():
    cost = ForwardCost(tokens=(1, 5), seconds=(1.0, 2.0))
    assert cost.seconds_for(3) == 1.5 and cost.seconds_for(10) == 4.0  # between points; past the last: in proportion
    assert cost.relative(1, 1) == 1.0 and cost.relative(2, 2) == pytest.approx(1.75 / 1.25)
    assert FREE.relative(8, 17) == 1.0
    flat = ForwardCost(tokens=(1, 2, 16), seconds=(1.0, 1.7, 1.7))  # an AVX2 CPU's: flat as far as it was measured
    assert flat.relative(8, 2) == 1.0 and flat.relative(8, 15) == pytest.approx(7.5)  # not free past the table
    for tokens, seconds in (((2, 4), (1.0, 2.0)), ((1, 1), (1.0, 1.0)), ((1, 4), (2.0, 1.0)), ((1,), (0.0,)),
                            ((1, 4), (1.0,)), ((), ())):  # fmt: skip
        with pytest.raises(ValueError):
            ForwardCost(tokens, seconds)


def test_forward_cost_is_measured_once_per_model(smol_tokenizer):
    handle = _random_model(smol_tokenizer, seed=3)
    with _counted_forward(handle.model) as calls:
        measured = measure_forward_cost(handle.model)
        assert len(calls) >= 1 + 2 * 2  # the context, then two sizes at least, twice each
        assert measured.tokens[0] == 1 and len(measured.tokens) >= 2
        assert all(s > 0 for s in measured.seconds)
        first = forward_cost(handle.model)
        calls.clear()
        assert forward_cost(handle.model) is first and not calls  # cached: no forward pass


@pytest.mark.parametrize(
    ("passes", "expected"),
    [
        # (seconds of each timed pass by tokens fed, per sweep) -> the table kept
        ({1: [1.1, 4.1], 4: [1.4, 1.4], 16: [2.6, 2.7], 64: [7.4, 7.4]}, ((1, 4, 16), (1.1, 1.4, 2.6))),
        ({1: [1.0, 1.0], 4: [1.5, 1.6], 16: [1.2, 1.3], 64: [3.0, 3.0]}, ((1, 4, 16, 64), (1.0, 1.35, 1.35, 3.0))),
    ],
    ids=["busy-sweep-and-knee", "noise-made-non-decreasing"],
)
def test_forward_cost_keeps_the_fastest_pass_up_to_the_knee(smol_tokenizer, monkeypatch, passes, expected):
    """On a clock that each pass advances by a known time: each size keeps its fastest pass over the sweeps
    (a busy moment is dropped), sizes stop after the first pass at ``KNEE`` times a one-token one, and a
    wider pass is never cheaper than a narrower one: a decreasing run is pooled to its mean, not raised to its
    first (one slow size then makes every wider one look free)."""
    from constrain.models import cost

    handle = _random_model(smol_tokenizer, seed=3)
    now, taken = [0.0], {n: iter(times) for n, times in passes.items()}
    original = handle.model.forward

    def timed(*args, **kwargs):
        if "position_ids" in kwargs:  # a timed pass (the context's comes first, untimed)
            now[0] += next(taken[kwargs["input_ids"].shape[1]])
        return original(*args, **kwargs)

    monkeypatch.setattr(handle.model, "forward", timed)
    monkeypatch.setattr(cost, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    measured = measure_forward_cost(handle.model, tokens=(1, 4, 16, 64, 256), repeats=2)
    assert measured.tokens == expected[0]
    assert measured.seconds == pytest.approx(expected[1])


def test_non_decreasing_pools_adjacent_violators():
    assert non_decreasing([1.0, 3.0, 2.0, 1.0, 5.0]) == pytest.approx([1.0, 2.0, 2.0, 2.0, 5.0])
    assert non_decreasing([2.0, 1.0, 3.0, 2.0]) == pytest.approx([1.5, 1.5, 2.5, 2.5])
    assert non_decreasing([1.0, 2.0, 2.0]) == [1.0, 2.0, 2.0] and non_decreasing([]) == []


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"seed": 4}, {"seed": 9, "top_p": 0.8, "logprobs": 1}])
def test_default_speculation_changes_no_token(tiny, sampling):
    """Speculation is on by default (measured cost, n-gram drafts) and yields plain decoding's tokens;
    so it does where drafts are free and all are fed (a run of two letters repeats, so prompt lookup
    drafts it: greedy decoding then takes fewer passes, and the request has evidence of acceptance)."""
    specs = [constrain.Request("Letters:", regex=r"[ab]{40}", sampling=sampling),
             constrain.Request("JSON:", schema=SCHEMA, max_tokens=50, sampling=sampling),
             constrain.Request("Free text:", max_tokens=12, sampling=sampling)]  # fmt: skip
    plain, plain_passes = _decode(tiny, specs, False)
    default = [(r.token_ids, r.text) for r in generate(tiny, specs)]
    given = [(r.token_ids, r.text) for r in generate(tiny, specs, forward_cost=FREE)]
    free, free_passes = _decode(tiny, specs, True)
    assert default == plain == given == free
    if sampling.get("temperature") == 0:
        assert free_passes < plain_passes, (free_passes, plain_passes)
    letters = admit(tiny, specs[0])
    run(tiny, letters, forward_cost=FREE)
    assert letters[0].acceptance.trials > 0


class _Scripted:
    """Proposes ``script``'s tokens that follow the output so far (then nothing): drafts that run on past
    the end of the request."""

    acceptance_prior = 1.0

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def propose(self, prompt_ids, output_ids, k, matcher):
        n = len(output_ids)
        return self.script[n : n + k] if self.script[:n] == list(output_ids) else []


@pytest.mark.parametrize("constraint", [{"choices": ["yes", "no"]}, {"regex": r"(ab)+"}, {"schema": SCHEMA}, {}])
def test_no_draft_is_fed_past_the_end_of_a_request(tiny, smol_tokenizer, constraint):
    """A draft that runs past an EOS (prompt lookup copies a chat template's end of turn): the drafts stop
    short of it, so no mask is asked of a terminated grammar, and the tokens are plain decoding's."""
    eos = tiny.eos_token_ids[0]
    spec = constrain.Request("Answer:", max_tokens=40, sampling={"temperature": 0}, **constraint)
    plain = generate(tiny, [spec], speculative=False)[0]
    text = plain.text if constraint else "ab"
    script = [*smol_tokenizer.encode(text, add_special_tokens=False), eos, *smol_tokenizer.encode(" more")]
    drafted = generate(tiny, [spec], speculative=_Scripted(script), forward_cost=FREE)[0]
    assert drafted.token_ids == plain.token_ids
    assert (drafted.text, drafted.finish_reason) == (plain.text, plain.finish_reason)


class _Wrong:
    """Proposes ``k`` tokens that follow the plain output's next one wrongly (its id + 1): drafts every row rejects."""

    acceptance_prior = 1.0

    def __init__(self, plain: list[int]) -> None:
        self.plain = plain

    def propose(self, prompt_ids, output_ids, k, matcher):
        n = len(output_ids)
        return [self.plain[n] + 1] * k if n < len(self.plain) else []


def test_drafts_every_row_rejected_leave_no_hole_in_the_cache(tiny):
    """The cache's last positions that no row attends to (drafts rejected in every row) are dropped after the
    pass: no later pass reads them, and the tokens are plain decoding's."""
    spec = constrain.Request("Free text:", max_tokens=12, n=2, sampling={"temperature": 0})
    plain = generate(tiny, [spec], speculative=False)[0]  # the request's two completions
    original, masks = tiny.model.forward, []

    def recorded(*args, **kwargs):
        masks.append((kwargs["attention_mask"], kwargs["input_ids"].shape[1]))
        return original(*args, **kwargs)

    tiny.model.forward = recorded
    try:
        drafted = generate(tiny, [spec], speculative=_Wrong(plain[0].token_ids), forward_cost=FREE)[0]
    finally:
        del tiny.model.forward
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert any(width > 1 for _, width in masks[1:])  # drafts were fed
    for mask, width in masks[1:]:
        assert bool(mask[:, :-width].any(0).all()), mask  # every cached position is attended by some row
