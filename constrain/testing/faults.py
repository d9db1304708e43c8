"""Fault injection, for isolation tests and chaos drills: make one admitted request fail inside a stage
of the decode step, through that stage's real code path.

Off unless called: nothing in the library calls :func:`inject`; a server runs it only when given a
``faults`` hook (:func:`constrain.serving.server.create_app`), never from a request on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch

from constrain.decode.request import InFlight
from constrain.match.matcher import Matcher

__all__ = ["STAGES", "InjectedFault", "Stage", "by_user", "inject"]

Stage = Literal["mask", "sample", "check", "advance", "detokenize"]
STAGES: tuple[Stage, ...] = ("mask", "sample", "check", "advance", "detokenize")


class InjectedFault(RuntimeError):
    """The exception an injected fault raises."""


class _FailingFilter:
    """A mask filter whose every application raises (the mask stage of one row)."""

    def feed(self, text: str) -> None:
        pass

    def apply(self, matcher: Matcher, text: str, row: torch.Tensor) -> bool:
        raise InjectedFault("injected fault while masking")


def _raise(stage: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise InjectedFault(f"injected fault while {stage}")

    return fail


def inject(request: InFlight, stage: Stage, vocab_size: int) -> None:
    """Make ``request`` (admitted, not yet running) raise in ``stage`` of its next step. Mutates it:

    - ``"mask"``: its mask filter raises (a constrained request only, else ``ValueError``);
    - ``"sample"``: its ``logit_bias`` names token ``vocab_size`` (the sampler's batch metadata raises
      ``ValueError``, as it would for any row's bad parameters);
    - ``"check"``: its matcher's check of a drawn token raises (a constraint with value checks, sampled
      greedily or without filters: else no drawn token is checked, and nothing fails);
    - ``"advance"``: its matcher refuses to take any token by raising (constrained only);
    - ``"detokenize"``: its detokenizer raises.
    """
    if stage in ("mask", "check", "advance") and request.matcher is None:
        raise ValueError(f"a {stage!r} fault needs a constrained request (one with a matcher)")
    if stage == "mask":
        request.mask_filter = _FailingFilter()
    elif stage == "sample":
        request.params = dataclasses.replace(request.params, logit_bias={vocab_size: 1.0})
    elif stage == "check":
        assert request.matcher is not None
        request.matcher.allows = _raise("checking values")  # type: ignore[method-assign]
    elif stage == "advance":
        assert request.matcher is not None
        request.matcher.accept_token = _raise("advancing")  # type: ignore[method-assign]
    elif stage == "detokenize":
        request.detok.add = _raise("detokenizing")  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")


def by_user(vocab_size: int) -> Callable[[Any, list[InFlight]], None]:
    """A server's ``faults`` hook (:func:`constrain.serving.server.create_app`): a request whose ``user``
    field is ``"fault:<stage>"`` gets that fault (:func:`inject`) in its first choice; others are untouched."""

    def hook(body: Any, requests: list[InFlight]) -> None:
        user = getattr(body, "user", None) or ""
        if user.startswith("fault:"):
            inject(requests[0], user.removeprefix("fault:"), vocab_size)  # type: ignore[arg-type]

    return hook
