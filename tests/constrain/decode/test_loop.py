"""The decode loop as a running batch: requests join between steps and leave when done or cancelled."""

from __future__ import annotations

import pytest
import torch

import constrain
from constrain.decode.kv import MIN_PREFIX, longest_prefix, prefill_groups
from constrain.decode.loop import DecodeLoop
from constrain.generation import admit

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items":
          {"type": "string", "maxLength": 8}, "maxItems": 3}}, "required": ["n", "tags"]}  # fmt: skip
SPECS = [
    constrain.Request("JSON:", schema=SCHEMA, max_tokens=40, sampling={"seed": 1}),
    constrain.Request("A longer prompt, with more tokens in it than the others:", max_tokens=25,
                      sampling={"temperature": 0}),
    constrain.Request("Code:", regex=r"[a-z]{3}-\d{4}", sampling={"seed": 4, "top_p": 0.9}),
    constrain.Request("Story:", max_tokens=30, sampling={"seed": 9, "repetition_penalty": 1.2}),
]  # fmt: skip


@pytest.fixture(scope="module")
def sharp(smol_tokenizer):
    """A random 2-layer Llama with large weights, so that attention is peaked: a key out of place
    changes the output (with the usual small init, attention is near uniform and would not notice)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                         eos_token_id=2)  # fmt: skip
    return constrain.load_model((LlamaForCausalLM(config), smol_tokenizer))


def _outputs(requests):
    return [(r.output_ids, r.text, r.finish_reason) for r in requests]


def _staggered(handle, specs, joins_at, cancel=None):
    """Run ``specs[k]`` joining at step ``joins_at[k]``; ``cancel``: (request index, step)."""
    loop = DecodeLoop(handle)
    requests = [admit(handle, spec)[0] for spec in specs]
    step = 0
    while loop.busy or step <= max(joins_at):
        loop.add([r for r, at in zip(requests, joins_at, strict=True) if at == step])
        if cancel is not None and cancel[1] == step:
            loop.cancel(requests[cancel[0]])
        loop.step()
        step += 1
    return requests


def test_requests_joining_a_running_batch_get_the_tokens_they_get_alone(sharp):
    alone = [_outputs(_staggered(sharp, [spec], [0]))[0] for spec in SPECS]
    together = _outputs(_staggered(sharp, SPECS, [0, 0, 0, 0]))
    staggered = _outputs(_staggered(sharp, SPECS, [0, 3, 3, 11]))  # the longest prompt joins a shorter cache
    assert together == alone and staggered == alone
    assert all(ids for ids, _, _ in alone)


def test_a_cancelled_request_leaves_and_the_others_go_on(sharp):
    alone = [_outputs(_staggered(sharp, [spec], [0]))[0] for spec in SPECS]
    requests = _staggered(sharp, SPECS, [0, 0, 2, 2], cancel=(1, 4))
    out = _outputs(requests)
    assert out[1][2] == "cancelled" and 0 < len(out[1][0]) < len(alone[1][0])
    assert out[1][0] == alone[1][0][: len(out[1][0])]
    assert [out[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert requests[1].result().finish_reason == "cancelled"
    waiting = _staggered(sharp, SPECS[:2], [0, 5], cancel=(1, 5))  # cancelled before it ever ran
    assert waiting[1].output_ids == [] and waiting[1].finish_reason == "cancelled"


def test_sliding_window_caches_make_joiners_wait_for_the_batch_to_drain(smol_tokenizer):
    """Gemma 3's sliding-window layers keep a cache that rows cannot be merged into: a joiner waits,
    and still gets its own tokens."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              eos_token_id=2, pad_token_id=0)  # fmt: skip
    handle = constrain.load_model((Gemma3ForCausalLM(config), smol_tokenizer))
    alone = [_outputs(_staggered(handle, [spec], [0]))[0] for spec in SPECS[:2]]
    loop = DecodeLoop(handle)
    first, second = (admit(handle, spec)[0] for spec in SPECS[:2])
    loop.add([first])
    loop.step()
    loop.add([second])
    loop.step()
    assert loop.active == [first] and loop.joining == [second]
    while loop.busy:
        loop.step()
    assert _outputs([first, second]) == alone
    # prompts of different lengths added together: one group is prefilled, the other waits (a second
    # group merged into the first's cache raised in the attention)
    prompts = [constrain.Request("Maria Lopez is 42 and lives in Madrid.", max_tokens=5, sampling={"temperature": 0}),
               constrain.Request("JSON:", max_tokens=5, sampling={"temperature": 0})]  # fmt: skip
    together = constrain.generate(handle, prompts, speculative=False, jump_forward=False)
    assert [r.token_ids for r in together] == [constrain.generate(handle, [p])[0].token_ids for p in prompts]


@pytest.mark.parametrize("jump_forward", [True, False])
def test_loop_timings_cover_every_stage(sharp, jump_forward):
    timings: dict[str, float] = {}
    loop = DecodeLoop(sharp, timings, jump_forward=jump_forward)
    loop.add(admit(sharp, SPECS[0]))
    while loop.busy:
        loop.step()
    assert set(timings) == {"forward", "mask", "sampler", "stop+detokenize"}


def test_prefill_groups_bound_the_padding(sharp):
    requests = sorted((admit(sharp, constrain.Request("x " * n))[0] for n in (1, 3, 30, 34, 200)),
                      key=lambda r: len(r.prompt_ids))  # fmt: skip
    groups = [[len(r.prompt_ids) for r in g] for g in prefill_groups(requests)]
    assert [len(g) for g in groups] == [2, 2, 1]
    assert [n for g in groups for n in g] == sorted(len(r.prompt_ids) for r in requests)
    assert all(max(g) <= 1.25 * min(g) + 8 for g in groups)


def test_prompts_sharing_a_prefix_are_prefilled_from_the_cache(sharp):
    """A request whose prompt starts like one prefilled before gets only its new tokens prefilled, and
    the very tokens it gets without the prefix cache."""
    preamble = "You are a careful assistant. Answer briefly, in lower case, and never repeat yourself. "
    specs = [constrain.Request(preamble + task, max_tokens=12, sampling={"seed": k})
             for k, task in enumerate(["Name a colour.", "Name a fruit.", "Name a city in Spain."])]  # fmt: skip
    alone = [_outputs(_staggered(sharp, [spec], [0]))[0] for spec in specs]
    fed: list[int] = []
    original = sharp.model.forward

    def counted(*args, **kwargs):
        fed.append(kwargs["input_ids"].shape[1] if kwargs["input_ids"].shape[0] == 1 else 0)
        return original(*args, **kwargs)

    sharp.model.forward = counted
    try:
        loop = DecodeLoop(sharp)
        requests = [admit(sharp, spec)[0] for spec in specs]
        loop.add(requests[:1])
        loop.step()
        loop.add(requests[1:])  # join a running batch: prefilled after the shared preamble
        while loop.busy:
            loop.step()
    finally:
        del sharp.model.forward
    assert _outputs(requests) == alone
    prompt = len(requests[1].prompt_ids)
    shared = loop.prefixes.match(requests[1].prompt_ids)
    assert shared >= 16 and prompt - shared in fed  # only the tokens after the preamble were fed
    assert max(fed[1:]) < prompt


def test_prefix_match_is_the_longest_common_prefix():
    """The bisection of PrefixCache.match (longest_prefix) against a token-by-token reference, on random prompts."""
    import random

    def reference(keys, prompt):
        best = 0
        for key in keys:
            n = next((i for i, (a, b) in enumerate(zip(key, prompt[:-1], strict=False)) if a != b),
                     min(len(key), len(prompt) - 1))  # fmt: skip
            best = max(best, n)
        return best if best >= MIN_PREFIX else 0

    rng = random.Random(0)
    for _ in range(2000):
        base = [rng.randrange(2) for _ in range(rng.randrange(1, 60))]
        keys = [tuple(base[: rng.randrange(len(base) + 1)] + [rng.randrange(2) for _ in range(rng.randrange(20))])
                for _ in range(3)]  # fmt: skip
        prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(2) for _ in range(rng.randrange(20))]
        assert longest_prefix(keys, prompt) == reference(keys, prompt), (keys, prompt)
