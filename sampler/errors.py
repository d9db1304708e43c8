"""The exception hierarchy of ``sampler``."""

from __future__ import annotations

__all__ = ["InvalidSamplingParamsError", "SamplerError"]


class SamplerError(Exception):
    """Base class of every error ``sampler`` raises on purpose."""


class InvalidSamplingParamsError(SamplerError, ValueError):
    """A sampling parameter is out of range, NaN or of the wrong type.

    The message names the field and the offending value. It derives from
    ``ValueError`` so that callers catching ``ValueError`` keep working.
    """

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"SamplingParams.{field}={value!r} is invalid: expected {expected}")
