"""Beam search under a constraint: the most likely complete, valid outputs of one prompt.

``generate(model, prompt, schema=..., num_beams=W)`` builds a :class:`BeamSearch` (every argument
checked up front) and runs it: the prompt is prefilled once; each step runs one forward pass for the
live beams (the KV cache reordered to follow them, a beam's rows duplicated where it has several
children), fills each beam's bitmask from its own :class:`~constrain.match.matcher.Matcher` (its parent's,
forked, plus the token it took), and expands every beam by every allowed token with
:func:`constrain.sampler.beam_search_step`.

Definitions
-----------
- A beam's ``logprob`` is the sum of its tokens' log-probabilities, each the model's log-softmax
  renormalised over the tokens the mask allows at that step (a token the grammar forces costs 0).
- A hypothesis *finishes* with EOS (allowed only where the grammar can end; its log-probability is
  that of ending, the logsumexp over the model's EOS ids), or with a token after which the grammar is
  complete and admits nothing more. Its *length* is that of its text as the tokenizer writes it (at
  most its own tokens; EOS excluded): every tokenization of a text has the same length, otherwise
  length normalisation would rank ``b`` + ``lue`` (the grammar forcing ``lue``, at no cost) above
  ``blue``, as it did on SmolLM2.
- Its score is ``logprob / max(length, 1) ** length_penalty``: ``0`` ranks by likelihood (which
  favours short outputs), ``1`` (the default) by the mean log-probability per token, more than
  1 favours long outputs.
- Finished hypotheses are distinct texts: of several tokenizations of one text, the best-scored one is
  kept (so ``W`` beams are ``W`` different outputs).
- At most ``max_tokens`` tokens are generated, the EOS included (as in :func:`constrain.generate`);
  a beam that has ``max_tokens`` tokens and has not finished is dropped (it is not complete).

One step (``W = num_beams``)
----------------------------
1. Every live beam's end (EOS) is offered to the finished hypotheses, which keep the ``W`` best.
2. The expansions (beam, token) are walked best first (:func:`~constrain.sampler.beam_search_step`'s ``2W``
   best, more when those run out): each token its beam's matcher accepts makes a child, which either
   finishes at once (complete, nothing more allowed) or lives on; the walk stops at ``W`` children.
   A child that finishes takes one of the ``W`` places as the live beam it stands for would (its only
   next token, EOS, has log-probability 0), which keeps the walk to about ``W`` matcher probes.
3. The search stops when no live beam can beat the ``W``-th finished score, by an exact bound on a
   live beam's final score (its logprob can only fall, its length is in ``[1, max_tokens]``):
   ``logprob / max_tokens ** length_penalty`` for ``length_penalty > 0``, ``logprob`` otherwise; or
   at ``max_tokens``.

So when ``W`` is at least the number of prefixes of any one length (token sequences the constraint
accepts, EOS excluded; a complete ``yes`` counts, as EOS must follow), no expansion is ever cut and
the result is exactly the ``W`` best outputs the constraint allows (``tests/constrain/test_beams.py``
checks it against brute-force enumeration). Below that it is a heuristic, as every beam search.

Decisions
---------
- Every finished beam is complete and valid: a beam whose value checks reach a dead end (no allowed
  token can make a valid value, see :class:`~constrain.match.matcher.Matcher`) dies there, and each finished
  beam is validated like any result (one that fails, which a lenient schema allows, is dropped).
- ``n <= num_beams`` results: the ``n`` best finished beams, best first, each with ``beams`` (the up
  to ``W`` best finished, best first). Fewer when fewer finished; when none did, one result: the best
  unfinished beam, ``finish_reason="length"``, validated afterwards (``violations`` says why it is
  not valid), with ``beams == []``.
- Sampling does not apply (the ranking is the model's log-probabilities): ``temperature`` 0 (vLLM
  required it with beam search) or 1 and every other sampling parameter at its default are accepted,
  anything else raises :class:`BeamSearchError` naming it. So do stop strings and regexes (constrain
  the output's end with the grammar instead), ``reasoning``, tools that may be called (their
  repeated-call filter is a per-request state) and streaming.
- The termination budget and the repetition guard do not apply: beams that cannot finish within
  ``max_tokens`` are dropped instead.
- A search runs alone (one forward pass per step for its beams, in no batch with other requests); the
  server runs searches on a worker thread, one at a time.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from constrain.compiler.compiler import CompiledConstraint
from constrain.decode.detokenizer import IncrementalDetokenizer
from constrain.decode.request import check_output
from constrain.errors import BeamSearchError
from constrain.match.bitmask import allocate_token_bitmask
from constrain.match.matcher import Matcher, fill_next_token_bitmasks
from constrain.models import cost
from constrain.models.loading import ModelHandle
from constrain.results import Beam, GenerationResult, Usage
from constrain.sampler import SamplingParams, beam_search_step

__all__ = ["BeamSearch", "check_beam_options", "check_sampling"]


def check_beam_options(num_beams: object, length_penalty: object) -> None:
    """Raise :class:`BeamSearchError` unless ``num_beams`` is an int >= 1 and ``length_penalty`` a
    finite number."""
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise BeamSearchError("num_beams", f"must be an integer >= 1, got {num_beams!r}")
    if (
        not isinstance(length_penalty, (int, float))
        or isinstance(length_penalty, bool)
        or not math.isfinite(length_penalty)
    ):
        raise BeamSearchError("length_penalty", f"must be a finite number, got {length_penalty!r}")


def check_sampling(sampling: dict[str, Any]) -> None:
    """Raise :class:`BeamSearchError` for a sampling parameter that would change a sample but cannot
    change a beam search: anything but ``temperature`` 0 or 1 and defaults (see the module)."""
    params = SamplingParams(**sampling)  # InvalidSamplingParamsError for a bad value, as without beams
    defaults = SamplingParams()
    for name in sampling:
        if name == "temperature" and params.temperature in (0.0, 1.0):
            continue
        if getattr(params, name) != getattr(defaults, name):
            raise BeamSearchError(
                name, "beam search ranks by the model's log-probabilities and samples nothing: leave it out"
            )


@dataclass
class _Beam:
    tokens: list[int]
    logprob: float
    matcher: Matcher | None  # its grammar state (None: unconstrained)


_Finished = tuple[float, float, list[int], str]
"""A finished hypothesis: (score, logprob, tokens, text)."""


class BeamSearch:
    """One request's beam search, checked and ready to :meth:`run` (see the module).

    Parameters
    ----------
    handle : the model
    prompt_ids : list of int
        The prompt's tokens (a chat template already applied).
    compiled : CompiledConstraint or None
        The constraint (None: free text, ended by EOS).
    num_beams : int
        The beam width ``W`` (>= 1).
    length_penalty : float, default: 1.0
        Scores are ``logprob / max(length, 1) ** length_penalty`` (see :meth:`length`).
    max_tokens : int, default: 256
        Most tokens generated, EOS included (at most the context window's room after the prompt).
    n : int, default: 1
        Results: the ``n`` best beams (``n <= num_beams``).

    Raises :class:`BeamSearchError` for a bad argument, before any forward pass.
    """

    def __init__(
        self,
        handle: ModelHandle,
        prompt_ids: list[int],
        compiled: CompiledConstraint | None,
        *,
        num_beams: int,
        length_penalty: float = 1.0,
        max_tokens: int = 256,
        n: int = 1,
    ) -> None:
        check_beam_options(num_beams, length_penalty)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= num_beams:
            raise BeamSearchError("n", f"beam search returns at most num_beams={num_beams} beams, got n={n!r}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BeamSearchError("max_tokens", f"must be a positive integer, got {max_tokens!r}")
        if compiled is not None and getattr(compiled.constraint, "mask_filter", None) is not None:
            raise BeamSearchError("num_beams", "beam search does not take tools that may be called")
        self.handle = handle
        self.prompt_ids = list(prompt_ids)
        self.compiled = compiled
        self.num_beams = num_beams
        self.length_penalty = float(length_penalty)
        self.max_tokens = max_tokens
        self.n = n
        self._eos = list(handle.eos_token_ids)

    def score(self, logprob: float, length: int) -> float:
        """The rank of a finished hypothesis of ``length`` tokens (see :meth:`length`)."""
        return logprob / math.pow(max(length, 1), self.length_penalty)

    def length(self, text: str, tokens: list[int]) -> int:
        """A finished hypothesis' length: its text's tokens as the tokenizer writes it, at most its own
        (EOS excluded). Any tokenization of a text has the same length, so that normalising by length
        cannot favour spelling a word in pieces the grammar then forces (``b`` + ``lue`` over ``blue``)."""
        return min(len(self.handle.tokenizer.encode(text, add_special_tokens=False)), len(tokens))

    def bound(self, logprob: float) -> float:
        """An upper bound on the score a live beam of ``logprob`` can still finish with: its logprob can
        only fall, and its final length is in ``[1, max_tokens]``."""
        if self.length_penalty > 0:
            return logprob / math.pow(self.max_tokens, self.length_penalty)
        return logprob  # (length ** penalty <= 1)

    def _offer(self, finished: list[_Finished], logprob: float, tokens: list[int]) -> None:
        """Keep the hypothesis if it is among the ``W`` best finished texts (``finished`` sorted, best
        first; of two tokenizations of one text, the better-scored stays)."""
        full = len(finished) == self.num_beams
        if full and self.score(logprob, len(tokens) if self.length_penalty > 0 else 1) <= finished[-1][0]:
            return  # it cannot rank, whatever its text's length (at most its tokens): no decoding
        text = self._text(tokens)
        score = self.score(logprob, self.length(text, tokens))
        if full and score <= finished[-1][0]:
            return
        same = [i for i, f in enumerate(finished) if f[3] == text]
        if same and finished[same[0]][0] >= score:
            return
        if same:
            del finished[same[0]]
        finished.append((score, logprob, tokens, text))
        finished.sort(key=lambda f: -f[0])
        del finished[self.num_beams :]

    def run(self) -> list[GenerationResult]:
        """Search, then the results (see the module): up to ``n``, best first."""
        model, width = self.handle.model, self.num_beams
        device = next(model.parameters()).device
        keyword = cost.cache_keyword(model)
        # the prompt's logits are needed at its last position only
        last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        length = len(self.prompt_ids)
        finished: list[_Finished] = []  # (score, logprob, tokens, text), best first
        live = [_Beam([], 0.0, self.compiled.matcher() if self.compiled is not None else None)]
        with torch.inference_mode():
            ids = torch.tensor([self.prompt_ids], device=device)  # [1, T]
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(length,
                        device=device)[None], use_cache=True, **{keyword: None}, **last_only)  # fmt: skip
            cache, logits = getattr(out, keyword), out.logits[:, -1]  # logits: [1, V]
            for depth in range(self.max_tokens):
                children, parents = self._step(live, logits, finished)
                if not children:
                    break
                live = children
                best = max(self.bound(b.logprob) for b in live)
                if depth + 1 == self.max_tokens or (len(finished) == width and best <= finished[-1][0]):
                    break  # at the length limit, or no live beam can beat the W-th finished one
                cache.batch_select_indices(torch.tensor(parents, device=device))  # duplicates: a beam's children
                w, cached = len(live), length + depth  # beams; tokens in the cache (the prompt, then depth)
                out = model(input_ids=torch.tensor([[b.tokens[-1]] for b in live], device=device),  # [w, 1]
                            attention_mask=torch.ones(w, cached + 1, dtype=torch.long, device=device),
                            position_ids=torch.full((w, 1), cached, device=device),
                            use_cache=True, **{keyword: cache})  # fmt: skip
                cache, logits = getattr(out, keyword), out.logits[:, -1]  # logits: [w, V]
        return self._results(finished, live)

    def _step(
        self,
        live: list[_Beam],
        # [w, V] float: each live beam's next-token logits
        logits: torch.Tensor,
        finished: list[_Finished],
    ) -> tuple[list[_Beam], list[int]]:
        """Offer the beams' ends to ``finished`` (updated in place), then walk the expansions best first;
        returns the live children (best first) and the index of each one's parent in ``live``."""
        w, vocab = logits.shape
        bitmask = None
        if self.compiled is not None:
            matchers = [b.matcher for b in live if b.matcher is not None]  # (all of them)
            bitmask = allocate_token_bitmask(w, vocab)  # [w, ceil(V / 32)] int32
            dead_ends = fill_next_token_bitmasks(matchers, bitmask)
            for row, dead in enumerate(dead_ends):
                if dead:
                    bitmask[row].zero_()  # no allowed token can make a valid value: the beam dies here
            bitmask = bitmask.to(logits.device)
        scores = torch.tensor([[b.logprob for b in live]], device=logits.device)  # [1, w]
        k = min(2 * self.num_beams, w * vocab)
        step = beam_search_step(logits[None], scores, k, token_bitmask=bitmask)
        candidates = step.candidates[0]  # [w, V]
        for beam, end in zip(live, candidates[:, self._eos].logsumexp(-1).tolist(), strict=True):  # [w]
            if end > -math.inf:
                self._offer(finished, end, beam.tokens)
        eos = set(self._eos)
        children: list[_Beam] = []
        parents: list[int] = []
        taken, seen = 0, set()
        ranked = zip(step.scores[0].tolist(), step.beam_indices[0].tolist(), step.token_ids[0].tolist(), strict=True)
        while True:
            for logprob, parent, token in ranked:
                if logprob == -math.inf:
                    return children, parents
                if token in eos or (parent, token) in seen:  # ends were offered above
                    continue
                seen.add((parent, token))
                matcher = live[parent].matcher
                if matcher is not None:
                    matcher = matcher.fork()
                    if not matcher.accept_token(token):
                        continue
                child = _Beam([*live[parent].tokens, token], logprob, matcher)
                if matcher is not None and matcher.is_completed() and not matcher.can_continue():
                    self._offer(finished, logprob, child.tokens)
                else:
                    children.append(child)
                    parents.append(parent)
                taken += 1
                if taken == self.num_beams:
                    return children, parents
            walked, k = k, min(2 * k, w * vocab)
            if walked == k:
                return children, parents
            top, flat = candidates.reshape(-1).topk(k)  # [k]: more of the same ranking
            ranked = zip(top[walked:].tolist(), (flat[walked:] // vocab).tolist(), (flat[walked:] % vocab).tolist(),
                         strict=True)  # fmt: skip

    def _results(self, finished: list[_Finished], live: list[_Beam]) -> list[GenerationResult]:
        usage = len(self.prompt_ids)
        beams: list[Beam] = []
        for score, logprob, tokens, text in finished:
            violations, value = check_output(self.compiled, text)
            if not violations:  # (only a lenient schema's approximation lets an invalid one finish)
                beams.append(Beam(text, value, tokens, logprob, score))
        if beams:
            return [
                GenerationResult(b.text, b.value, "stop", b.token_ids, Usage(usage, len(b.token_ids)), beams=beams)
                for b in beams[: self.n]
            ]
        best = max(live, key=lambda b: self.score(b.logprob, len(b.tokens)))
        text = self._text(best.tokens)
        violations, value = check_output(self.compiled, text)
        return [GenerationResult(text, value, "length", best.tokens, Usage(usage, len(best.tokens)), violations,
                                 beams=[])]  # fmt: skip

    def _text(self, tokens: list[int]) -> str:
        """The text of ``tokens`` as :func:`constrain.generate` writes it (the prompt's last tokens as context)."""
        detok = IncrementalDetokenizer(self.handle.tokenizer, context_ids=self.prompt_ids)
        detok.add_many(tokens)
        detok.finish()
        return detok.text
