"""``constrain``: structured generation with language models.

The constraint compiler, matchers and the generation loop land here next (see
the issues); today the package re-exports the sampler it builds on.
"""

from sampler import SamplingParams, sample

__all__ = ["SamplingParams", "sample"]
