"""The grammar engines behind one protocol: xgrammar and llguidance, and the tokenizer facts they need."""

from constrain.backends.base import Backend, CompiledGrammar, GrammarState
from constrain.backends.llguidance import LlguidanceBackend, LlguidanceGrammar
from constrain.backends.tokenizer import TokenizerInfo, tokenizer_info
from constrain.backends.xgrammar import XGrammarBackend, XGrammarGrammar

__all__ = [
    "Backend",
    "CompiledGrammar",
    "GrammarState",
    "LlguidanceBackend",
    "LlguidanceGrammar",
    "TokenizerInfo",
    "XGrammarBackend",
    "XGrammarGrammar",
    "tokenizer_info",
]
