"""Draft proposers for speculative decoding: where the grammar forces nothing, a proposer guesses the
next tokens, and the loop verifies them in the same forward pass as the real next token.

Verification (in :class:`constrain.decode.loop.DecodeLoop`) runs the sampler at every draft position exactly as
plain decoding would and keeps a draft only while the sampled token equals it. Proposers here are
deterministic (a lookup, or a greedy draft model), so that rule accepts a draft with the probability
rejection sampling would (``p(draft)``) and the output keeps plain decoding's distribution; for a
seeded request, its very tokens.

A proposer sees the request's prompt ids, output ids and a fork of its grammar state; it may drop
drafts the grammar rejects (the loop prunes them anyway).

Drafts are fed where they pay (:func:`plan_drafts`): each request keeps the share of its drafts
accepted so far (:class:`Acceptance`), and the loop weighs the tokens a pass of drafts is expected
to yield against what the wider pass costs (:class:`constrain.models.cost.ForwardCost`). Rows a caller waits
for together count only the share of their drafts that shortens the slowest of them (:func:`shortening`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from constrain import caches
from constrain.match.bitmask import allocate_token_bitmask
from constrain.match.matcher import Matcher
from constrain.models.cost import cache_keyword
from constrain.models.loading import ModelHandle, model_handle
from constrain.sampler.ops.bitmask import apply_token_bitmask_inplace

__all__ = [
    "ACCEPTANCE_PRIOR",
    "CONFIDENT",
    "DRAFT_PROMPTS_CACHED",
    "MATCH_EXTENT",
    "MAX_BACKOFF",
    "NGRAM_PRIORS",
    "PROBE_STEPS",
    "Acceptance",
    "DraftModelProposer",
    "Drafts",
    "NgramProposer",
    "Proposer",
    "expected_tokens",
    "ngram_match",
    "ngram_proposal",
    "plan_drafts",
    "probe_width",
    "shortening",
]

ACCEPTANCE_PRIOR = 0.5
"""Share of drafts expected to be accepted before any evidence (the built-in proposers' default where a
proposal carries no prior of its own: :class:`Drafts`)."""

NGRAM_PRIORS = {
    "output": ((1, 0.2, 0.54), (2, 0.43, 0.71), (3, 0.57, 0.77), (4, 0.73, 0.79), (5, 0.89, 0.81)),
    "prompt": ((1, 0.19, 0.79), (2, 0.76, 0.83), (5, 0.9, 0.87)),
}
""":class:`NgramProposer`'s prior by where the history's suffix was found earlier (its drafts continue the
prompt or the output) and how long it matches there: ``(at least this many tokens, prior, run)``, the last
that applies (:class:`Drafts`). Measured with SmolLM2-135M on 24 prompts none of the benchmarks use
(summaries, rewrites, extractions, code, SQL, YAML, poems, explanations), greedy and sampled at temperature
0.7, 96 tokens each: 1,807 proposals. The first draft was right 19-20% of the time after a 1-token match
wherever found, 43% / 57% / 73% after 2 / 3 / 4 tokens matched in the output, 69-80% after 2 to 4 matched
in the prompt (pooled: 76%), and 89-90% after 5 or more. Once the first is right, a copy of the prompt
goes on longer: 4.9 to 7.5 drafts kept on average after a prompt match, 2.2 to 5.4 after an output match
(``run`` = 1 - 1 / that mean, the chance of a geometric run)."""

MATCH_EXTENT = 8
"""How far back :func:`ngram_match` measures the match it found, for its prior (past the ``n_max``
tokens it searched with)."""

PROBE_STEPS = 2
"""A request feeds a probe's drafts at most (one, or as many as a pass costs no more for: :func:`probe_width`)
until this many of its passes fed drafts: a wider draft is fed only on evidence, so a proposer that guesses
badly costs at most a one-draft pass."""

CONFIDENT = 0.75
"""A proposal whose own prior reaches this is fed as wide as pays without probing first. When its drafts are
refused, a probe saves what the wide pass costs beyond it; when they are kept, it costs a pass more for
the rest. On a 2-core AVX2 CPU (a plain pass: 1) that is 0.3 against 1.5 at batch 1, and up to 1.8 against
1.3 at batch 8 (17 tokens a row against 2): probing pays only below a chance of about 0.2 and 0.6 that the
first draft is right."""

MAX_BACKOFF = 16
"""Steps a request waits before drafting again after consecutive passes whose drafts were all rejected:
1, 2, 4, ... up to this."""


class Drafts(list[int]):
    """A proposer's drafts, with its estimate that the first is accepted (``prior``; None: the proposer's
    ``acceptance_prior``), and that each next one is once the one before it was (``run``; None: the same
    as the first). :func:`plan_drafts` weighs ``prior`` with the request's evidence (:meth:`Acceptance.estimate`)."""

    prior: float | None = None
    run: float | None = None

    def __init__(self, ids: Sequence[int] = (), prior: float | None = None, run: float | None = None) -> None:
        super().__init__(ids)
        self.prior = prior
        self.run = run


DRAFT_PROMPTS_CACHED = 64
"""Prompts whose draft KV cache a :class:`DraftModelProposer` keeps by default."""


class Proposer(Protocol):
    """Drafts up to ``k`` next tokens of one request (an empty list: no draft this step).

    ``acceptance_prior`` is the share of its drafts expected to be accepted before a request has
    shown any (see :class:`Acceptance`).
    """

    acceptance_prior: float

    def propose(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, matcher: Matcher | None
    ) -> list[int]:
        """``matcher`` is the request's grammar state after ``output_ids`` (a fork: the proposer may
        advance it), or None for an unconstrained request. Must not mutate the id sequences."""
        ...


NGRAM_MAX = 3
"""Prompt lookup: the longest suffix of the history (in tokens) searched for an earlier occurrence."""


def ngram_match(history: Sequence[int], n_max: int = NGRAM_MAX) -> tuple[int, int] | None:
    """Where the latest earlier occurrence of the history's last ``n`` tokens (``n`` from ``n_max`` down to 1)
    is followed: ``(the index its continuation starts at, how many tokens match there)``, the match measured
    back past ``n`` up to :data:`MATCH_EXTENT` tokens; None where no suffix occurred before. Pure."""
    end = len(history)
    for n in range(min(n_max, end - 1), 0, -1):
        tail = history[-n:]
        for start in range(end - n - 1, -1, -1):
            if history[start + n - 1] == tail[-1] and history[start : start + n] == tail:
                length = n
                while (
                    length < MATCH_EXTENT
                    and start - (length - n) > 0
                    and (history[start - (length - n) - 1] == history[end - length - 1])
                ):
                    length += 1
                return start + n, length
    return None


def ngram_proposal(history: Sequence[int], k: int, n_max: int = NGRAM_MAX, *, prompt: int = 0) -> Drafts:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the history's last tokens
    (:func:`ngram_match`): prompt-lookup drafting, which pays off when the output copies the prompt
    (extraction). The drafts' prior is :data:`NGRAM_PRIORS`'s for where they were found (within the history's
    first ``prompt`` tokens, or after) and the length of the match. Pure."""
    history = list(history)
    match = ngram_match(history, n_max)
    if match is None:
        return Drafts()
    at, length = match
    _, prior, run = [row for row in NGRAM_PRIORS["prompt" if at < prompt else "output"] if length >= row[0]][-1]
    return Drafts(history[at : at + k], prior, run)


class NgramProposer:
    """Prompt lookup (:func:`ngram_proposal`) over the prompt and the output so far. Stateless.

    Parameters
    ----------
    n_max : int, default: :data:`NGRAM_MAX`
    acceptance_prior : float, default: :data:`ACCEPTANCE_PRIOR`
        Used only for a proposal without a prior of its own (every proposal here has one: :data:`NGRAM_PRIORS`).
    """

    def __init__(self, n_max: int = NGRAM_MAX, *, acceptance_prior: float = ACCEPTANCE_PRIOR) -> None:
        if n_max < 1:
            raise ValueError(f"n_max must be at least 1, got {n_max}")
        _check_share("acceptance_prior", acceptance_prior)
        self.n_max = n_max
        self.acceptance_prior = acceptance_prior

    def propose(self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, matcher: Matcher | None) -> Drafts:
        return ngram_proposal([*prompt_ids, *output_ids], k, self.n_max, prompt=len(prompt_ids))


class DraftModelProposer:
    """Greedy drafts from a small model that shares the target's vocabulary, masked by the grammar at
    every draft step (so every draft is one the grammar accepts).

    Keeps a KV cache per prompt (at most ``max_cached`` prompts, least recently used dropped) and
    crops it to the longest prefix still valid, so each step feeds the draft model only the tokens
    it has not seen. The draft model runs where its parameters live. The caches of every live proposer
    are reported together as ``"decode.speculative.draft_kv"`` by :func:`constrain.cache_stats`.

    Parameters
    ----------
    model : ModelHandle, or anything :func:`constrain.load_model` takes
    k : int, default: 4
        Most drafts per step (the loop's own cap, ``MAX_DRAFT``, applies as well).
    max_cached : int, default: :data:`DRAFT_PROMPTS_CACHED`
        Prompts whose draft KV cache is kept.
    acceptance_prior : float, default: :data:`ACCEPTANCE_PRIOR`
    """

    def __init__(
        self,
        model: ModelHandle | Any,
        *,
        k: int = 4,
        max_cached: int = DRAFT_PROMPTS_CACHED,
        acceptance_prior: float = ACCEPTANCE_PRIOR,
    ) -> None:
        if k < 1 or max_cached < 1:
            raise ValueError(f"k and max_cached must be at least 1, got {k} and {max_cached}")
        _check_share("acceptance_prior", acceptance_prior)
        self.acceptance_prior = acceptance_prior
        self.handle = model_handle(model)
        self.k = k
        self.max_cached = max_cached
        self._caches: OrderedDict[tuple[int, ...], tuple[list[int], Any]] = OrderedDict()
        self._checked: set[int] = set()  # ids of the target tokenizers found compatible
        self.hits = 0  # proposals that found their prompt's draft KV kept
        self.misses = 0
        with _live_lock:
            _live.add(self)

    def cached(self, prompt: Sequence[int]) -> tuple[list[int], Any] | None:
        """The draft model's KV cache kept for ``prompt``: (the ids it holds, the cache), or None."""
        return self._caches.get(tuple(prompt))

    @property
    def cached_prompts(self) -> list[tuple[int, ...]]:
        """The prompts whose KV cache is kept, least recently used first."""
        return list(self._caches)

    def check_vocabulary(self, target: ModelHandle) -> None:
        """Raise ``ValueError`` unless the draft model tokenizes like ``target`` (same vocabulary)."""
        if id(target.tokenizer) in self._checked:
            return
        if self.handle.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(
                f"the draft model {self.handle.name!r} has another vocabulary than {target.name!r}: "
                "a draft model must share the target's tokenizer"
            )
        self._checked.add(id(target.tokenizer))

    def propose(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, matcher: Matcher | None
    ) -> list[int]:
        from transformers import DynamicCache

        model = self.handle.model
        device = next(model.parameters()).device
        ids = [*prompt_ids, *output_ids]
        key = tuple(prompt_ids)
        seen, cache = self._caches.pop(key, ([], None))
        common = 0
        for a, b in zip(seen, ids[:-1], strict=False):  # the last id is fed again: its logits are needed
            if a != b:
                break
            common += 1
        if cache is None:
            self.misses += 1
        else:
            self.hits += 1
        if cache is None or common == 0:
            cache, common = DynamicCache(), 0
        elif cache.get_seq_length() > common:
            cache.crop(common - cache.get_seq_length())  # a negative count: the tokens to remove
        feed, drafts, keyword = ids[common:], [], cache_keyword(model)
        with torch.inference_mode():
            for _ in range(min(k, self.k)):
                out = model(input_ids=torch.tensor([feed], device=device), use_cache=True, **{keyword: cache})
                logits = out.logits[:, -1].float()  # [1, V_draft]
                if matcher is not None:
                    logits = logits[:, : matcher.compiled.vocab_size]  # [1, V]: padding ids are never drafted
                    bitmask = allocate_token_bitmask(1, logits.shape[-1])  # [1, ceil(V / 32)]
                    matcher.fill_next_token_bitmask(bitmask)
                    apply_token_bitmask_inplace(logits, bitmask.to(device))
                token = int(logits.argmax())
                if token in self.handle.eos_token_ids or (matcher is not None and not matcher.accept_token(token)):
                    break
                drafts.append(token)
                feed = [token]
        self._caches[key] = ([*ids, *drafts][: cache.get_seq_length()], cache)
        while len(self._caches) > self.max_cached:
            self._caches.popitem(last=False)
        return drafts


_live: weakref.WeakSet[DraftModelProposer] = weakref.WeakSet()
"""Every :class:`DraftModelProposer` alive: their KV caches are reported together."""
_live_lock = threading.Lock()


def _draft_kv_figures() -> dict[str, int]:
    """The live draft proposers' KV caches together: prompts kept (``entries``), their bytes (keys and
    values of every layer), hits and misses, and the sum of their ``max_cached`` (``maxsize``; the
    default's while none lives)."""
    with _live_lock:
        live = list(_live)
    kept = [cache for proposer in live for _, cache in list(proposer._caches.values())]
    held = sum(
        tensor.nelement() * tensor.element_size()
        for cache in kept
        for layer in getattr(cache, "layers", ())
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(tensor, torch.Tensor)
    )
    return {
        "instances": len(live), "entries": len(kept), "bytes": held,
        "maxsize": sum(p.max_cached for p in live) if live else DRAFT_PROMPTS_CACHED,
        "hits": sum(p.hits for p in live), "misses": sum(p.misses for p in live),
    }  # fmt: skip


caches.register("decode.speculative.draft_kv", _draft_kv_figures)


def _check_share(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {value}")


@dataclass
class Acceptance:
    """How often one request's proposer drafts were accepted so far, for :func:`plan_drafts`.

    Drafts are verified in order and the first rejection ends a pass, so a pass that fed ``d`` drafts
    and kept ``k`` tested its first draft (kept when ``k > 0``) and, past it, ``k - 1`` more acceptances and,
    when ``0 < k < d``, one rejection (the drafts after it were never tested). The two are kept apart, as a
    proposal states them (:class:`Drafts`): the first draft's chance (:meth:`estimate`: ``accepted`` of
    ``trials``) is a guess's, and the next ones' (:meth:`estimate_run`: ``run_accepted`` of ``run_trials``)
    is whether a guess that held goes on, near 1 where the output copies the prompt however rare a right
    first guess is. Each is the share of acceptances among its trials, ``prior_weight`` trials at a prior
    included. Every step shrinks the evidence by ``decay``: the rates follow the text (a name copied from
    the prompt, then free text), and a request whose drafts stopped being fed drifts back to the priors
    and is tried again.

    Two rules bound what drafts cost before they have shown they pay (:meth:`limit`): until
    :data:`PROBE_STEPS` passes fed drafts, a request feeds at most a probe's (one, or as many as cost no
    more: :func:`probe_width`; unless the proposal is :data:`CONFIDENT`); and after a pass whose drafts
    were all rejected it waits 1, 2, 4, ... steps (up to :data:`MAX_BACKOFF`) before drafting again, the
    wait reset by a pass that keeps a draft.

    Parameters
    ----------
    prior : float, default: :data:`ACCEPTANCE_PRIOR`
        Both rates before any evidence, in [0, 1], where a proposal gives no prior of its own.
    prior_weight : float, default: 2.0
        Trials a prior counts for (> 0).
    decay : float, default: 0.9
        Weight of the evidence after one more step, in [0, 1] (0.9: about the last 10 steps count).
    accepted, trials : float, default: 0.0
        The first drafts' evidence so far (decayed counts); :meth:`observe` updates them.
    run_accepted, run_trials : float, default: 0.0
        The evidence so far on the drafts after a kept one; :meth:`observe` updates them.
    probed, misses, wait, kept : int, default: 0
        Passes that fed drafts; passes in a row whose drafts were all rejected; steps left before
        drafting again; drafts kept in all. :meth:`observe` updates them.
    """

    prior: float = ACCEPTANCE_PRIOR
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = 0.0
    trials: float = 0.0
    run_accepted: float = 0.0
    run_trials: float = 0.0
    probed: int = 0
    misses: int = 0
    wait: int = 0
    kept: int = 0

    def __post_init__(self) -> None:
        _check_share("prior", self.prior)
        _check_share("decay", self.decay)
        evidence = 0 <= self.accepted <= self.trials and 0 <= self.run_accepted <= self.run_trials
        if self.prior_weight <= 0 or not evidence:
            raise ValueError(
                f"prior_weight must be positive, 0 <= accepted <= trials and 0 <= run_accepted <= run_trials, got "
                f"{self.prior_weight}, {self.accepted}, {self.trials}, {self.run_accepted} and {self.run_trials}"
            )

    @property
    def rate(self) -> float:
        """The estimated chance that the next proposal's first draft is accepted, in [0, 1]."""
        return self.estimate(None)

    def estimate(self, prior: float | None) -> float:
        """:attr:`rate` with ``prior`` (a proposal's own: :class:`Drafts`) in place of :attr:`prior` where given."""
        prior = self.prior if prior is None else prior
        return (self.accepted + self.prior_weight * prior) / (self.trials + self.prior_weight)

    def estimate_run(self, run: float | None, prior: float | None = None) -> float:
        """The estimated chance that a draft is accepted once the one before it was, in [0, 1]: the evidence
        weighed with ``run`` (a proposal's own: :class:`Drafts`), else with ``prior``, else with :attr:`prior`."""
        run = run if run is not None else self.prior if prior is None else prior
        return (self.run_accepted + self.prior_weight * run) / (self.run_trials + self.prior_weight)

    def limit(self, prior: float | None = None, probe: int = 1) -> int | None:
        """The most proposer drafts the next pass may feed: 0 while backing off, ``probe`` while probing
        (unless the proposal's own ``prior`` is at least :data:`CONFIDENT`: a long match, or one in the prompt, is
        evidence), else None (as many as pay)."""
        if self.wait:
            return 0
        return probe if self.probed < PROBE_STEPS and (prior is None or prior < CONFIDENT) else None

    def observe(self, fed: int, accepted: int) -> None:
        """Record one step in which the request fed ``fed`` proposer drafts (0: none, which only decays
        the evidence) and kept the first ``accepted`` of them. Mutates this object."""
        if not 0 <= accepted <= fed:
            raise ValueError(f"need 0 <= accepted <= fed, got {accepted} of {fed}")
        followed = max(accepted - 1, 0)  # the drafts kept after a kept one; one more tested where a draft was refused
        self.accepted = self.decay * self.accepted + (accepted > 0)
        self.trials = self.decay * self.trials + (fed > 0)
        self.run_accepted = self.decay * self.run_accepted + followed
        self.run_trials = self.decay * self.run_trials + followed + (0 < accepted < fed)
        self.kept += accepted
        if fed:
            self.probed += 1
            self.misses = 0 if accepted else self.misses + 1
            self.wait = min(2 ** (self.misses - 1), MAX_BACKOFF) if self.misses else 0
        elif self.wait:
            self.wait -= 1


def expected_tokens(drafts: int, rate: float, run: float | None = None) -> float:
    """Tokens a row is expected to gain from a pass that feeds ``drafts`` drafts, the first accepted with
    chance ``rate`` and each next one with chance ``run`` once the one before it was (None: ``rate``):
    ``1 + rate * (1 + run + ... + run**(drafts - 1))`` (the sampled token always counts)."""
    run = rate if run is None else run
    if drafts == 0:
        return 1.0
    return 1.0 + rate * (float(drafts) if run >= 1.0 else (1.0 - run**drafts) / (1.0 - run))


def probe_width(cost: Callable[[int], float], widest: int) -> int | None:
    """The drafts a probing row may feed (:meth:`Acceptance.limit`): as many as a pass costs no more for
    than for one draft, up to ``widest`` (at least 1); None where a pass ``1 + widest`` tokens wide costs no
    more than a plain one (drafts are free: nothing to bound). ``cost(width)``: a pass's cost against width 1,
    as :func:`plan_drafts` takes it. Where a matrix product costs the same for 2 to 12 rows (an AVX2 CPU,
    past a cheaper matrix-vector product for one), a one-draft probe would cost as much as a wide one and
    would pay only for proposals sure of their first token. Pure."""
    if cost(1 + widest) <= 1.0:
        return None
    one = cost(2)
    return max(w for w in range(1, widest + 1) if w == 1 or cost(1 + w) <= one)


def plan_drafts(
    forced: Sequence[int],
    offered: Sequence[int],
    rates: Sequence[float],
    cost: Callable[[int], float],
    runs: Sequence[float | None] | None = None,
    weights: Sequence[float] | None = None,
) -> list[int]:
    """How many of its offered proposer drafts each row of a batch feeds in the next forward pass.

    A row feeds its last token and its drafts, and rows are padded to the widest, so the pass costs
    ``cost(width)`` times a plain decoding pass whatever each row feeds below that width. The
    forced tokens of jump-forward (``forced[i]``, offered nothing) are always fed and count as
    accepted. For each width from the one they need up to the widest offer, every row feeds as many
    of its drafts as fit (a draft within the width adds no padded position), and the pass is expected
    to yield ``sum(forced) + sum(expected_tokens(fed[i], rates[i], runs[i]))`` tokens; the width with the most
    expected tokens per unit of cost wins, the narrowest on a tie. So drafts are fed only where they
    beat plain decoding, and one row's drafts may widen the pass only if the whole batch gains.
    What a draft position costs beyond the width (its logits, sampler and mask) is left out. A row's
    drafts count for ``weights[i]`` of the tokens they are expected to add: the share that shortens what
    its caller waits for (:func:`shortening`). Pure.

    Parameters
    ----------
    forced : per row, the forced tokens it feeds
    offered : per row, the proposer drafts on offer (0 where tokens are forced)
    rates : per row, the chance its first draft is accepted (:meth:`Acceptance.estimate`)
    cost : the relative cost of a pass by its width in tokens per row, 1.0 at width 1 (for example
        ``functools.partial(ForwardCost.relative, forward_cost, batch)``); called only when there is a
        choice to make
    runs : per row, the chance each next draft is accepted once the one before it was (``Drafts.run``);
        default: None (each row's rate)
    weights : per row, in [0, 1]; default: None (1 for every row: every kept draft counts)
    """
    chains = [None] * len(rates) if runs is None else runs
    shares = [1.0] * len(rates) if weights is None else weights
    if not len(forced) == len(offered) == len(rates) == len(chains) == len(shares):
        raise ValueError(
            f"one entry per row: got {len(forced)}, {len(offered)}, {len(rates)}, {len(chains)} and {len(shares)}"
        )
    need = 1 + max(forced, default=0)
    widest = 1 + max(offered, default=0)
    if widest <= need:  # every draft fits in the width the forced tokens need
        return list(offered)

    def gain(width: int) -> float:
        rows = zip(offered, rates, chains, shares, strict=True)
        drafted = sum(1.0 + w * (expected_tokens(min(d, width - 1), a, r) - 1.0) for d, a, r, w in rows)
        return (sum(forced) + drafted) / cost(width)

    width = max(range(need, widest + 1), key=gain)
    return [min(d, width - 1) for d in offered]


def shortening(kept: Sequence[int], moving: int) -> float:
    """The share of their drafts' expected tokens that shortens a group of rows its caller waits for together
    (one ``generate`` call's), from each running row's drafts kept so far and how many of them this pass
    feeds more than one token (``moving``: offered drafts or fed forced ones):
    ``(min(kept) + 1) / (mean(kept) + 1) * moving / len(kept)``.

    The group ends when its slowest row does. Where every row runs to its budget, a row left at one token
    this pass while others take drafts stays the slowest whatever they keep (the ``moving`` share); and over
    the passes so far, the group has gained ``min(kept)`` passes where :func:`plan_drafts` counted
    ``mean(kept)`` tokens a row (the first factor: near 1 where the rows keep their drafts alike, one kept
    draft a row the prior). Pure."""
    if not kept or not 0 <= moving <= len(kept):
        raise ValueError(
            f"shortening needs at least one row and 0 <= moving <= rows, got {len(kept)} rows and {moving}"
        )
    return (min(kept) + 1.0) / (sum(kept) / len(kept) + 1.0) * moving / len(kept)
