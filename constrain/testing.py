"""Helpers for tests and benchmarks: feeding text through a matcher as MaskBench does, and a local
server on a free loopback port.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from constrain.compiler import CompiledConstraint
from constrain.compiler import compile as compile_constraint
from constrain.constraints import json_schema
from constrain.errors import ConstraintError
from constrain.matcher import Matcher, allocate_token_bitmask

__all__ = [
    "PERSON_SCHEMA",
    "TERMINATION_WORKLOADS",
    "WEATHER_TOOL",
    "ConformanceCounts",
    "LocalServer",
    "accepts",
    "allowed_ids",
    "run_conformance",
    "token_ids",
    "walk",
]


TERMINATION_WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "unbounded array": (
        "Describe a person named John Doe as JSON with a name and tags.",
        {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
         "items": {"type": "string"}}}, "required": ["name", "tags"], "additionalProperties": False},
    ),
    "deep nesting": (
        "Give a company with departments, each with teams of people, as JSON.",
        {"type": "object", "properties": {"company": {"type": "object", "properties": {"departments": {"type": "array",
         "items": {"type": "object", "properties": {"name": {"type": "string"}, "teams": {"type": "array", "items": {
         "type": "object", "properties": {"lead": {"type": "string"}, "members": {"type": "array", "items": {
         "type": "string"}}}, "required": ["lead", "members"], "additionalProperties": False}}},
         "required": ["name", "teams"], "additionalProperties": False}}}, "required": ["departments"],
         "additionalProperties": False}}, "required": ["company"], "additionalProperties": False},
    ),
    "long strings": (
        "Write a detailed biography of Ada Lovelace as JSON with a summary and a long biography.",
        {"type": "object", "properties": {"summary": {"type": "string"}, "biography": {"type": "string"}},
         "required": ["summary", "biography"], "additionalProperties": False},
    ),
    "recursive tree": (
        "Give the file tree of a Python project as JSON: each node has a name and children.",
        {"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array",
         "items": {"$ref": "#/$defs/node"}}}, "required": ["name", "children"], "additionalProperties": False}},
         "$ref": "#/$defs/node"},
    ),
}  # fmt: skip
"""Chat prompt and schema of each workload that makes small models run on (no bounds): the default
model must still end every one of them valid within ``max_tokens`` (tests and ``bench/termination.py``)."""


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids, without special tokens or a SentencePiece dummy-prefix token."""
    ids: list[int] = list(tokenizer.encode(text, add_special_tokens=False))
    first = tokenizer.convert_ids_to_tokens(ids[:1])
    if first and first[0].startswith("\u2581") and not text[:1].isspace():  # SentencePiece's dummy prefix
        rest = first[0][1:]
        ids = ids[1:] if not rest else [tokenizer.convert_tokens_to_ids(rest), *ids[1:]]
    if tokenizer.decode(ids) != text:
        raise ValueError(f"the tokenizer does not round-trip {text!r}")
    return ids


def walk(compiled: CompiledConstraint, ids: list[int]) -> tuple[bool, Matcher]:
    """Feed ``ids`` as MaskBench does: each token must be allowed by the mask and accepted."""
    matcher = compiled.matcher()
    bitmask = allocate_token_bitmask(1, compiled.vocab_size)
    for token in ids:
        matcher.fill_next_token_bitmask(bitmask)
        if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1 or not matcher.accept_token(token):
            return False, matcher
    return True, matcher


def accepts(compiled: CompiledConstraint, tokenizer: Any, text: str) -> bool:
    """The whole of ``text`` passes the masks and the grammar can end there."""
    ok, matcher = walk(compiled, token_ids(tokenizer, text))
    return ok and matcher.is_completed()


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    bits = [(int(bitmask_row[t // 32]) >> (t % 32)) & 1 for t in range(vocab_size)]
    return {t for t, b in enumerate(bits) if b}


@dataclass
class ConformanceCounts:
    """Outcome of running the JSON Schema Test Suite through compile + matcher (+ validate)."""

    schemas: int = 0
    refused: int = 0  # schemas refused at compile time (their instances are not counted below)
    valid_accepted: int = 0  # a valid instance passed every mask and the grammar could end
    valid_rejected: int = 0  # a valid instance the grammar blocked (incompleteness, not unsafety)
    invalid_rejected: int = 0  # an invalid instance the mask blocked
    invalid_flagged: int = 0  # an invalid instance the mask let through but validate() flagged
    invalid_unflagged: int = 0  # an invalid instance neither blocked nor flagged: must stay 0
    unflagged: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def run_conformance(suite_dir: Path, tokenizer: Any, *, files: list[str] | None = None) -> ConformanceCounts:
    """Run every test of ``suite_dir/*.json`` (the suite's layout) with both compact and default ``json.dumps``."""
    counts = ConformanceCounts()
    for path in sorted(suite_dir.glob("*.json")):
        if files is not None and path.name not in files:
            continue
        for group in json.loads(path.read_text()):
            counts.schemas += 1
            where = f"{path.name}: {group['description']}"
            try:
                compiled = compile_constraint(json_schema(group["schema"]), tokenizer)
            except ConstraintError as err:
                counts.refused += 1
                counts.refusals.append(f"{where}: {err}")
                continue
            for test in group["tests"]:
                for text in (json.dumps(test["data"], separators=(",", ":")), json.dumps(test["data"])):
                    ok = accepts(compiled, tokenizer, text)
                    if test["valid"]:
                        counts.valid_accepted += ok
                        counts.valid_rejected += not ok
                        if not ok:
                            counts.rejected.append(f"{where} / {test['description']}: {text}")
                    elif not ok:
                        counts.invalid_rejected += 1
                    elif compiled.validate(text):
                        counts.invalid_flagged += 1
                    else:
                        counts.invalid_unflagged += 1
                        counts.unflagged.append(f"{where} / {test['description']}: {text}")
    return counts


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
"""A small extraction schema (server tests and benchmarks)."""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
"""An OpenAI tool definition (server tests and benchmarks)."""


class LocalServer:
    """The OpenAI-compatible server on a free loopback port, run by uvicorn in a daemon thread.

    ``url`` is its address; :meth:`stop` ends it. ``options`` go to :func:`constrain.server.create_app`.
    """

    def __init__(self, handle: Any, **options: Any) -> None:
        import socket
        import threading
        import time

        import uvicorn

        from constrain.server import create_app

        self.app = create_app(handle, **options)
        self.model = handle.name
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()
