"""Compiling a constraint for a tokenizer: cached and shared, routed to an engine; it makes matchers."""

from constrain.compiler.cache import ByteLRU
from constrain.compiler.compiler import CACHE_MAX_BYTES, CompiledConstraint, cache_stats, clear_cache, compile
from constrain.compiler.json_schema import json_schema_ebnf
from constrain.compiler.routing import AUTO_LIMITS, ENGINES, AutoLimits, auto_engine

__all__ = [
    "AUTO_LIMITS",
    "CACHE_MAX_BYTES",
    "ENGINES",
    "AutoLimits",
    "ByteLRU",
    "CompiledConstraint",
    "auto_engine",
    "cache_stats",
    "clear_cache",
    "compile",
    "json_schema_ebnf",
]
