"""``sampler``: the logits -> token pipeline (torch only; grammars reach it as a bitmask)."""

from sampler.beam_search import BeamSearchStep, beam_search_step
from sampler.errors import InvalidSamplingParamsError, SamplerError
from sampler.metadata import SamplingMetadata
from sampler.ops.bitmask import apply_token_bitmask_inplace
from sampler.params import SamplingParams
from sampler.rejection_sampler import RejectionSamplerOutput, rejection_sample
from sampler.sampler import LogprobsOutput, Sampler, SamplerOutput, sample

__all__ = [
    "BeamSearchStep",
    "InvalidSamplingParamsError",
    "LogprobsOutput",
    "RejectionSamplerOutput",
    "Sampler",
    "SamplerError",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "apply_token_bitmask_inplace",
    "beam_search_step",
    "rejection_sample",
    "sample",
]
