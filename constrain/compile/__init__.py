"""Compiling a constraint for a tokenizer: cached and shared, routed to an engine; it makes matchers."""

from constrain.compile.cache import ByteLRU
from constrain.compile.compiler import CACHE_MAX_BYTES, CompiledConstraint, cache_stats, clear_cache, compile
from constrain.compile.json_schema import json_schema_ebnf
from constrain.compile.routing import AUTO_LIMITS, ENGINES, AutoLimits, auto_engine

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
