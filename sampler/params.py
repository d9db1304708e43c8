"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .errors import InvalidSamplingParamsError

__all__ = ["MAX_LOGPROBS", "MAX_SEED", "SamplingParams"]

MAX_LOGPROBS = 20
"""The largest ``logprobs`` (top-N) a request may ask for."""

MAX_SEED = 2**63 - 1
"""Seeds are integers in ``[0, MAX_SEED]``."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_float(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """Return ``value`` as a float or raise naming ``name``; rejects NaN and bools."""
    lo_bracket = "(" if lo_open else "["
    expected = f"a number in {lo_bracket}{lo}, {hi}]"
    if not _is_number(value) or math.isnan(value):  # type: ignore[arg-type]
        raise InvalidSamplingParamsError(name, value, expected)
    v = float(value)  # type: ignore[arg-type]
    if v > hi or v < lo or (lo_open and v == lo):
        raise InvalidSamplingParamsError(name, value, expected)
    return v


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidSamplingParamsError(name, value, f"an integer in [{lo}, {hi}]")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns logits into a token.

    Every field is validated in ``__post_init__``; a bad value raises
    :class:`~constrain.sampler.errors.InvalidSamplingParamsError` (a ``ValueError``) naming
    the field and the value. Instances are immutable and hashable.

    Parameters
    ----------
    temperature : float, default: 1.0
        Divides the logits; ``0`` means greedy (argmax after bitmask, bias and
        penalties; top-k/top-p/min-p are then ignored). Range ``[0, 100]``.
    top_k : int | None, default: None
        Keep every token whose logit is >= the k-th largest (ties at the k-th
        value are all kept). ``None`` keeps all; ``k >= vocab`` keeps all.
    top_p : float, default: 1.0
        Nucleus: after top-k, keep the smallest set of the most probable tokens
        whose renormalised mass reaches ``top_p``, the crossing token included
        (ties with it too). Range ``(0, 1]``; ``1`` disables.
    min_p : float, default: 0.0
        Keep tokens whose probability is >= ``min_p`` x the largest. Range ``[0, 1]``.
    repetition_penalty : float, default: 1.0
        For every token of the prompt or the output so far, a positive logit is
        divided by it and a negative one multiplied. Range ``(0, 10]``; ``1`` disables.
    frequency_penalty : float, default: 0.0
        Subtracted once per occurrence of the token in the output. Range ``[-2, 2]``.
    presence_penalty : float, default: 0.0
        Subtracted once if the token occurs in the output. Range ``[-2, 2]``.
    logit_bias : dict[int, float], default: {}
        Added to the logits of the given token ids; each bias in ``[-100, 100]``.
        Token ids are checked against the vocabulary when the batch is built.
    seed : int | None, default: None
        A request with a seed draws its randomness from a counter-based
        generator keyed by ``(seed, output length)``: it yields the same tokens
        alone or at any row of any batch.
    logprobs : int | None, default: None
        ``None``: no logprobs. ``0``: the sampled token's logprob only.
        ``N`` in ``[1, 20]``: also the top-N.
    logprobs_mode : {"processed", "raw"}, default: "processed"
        ``"processed"``: from the final sampling distribution (after bitmask,
        bias, penalties, temperature and filtering; greedy rows report the
        distribution after bitmask, bias and penalties). ``"raw"``: the log-softmax
        of the model's logits exactly as given to the sampler.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    seed: int | None = None
    logprobs: int | None = None
    logprobs_mode: Literal["processed", "raw"] = "processed"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise ints given for floats
        set_(self, "temperature", _check_float("temperature", self.temperature, 0.0, 100.0))
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1, 2**31 - 1)
        set_(self, "top_p", _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        set_(self, "min_p", _check_float("min_p", self.min_p, 0.0, 1.0))
        set_(
            self,
            "repetition_penalty",
            _check_float("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True),
        )
        set_(self, "frequency_penalty", _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        set_(self, "presence_penalty", _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0))
        if not isinstance(self.logit_bias, dict):
            raise InvalidSamplingParamsError("logit_bias", self.logit_bias, "a dict {token_id: bias}")
        bias: dict[int, float] = {}
        for token_id, value in self.logit_bias.items():
            _check_int(f"logit_bias[{token_id!r}] (token id)", token_id, 0, 2**31 - 1)
            bias[token_id] = _check_float(f"logit_bias[{token_id}]", value, -100.0, 100.0)
        set_(self, "logit_bias", bias)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.logprobs_mode not in ("processed", "raw"):
            raise InvalidSamplingParamsError("logprobs_mode", self.logprobs_mode, '"processed" or "raw"')

    def __hash__(self) -> int:
        return hash(
            (
                self.temperature,
                self.top_k,
                self.top_p,
                self.min_p,
                self.repetition_penalty,
                self.frequency_penalty,
                self.presence_penalty,
                tuple(sorted(self.logit_bias.items())),
                self.seed,
                self.logprobs,
                self.logprobs_mode,
            )
        )

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``: the token is the argmax."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
