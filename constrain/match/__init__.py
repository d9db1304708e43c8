"""Per-request grammar state: the matcher, its bitmasks, key and value checks, the closing path, validation."""

from constrain.match.bitmask import allocate_token_bitmask, allowed_ids
from constrain.match.budget import Budget
from constrain.match.closing import completion
from constrain.match.matcher import Compiled, Matcher, fill_next_token_bitmasks
from constrain.match.repetition import RepetitionGuard
from constrain.match.validate import parse_json, schema_violations, validate

__all__ = [
    "Budget",
    "Compiled",
    "Matcher",
    "RepetitionGuard",
    "allocate_token_bitmask",
    "allowed_ids",
    "completion",
    "fill_next_token_bitmasks",
    "parse_json",
    "schema_violations",
    "validate",
]
