"""Decoding: in-flight requests, the decode loop, drafts, KV reuse, stopping, detokenizing, reasoning, beams."""

from constrain.decode.beams import BeamSearch
from constrain.decode.detokenizer import IncrementalDetokenizer
from constrain.decode.feed import Feed
from constrain.decode.kv import PrefixCache
from constrain.decode.loop import DecodeLoop, run
from constrain.decode.partial import PartialJson, resolve
from constrain.decode.reasoning import Reasoning, Thinking
from constrain.decode.request import InFlight, MaskFilter
from constrain.decode.speculative import DraftModelProposer, NgramProposer, Proposer
from constrain.decode.stopping import StopText, StopUpdate

__all__ = [
    "BeamSearch",
    "DecodeLoop",
    "DraftModelProposer",
    "Feed",
    "InFlight",
    "IncrementalDetokenizer",
    "MaskFilter",
    "NgramProposer",
    "PartialJson",
    "PrefixCache",
    "Proposer",
    "Reasoning",
    "StopText",
    "StopUpdate",
    "Thinking",
    "resolve",
    "run",
]
