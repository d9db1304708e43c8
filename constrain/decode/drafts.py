"""Drafts: the tokens a request feeds after its last one, verified in the same forward pass.

Where the grammar forces text (``{"name": "``, a closing quote), that text is the draft
(jump-forward); elsewhere a :class:`~constrain.decode.speculative.Proposer` guesses (speculative
decoding). Either way the draft is pruned to what the grammar accepts and stops short of a token that
ends the request, and the :class:`~constrain.decode.loop.DecodeLoop` keeps a draft token only where
the sampler drew it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from constrain.decode.request import InFlight
from constrain.decode.speculative import DraftModelProposer, Drafts, NgramProposer, Proposer
from constrain.models.loading import ModelHandle

__all__ = ["MAX_DRAFT", "feedable", "next_drafts", "resolve_proposer"]

MAX_DRAFT = 16
"""At most this many drafts (forced or proposed) follow a request's last token in one forward pass."""


def next_drafts(
    r: InFlight,
    encode: Callable[[str], list[int]],
    proposer: Proposer | None,
    *,
    jump_forward: bool = True,
    probe: int | None = 1,
) -> tuple[Drafts, bool]:
    """Drafts for ``r``'s next forward pass, and whether they are forced: the grammar's forced text
    (with ``jump_forward``), else the ``proposer``'s guess (speculative decoding, with the proposal's
    prior where it gives one; unless ``probe`` is None, none while ``r`` backs off and as many as its
    :meth:`~constrain.decode.speculative.Acceptance.limit` allows, ``probe`` while it probes); pruned to
    what the grammar accepts, to no token that ends the request, and to the tokens ``r`` may still write
    (a proposal only to the last; :func:`feedable` prunes the part the loop plans to feed). Changes nothing
    of ``r`` (the grammar's checks run on forks of its matcher)."""
    room = min(MAX_DRAFT, r.max_tokens - r.answer_tokens - 1)
    if r.finish_reason is not None or room <= 0 or r.thinks:
        return Drafts(), False
    forced = r.matcher.forced_text() if r.matcher is not None and jump_forward else ""
    if forced:
        return Drafts(feedable(r, encode(forced)[:room])), True
    if proposer is None or (probe is not None and r.acceptance.limit() == 0):
        return Drafts(), False
    ids = proposer.propose(r.prompt_ids, r.output_ids, room, r.matcher.fork() if r.matcher is not None else None)
    prior, run = getattr(ids, "prior", None), getattr(ids, "run", None)
    cap = r.acceptance.limit(prior, probe) if probe is not None else None
    return Drafts(ids if cap is None else ids[:cap], prior, run), False


def feedable(r: InFlight, ids: Sequence[int]) -> list[int]:
    """The longest prefix of ``ids`` worth feeding after ``r``'s last token: each token accepted by the
    grammar, and none that ends the request (an EOS id, or a token that terminates the grammar, such as
    a tool grammar's end of turn), since nothing may follow it and its slot's mask would be asked of a
    terminated matcher."""
    probe = r.matcher.fork() if r.matcher is not None else None
    for count, token in enumerate(ids):
        if token in r.eos or (probe is not None and (not probe.accept_token(token) or probe.is_terminated())):
            return list(ids[:count])
    return list(ids)


def resolve_proposer(handle: ModelHandle, speculative: bool | Proposer) -> Proposer | None:
    """The draft proposer ``speculative`` names; ``ValueError`` for a draft model of another vocabulary."""
    if isinstance(speculative, bool):
        return NgramProposer() if speculative else None
    if isinstance(speculative, DraftModelProposer):
        speculative.check_vocabulary(handle)
    return speculative
