"""``sampler``: the logits -> token pipeline (torch only; grammars reach it as a bitmask)."""

from .batch import SamplingBatch, SamplingRequest
from .beam_search import BeamSearchStep, beam_search_step
from .errors import InvalidSamplingParamsError, SamplerError
from .metadata import SamplingMetadata
from .ops.bitmask import apply_token_bitmask_inplace
from .params import SamplingParams
from .rejection_sampler import RejectionSamplerOutput, rejection_sample
from .sampler import LogprobsOutput, Sampler, SamplerOutput, sample

__all__ = [
    "BeamSearchStep",
    "InvalidSamplingParamsError",
    "LogprobsOutput",
    "RejectionSamplerOutput",
    "Sampler",
    "SamplerError",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingMetadata",
    "SamplingParams",
    "SamplingRequest",
    "apply_token_bitmask_inplace",
    "beam_search_step",
    "rejection_sample",
    "sample",
]
