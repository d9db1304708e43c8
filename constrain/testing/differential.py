"""Helpers for tests and benchmarks: feeding text through a matcher as MaskBench does, and a local
server on a free loopback port.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from constrain.compile.compiler import CompiledConstraint
from constrain.compile.compiler import compile as compile_constraint
from constrain.constraints.constraint import SEPARATORS, JsonSchema, json_schema
from constrain.constraints.schema import resolve_local
from constrain.errors import ConstraintError
from constrain.match.matcher import Matcher, allocate_token_bitmask

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
                compiled = compile_constraint(json_schema(group["schema"], mode="specification"), tokenizer)
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

    ``url`` is its address; :meth:`stop` ends it. ``options`` go to :func:`constrain.serving.server.create_app`;
    ``RuntimeError`` when it has not started within ``start_timeout_s`` seconds (or its thread died).
    """

    def __init__(self, handle: Any, *, start_timeout_s: float = 60.0, **options: Any) -> None:
        import socket
        import threading
        import time

        import uvicorn

        from constrain.serving.server import create_app

        self.app = create_app(handle, **options)
        self.model = handle.name
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:  # (uvicorn offers no start-up event to wait on)
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._socket.close()
                raise RuntimeError(f"the server did not start within {start_timeout_s:g} s (see the log above)")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


# -- differential testing of the two engines (issue 13) ---------------------------------------------

DIFFERENTIAL_ENGINES = ("xgrammar", "llguidance")
"""The engines a differential run compares, in the order its counts name them."""

DIFFERENTIAL_MODES = ("generation", "specification")
"""The :func:`~constrain.constraints.constraint.json_schema` modes a differential run compiles each schema in."""


class _HypothesisDone(Exception):
    """Enough instances were drawn: ends a :func:`hypothesis_instances` run early (not a failure)."""


class _HypothesisOutOfTime(BaseException):
    """The time limit of :func:`hypothesis_instances` ran out (a BaseException, so no library code catches it)."""


class _ManyCompat:
    """hypothesis-jsonschema 0.23's ``elements.more()`` loop over today's ``many`` (a ``with ... for`` loop)."""

    def __init__(self, data: Any, **options: Any) -> None:
        from hypothesis.internal.conjecture import utils

        self._many = utils.many(data, **options)
        self._many.__enter__()
        self._steps = iter(self._many)

    def more(self) -> bool:
        if next(self._steps, self) is self:
            self._many.__exit__(None, None, None)
            return False
        return True

    def reject(self) -> None:
        self._many.reject()


class _ConjectureUtils:
    """``hypothesis.internal.conjecture.utils`` as hypothesis-jsonschema 0.23 expects it (its ``many``)."""

    many = _ManyCompat

    def __getattr__(self, name: str) -> Any:
        from hypothesis.internal.conjecture import utils

        return getattr(utils, name)


@contextlib.contextmanager
def _hypothesis_jsonschema_compat() -> Iterator[None]:
    """hypothesis-jsonschema 0.23.1 draws objects with ``cu.many(...).more()``, an API Hypothesis 6.1xx
    replaced by a ``with``/``for`` loop (every object schema fails with "'many' object has no attribute
    'more'"). Within this block its module sees an adapter; restored on exit, Hypothesis itself untouched."""
    from hypothesis_jsonschema import _from_schema

    saved = _from_schema.cu  # type: ignore[attr-defined]
    _from_schema.cu = _ConjectureUtils()  # type: ignore[attr-defined,assignment]
    try:
        yield
    finally:
        _from_schema.cu = saved  # type: ignore[attr-defined]


_UNRAISABLE = frozenset({"__del__", "gc_callback", "remove", "_remove"})  # weakref callbacks too
"""Functions an exception cannot leave (Python reports it as unraisable): the time limit waits them out."""


def hypothesis_instances(schema: Any, *, count: int = 3, seed: int = 0, time_limit_s: float = 1.0) -> list[Any]:
    """Up to ``count`` instances of ``schema`` drawn by hypothesis-jsonschema, seeded by ``seed``.

    Returns what was drawn within ``time_limit_s`` (the same for the same seed unless the limit cuts
    it short; the limit is a ``SIGALRM`` timer on the main thread, and a check between draws), and
    ``[]`` for a schema the library cannot handle (recursive ``$ref``, keywords it refuses...). The
    library reads drafts 4 to 7, so an instance may break a 2020-12 keyword (``prefixItems``):
    differential runs compare the engines on it all the same.
    """
    import signal
    import threading
    import time
    import warnings

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis_jsonschema import from_schema

    drawn: list[Any] = []
    if count <= 0:
        return drawn
    armed = True  # an alarm that fires once generation has ended is ignored

    def out_of_time(_: int, frame: Any) -> None:
        while frame is not None:  # raising in a finalizer or gc callback is "ignored": wait for the next alarm
            if frame.f_code.co_name in _UNRAISABLE:
                return
            frame = frame.f_back
        if armed:
            raise _HypothesisOutOfTime

    deadline = time.monotonic() + time_limit_s
    timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    previous = signal.signal(signal.SIGALRM, out_of_time) if timed else None
    if timed:  # fires again every 50 ms: Hypothesis swallows an exception raised in its gc callback
        signal.setitimer(signal.ITIMER_REAL, time_limit_s, 0.05)
    try:
        try:
            with warnings.catch_warnings(), _hypothesis_jsonschema_compat():
                warnings.simplefilter("ignore")

                @hypothesis_seed(seed)
                @settings(
                    max_examples=5 * count,
                    database=None,
                    deadline=None,
                    phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
                @given(from_schema(schema))
                def collect(value: Any) -> None:
                    drawn.append(value)
                    if len(drawn) >= count or time.monotonic() > deadline:
                        raise _HypothesisDone

                collect()
        finally:
            armed = False
    except (_HypothesisDone, _HypothesisOutOfTime):
        pass
    except Exception:  # the library's refusals and failures: no instances from it
        return []
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return drawn[:count]


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` names in ``root``, or None."""
    try:
        return resolve_local(root, ref)
    except LookupError:
        return None


def _alternatives(node: Any, root: Any) -> list[dict[str, Any]]:
    """``node`` and every subschema that applies at the same place: ``$ref`` targets and the branches of
    ``anyOf``, ``oneOf`` and ``allOf``, recursively, each once."""
    found: list[dict[str, Any]] = []
    seen: set[int] = set()
    pending = [node]
    while pending:
        current = pending.pop(0)
        if not isinstance(current, dict) or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        if isinstance(current.get("$ref"), str):
            pending.append(_resolve(root, current["$ref"]))
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(current.get(key), list):
                pending.extend(current[key])
    return found


def _member_schemas(candidates: list[dict[str, Any]], part: str | int, root: Any) -> list[dict[str, Any]]:
    """The subschemas that apply to member ``part`` (a key or an index) of a value ``candidates`` describe."""
    found: list[Any] = []
    for candidate in candidates:
        if isinstance(part, str):
            properties = candidate.get("properties")
            if isinstance(properties, dict) and part in properties:
                found.append(properties[part])
                continue
            patterns = candidate.get("patternProperties")
            for pattern, sub in patterns.items() if isinstance(patterns, dict) else ():
                try:
                    if re.search(pattern, part):
                        found.append(sub)
                except re.error:
                    continue
            if isinstance(candidate.get("additionalProperties"), dict):
                found.append(candidate["additionalProperties"])
        else:
            prefix = candidate.get("prefixItems")
            items = candidate.get("items")
            if isinstance(prefix, list) and part < len(prefix):
                found.append(prefix[part])
            elif isinstance(items, list) and part < len(items):  # draft 4 tuples
                found.append(items[part])
            elif isinstance(items, dict):
                found.append(items)
    return [alt for sub in found for alt in _alternatives(sub, root)]


def schema_ordered(data: Any, schema: Any) -> Any:
    """``data`` with each object's keys in the order ``schema`` declares them (generation's order).

    Per object, the subschema (through ``$ref``, ``anyOf``, ``oneOf``, ``allOf``) that declares most of
    its keys gives the order; keys it does not declare follow in their own order. Use the prepared
    schema (``compiled.engine_schema``): its order is the one both engines force.
    """

    def order(value: Any, candidates: list[dict[str, Any]]) -> Any:
        if isinstance(value, list):
            return [order(item, _member_schemas(candidates, i, schema)) for i, item in enumerate(value)]
        if not isinstance(value, dict):
            return value
        best: list[str] = []
        for candidate in candidates:
            declared = [k for k in candidate.get("properties") or () if k in value]
            if len(declared) > len(best):
                best = declared
        keys = best + [k for k in value if k not in best]
        return {k: order(value[k], _member_schemas(candidates, k, schema)) for k in keys}

    return order(data, _alternatives(schema, schema))


def _walk_values(
    value: Any, candidates: list[dict[str, Any]], root: Any, path: tuple[str | int, ...] = ()
) -> Iterator[tuple[tuple[str | int, ...], Any, list[dict[str, Any]]]]:
    """Every value inside ``value`` in document order: its path, itself, the subschemas that apply."""
    yield path, value, candidates
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk_values(item, _member_schemas(candidates, key, root), root, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _walk_values(item, _member_schemas(candidates, index, root), root, (*path, index))


def _replaced(value: Any, path: tuple[str | int, ...], new: Any) -> Any:
    """A copy of ``value`` with the value at ``path`` replaced by ``new``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: _replaced(v, rest, new) if k == head else v for k, v in value.items()}
    return [_replaced(v, rest, new) if i == head else v for i, v in enumerate(value)]


UNDECLARED_KEY = "zz_undeclared"
"""The key the ``undeclared key`` mutation adds (no MaskBench schema declares it)."""


def mutations(data: Any, schema: Any) -> list[tuple[str, Any]]:
    """Labelled variants of ``data`` that are likely invalid for ``schema`` (prepared; see
    :func:`schema_ordered`), each changing the first place in document order where it applies:

    - ``drop required key``: an object loses a key its schema requires;
    - ``undeclared key``: an object gains :data:`UNDECLARED_KEY` (valid where objects are open);
    - ``change type``: a scalar becomes a value of another type (a string ``12345``, anything else ``"x"``);
    - ``extra item``: an array gets a copy of its last item (``0`` if empty) appended.

    Text-level mutations (a key written twice, whitespace) are :func:`text_mutations`.
    """
    out: list[tuple[str, Any]] = []
    values = list(_walk_values(data, _alternatives(schema, schema), schema))
    for path, value, candidates in values:
        required = [
            k for c in candidates if isinstance(c.get("required"), list) for k in c["required"] if k in value
        ] if isinstance(value, dict) else []  # fmt: skip
        if required:
            out.append(
                ("drop required key", _replaced(data, path, {k: v for k, v in value.items() if k != required[0]}))
            )
            break
    for path, value, _ in values:
        if isinstance(value, dict) and UNDECLARED_KEY not in value:
            out.append(("undeclared key", _replaced(data, path, {**value, UNDECLARED_KEY: 1})))
            break
    for path, value, _ in values:
        if not isinstance(value, (dict, list)):
            out.append(("change type", _replaced(data, path, 12345 if isinstance(value, str) else "x")))
            break
    for path, value, _ in values:
        if isinstance(value, list):
            out.append(("extra item", _replaced(data, path, [*value, value[-1] if value else 0])))
            break
    return out


def _structure(text: str) -> Iterator[tuple[int, str, int]]:
    """The structural characters of JSON ``text`` outside strings: (index, character, containers open before it)."""
    depth = 0
    in_string = escaped = False
    for index, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[,:]}":
            if ch in "]}":
                depth -= 1
            yield index, ch, depth
            if ch in "{[":
                depth += 1


def text_mutations(text: str) -> list[tuple[str, str]]:
    """Labelled variants of the JSON ``text`` that no JSON mode admits, or that only some admit:

    - ``duplicate key``: the first member of the first non-empty object written twice (``{"a":1,"a":1,...}``);
    - ``whitespace: two spaces``: two spaces after the first ``:`` or ``,`` (no mode admits it);
    - ``whitespace: newline``: a newline after the first ``:`` or ``,`` (specification mode admits it);
    - ``whitespace: trailing newline``: a newline after the value.
    """
    out: list[tuple[str, str]] = []
    marks = list(_structure(text))
    for n, (index, ch, depth) in enumerate(marks):
        if ch == "{" and text[index + 1 :].lstrip()[:1] == '"':
            end = next((i for i, c, d in marks[n + 1 :] if c in ",}" and d == depth + 1), None)
            if end is not None:
                member = text[index + 1 : end]
                separator = ", " if ", " in text or ": " in text else ","
                out.append(("duplicate key", text[: index + 1] + member + separator + member.lstrip() + text[end:]))
            break
    first = next((i for i, c, _ in marks if c in ":,"), None)
    if first is not None:
        gap = 1 if text[first + 1 : first + 2] == " " else 0
        out.append(("whitespace: two spaces", text[: first + 1] + "  " + text[first + 1 + gap :]))
        out.append(("whitespace: newline", text[: first + 1] + "\n" + text[first + 1 + gap :]))
    out.append(("whitespace: trailing newline", text + "\n"))
    return out


def _json_context(text: str, offset: int) -> tuple[tuple[str | int, ...], str]:
    """Where ``text[offset]`` stands: the path of the value (or, between members, of the container) and
    one of ``"key"``, ``"string"``, ``"scalar"`` (a number or literal), ``"value"`` (a value starts
    there), ``"after value"`` (a member ended: ``,``, ``}``, ``]`` or whitespace follow) or ``"end"``."""
    frames: list[list[Any]] = []  # per open container: [kind, key or index, expecting a key]
    in_string = escaped = is_key = scalar = after = False
    key: list[str] = []
    for ch in text[:offset]:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if is_key:
                    frames[-1][1] = "".join(key)
                else:
                    after = True
                continue
            if is_key:
                key.append(ch)
            continue
        if scalar and (ch.isspace() or ch in ",]}"):
            scalar, after = False, True
        if ch == '"':
            is_key = bool(frames) and frames[-1][0] == "object" and frames[-1][2]
            in_string, key, after = True, [], False
        elif ch in "{[":
            frames.append(["object", None, True] if ch == "{" else ["array", 0, False])
            after = False
        elif ch in "]}":
            if frames:
                frames.pop()
            after = True
        elif ch == ",":
            if frames and frames[-1][0] == "object":
                frames[-1][1:] = [None, True]
            elif frames:
                frames[-1][1] += 1
            after = False
        elif ch == ":":
            if frames:
                frames[-1][2] = False
            after = False
        elif not ch.isspace():
            scalar = True
    path = tuple(f[1] for f in frames if not (f[0] == "object" and f[2]))
    if in_string:
        return (path, "key") if is_key else (path, "string")
    if scalar:
        return path, "scalar"
    if frames and frames[-1][0] == "object" and frames[-1][2]:
        return path, "key"
    if after:
        return (path[:-1], "after value") if frames else ((), "end")
    return path, "value"


def _located_cause(where: str, candidates: list[dict[str, Any]]) -> str:
    """The likely cause of a disagreement where one engine stopped (``where``, see :func:`_json_context`),
    named after the keywords of the subschemas that apply there."""
    keywords = {k for c in candidates for k in c}

    def has(*names: str) -> bool:
        return any(name in keywords for name in names)

    if where == "key":
        for name in ("patternProperties", "propertyNames", "dependentSchemas", "unevaluatedProperties"):
            if has(name):
                return f"key: {name}"
        if any(isinstance(c.get("additionalProperties"), dict) for c in candidates):
            return "key: additionalProperties schema"
        return "key: declared or undeclared"
    if where == "string":
        formats = sorted({str(c["format"]) for c in candidates if "format" in c})
        if formats:
            return f"string: format {'/'.join(formats)}"
        for name, cause in (("pattern", "pattern"), ("enum", "enum"), ("const", "const")):
            if has(name):
                return f"string: {cause}"
        if has("minLength", "maxLength"):
            return "string: length"
        return "string: content"
    if where == "scalar":
        if has("multipleOf"):
            return "number: multipleOf"
        if has("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            return "number: bounds"
        if has("enum", "const"):
            return "scalar: enum/const"
        return "scalar: type or form"
    if where == "value":
        if any("anyOf" in c and any(k in c for k in ("properties", "items", "required")) for c in candidates):
            return "value: anyOf beside other keywords"
        if has("enum", "const"):
            return "value: enum/const"
        return "value: type"
    if where == "after value":
        if has("minItems", "maxItems", "prefixItems", "contains"):
            return "container: array length"
        if has("required", "minProperties", "maxProperties", "dependentRequired"):
            return "container: required or property count"
        return "container: end"
    return "end of value"


@dataclass
class DifferentialCounts:
    """What a differential run found in one mode. ``texts`` = ``both_accept`` + ``both_reject`` +
    ``xgrammar_only`` + ``llguidance_only``: the texts walked through both engines."""

    mode: str
    schemas: int = 0
    compiled: int = 0  # compiled by both engines: their texts are compared
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIFFERENTIAL_ENGINES, 0))
    texts: int = 0
    both_accept: int = 0
    both_reject: int = 0
    xgrammar_only: int = 0  # xgrammar accepts, llguidance rejects
    llguidance_only: int = 0  # llguidance accepts, xgrammar rejects
    skipped: int = 0  # texts over the length limit, or that the tokenizer does not round-trip
    # cause -> {"xgrammar": accepted by it only, "llguidance": ..., "validated": flagged by the accepting
    # engine's validate(), i.e. a superset whose violation is reported}
    causes: dict[str, dict[str, int]] = field(default_factory=dict)
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> texts, disagreements
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # cause -> a few disagreements
    refusals: list[str] = field(default_factory=list)  # "name (engine): error", the first 200
    errors: list[str] = field(default_factory=list)  # an engine raised on a text: "name: error", the first 200

    @property
    def agreements(self) -> int:
        return self.both_accept + self.both_reject

    @property
    def disagreements(self) -> int:
        return self.xgrammar_only + self.llguidance_only

    def add(self, other: DifferentialCounts, *, examples_per_cause: int = 5) -> None:
        """Add ``other``'s counts (the same mode) to these; examples up to ``examples_per_cause`` a cause."""
        for name in ("schemas", "compiled", "texts", "both_accept", "both_reject", "xgrammar_only",
                     "llguidance_only", "skipped"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for engine, n in other.refused.items():
            self.refused[engine] = self.refused.get(engine, 0) + n
        for table, theirs in ((self.causes, other.causes), (self.by_source, other.by_source)):
            for key, tally in theirs.items():
                mine = table.setdefault(key, dict.fromkeys(tally, 0))
                for k, n in tally.items():
                    mine[k] = mine.get(k, 0) + n
        for cause, found in other.examples.items():
            kept = self.examples.setdefault(cause, [])
            kept += found[: max(0, examples_per_cause - len(kept))]
        self.refusals += other.refusals[: max(0, 200 - len(self.refusals))]
        self.errors += other.errors[: max(0, 200 - len(self.errors))]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "agreements": self.agreements, "disagreements": self.disagreements}


@dataclass(frozen=True)
class _Text:
    source: str  # "maskbench valid", "hypothesis", "mutation: change type"...
    variant: str  # how it was written: "json.dumps", "compact", "generation's form" (+ ", schema order"); "text"
    text: str
    data: Any = None  # the value written; None for a text mutation
    base: str | None = None  # a text mutation's unmutated text
    separators: tuple[str, str] = (", ", ": ")  # how ``data`` was written
    ensure_ascii: bool = True

    def rewrite(self, data: Any, *, separators: tuple[str, str] | None = None, ensure_ascii: bool | None = None) -> str:
        """``data`` written as this text was, but for the options given."""
        return json.dumps(
            data,
            separators=self.separators if separators is None else separators,
            ensure_ascii=self.ensure_ascii if ensure_ascii is None else ensure_ascii,
        )


def _mode_texts(
    instances: list[tuple[str, Any]], mutated: list[tuple[str, Any]], base: Any, mode: str, constraint: JsonSchema,
    prepared: Any,
) -> list[_Text]:  # fmt: skip
    """The texts a mode compares, each once.

    ``instances`` written as the mode writes them: generation as it writes a value (``constraint``'s
    separators, no ``\\u`` escapes), with the keys as given and in the schema's order;
    specification with ``json.dumps`` (ASCII, ``", "`` and ``": "``) and compactly (``(",", ":")``,
    UTF-8). The ``mutated`` values written once, keys in the schema's order (generation's form, or
    ``json.dumps``), and the :func:`text_mutations` of ``base`` so written."""
    generation = (SEPARATORS.get(constraint.whitespace, (",", ":")), False)
    forms = (
        [("generation's form", *generation)]
        if mode == "generation"
        else [("json.dumps", (", ", ": "), True), ("compact", (",", ":"), False)]
    )
    texts: list[_Text] = []
    for source, data in instances:
        for name, separators, ascii_only in forms:
            texts.append(_Text(source, name, json.dumps(data, separators=separators, ensure_ascii=ascii_only), data,
                               None, separators, ascii_only))  # fmt: skip
            if mode == "generation":
                ordered = json.dumps(schema_ordered(data, prepared), separators=separators, ensure_ascii=ascii_only)
                texts.append(_Text(source, f"{name}, schema order", ordered, data, None, separators, ascii_only))
    name, separators, ascii_only = forms[0]
    for source, data in mutated:
        written = json.dumps(schema_ordered(data, prepared), separators=separators, ensure_ascii=ascii_only)
        texts.append(_Text(source, f"{name}, schema order", written, data, None, separators, ascii_only))
    if base is not None:
        written = json.dumps(schema_ordered(base, prepared), separators=separators, ensure_ascii=ascii_only)
        texts += [_Text(f"mutation: {label}", "text", text, None, written) for label, text in text_mutations(written)]
    unique: dict[str, _Text] = {}
    for t in texts:
        unique.setdefault(t.text, t)
    return list(unique.values())


class _Verdicts:
    """Both engines' verdicts on the texts of one schema in one mode, memoized."""

    def __init__(self, compiled: dict[str, CompiledConstraint], tokenizer: Any) -> None:
        self.compiled = compiled
        self.tokenizer = tokenizer
        self._seen: dict[str, tuple[dict[str, bool], dict[str, int]]] = {}
        self._refused: dict[tuple[str, str], str] = {}  # (text, engine) -> the token its mask refused

    def __call__(self, text: str) -> tuple[dict[str, bool], dict[str, int]]:
        """Per engine: whether it accepts ``text`` (every token allowed by the mask, then the grammar can
        end), and the character offset where it stopped (``len(text)`` when it took every token).

        Raises ValueError when the tokenizer does not round-trip ``text``."""
        if text not in self._seen:
            ids = token_ids(self.tokenizer, text)
            accepted, stops = {}, {}
            for engine, compiled in self.compiled.items():
                ok, matcher = walk(compiled, ids)
                accepted[engine] = ok and matcher.is_completed()
                stops[engine] = len(text) if ok else len(self.tokenizer.decode(ids[: matcher.num_accepted]))
                if not ok:
                    self._refused[text, engine] = self.tokenizer.decode(
                        ids[matcher.num_accepted : matcher.num_accepted + 1]
                    )
            self._seen[text] = accepted, stops
        return self._seen[text]

    def refused_token(self, text: str, engine: str) -> str:
        """The text of the token ``engine`` refused in ``text`` ("" if it took every token)."""
        return self._refused.get((text, engine), "")

    def grammar_accepts(self, engine: str, text: str) -> bool:
        """Whether ``engine`` takes every token of ``text`` by ``accept_token`` alone (no mask), then can end."""
        matcher = self.compiled[engine].matcher()
        return all(matcher.accept_token(t) for t in token_ids(self.tokenizer, text)) and matcher.is_completed()

    def agree(self, text: str) -> bool | None:
        """Whether both engines give ``text`` the same verdict; None if it cannot be tokenized."""
        try:
            accepted, _ = self(text)
        except ValueError:
            return None
        return accepted["xgrammar"] == accepted["llguidance"]


def _superset_keywords(accepting: CompiledConstraint, other: CompiledConstraint) -> list[str]:
    """Keywords the accepting engine's grammar only checks afterwards (a superset) where the other's enforces."""
    theirs = {(e.pointer, e.keyword, e.status) for e in other.coverage}
    return sorted(
        {
            e.keyword
            for e in accepting.coverage
            if e.status == "checked" and (e.pointer, e.keyword, e.status) not in theirs
        }
    )


def _classify(t: _Text, verdicts: _Verdicts, accepting: str, prepared: Any) -> tuple[str, bool]:
    """The likely cause of a disagreement on ``t``, and whether the accepting engine's ``validate``
    flags ``t`` (its grammar admits a superset there and reports the violation).

    In order: a text mutation the engines agree on without (``duplicate key``, ``whitespace``); a
    specification-mode text the engines agree on once its keys are in the schema's order (``key order``);
    a ``json.dumps`` text they agree on written compactly (``whitespace``) or without ``\\u`` escapes
    (``unicode escape``); the
    rejecting engine's grammar that takes the text token by token though its mask excluded one
    (``<engine> mask narrower than its grammar``); a keyword the accepting engine only checks
    afterwards (``<engine> grammar superset: <keyword>``);
    else, along the path to where the rejecting engine stopped (and inside a value it refused), ``anyOf``
    beside other keywords, a required key ``properties`` does not declare, a property named like an
    annotation (xgrammar), an escape the rejecting engine refused inside a string; else, when the accepting
    engine's ``validate`` flags the text, the keyword it reports (``<engine> accepts a violation of
    <keyword>``); else what the schema says where the rejecting engine stopped (:func:`_located_cause`)."""
    compiled = verdicts.compiled
    rejecting = next(e for e in DIFFERENTIAL_ENGINES if e != accepting)
    flagged = bool(compiled[accepting].validate(t.text))
    if t.base is not None and verdicts.agree(t.base):
        return ("duplicate key" if t.source == "mutation: duplicate key" else "whitespace"), flagged
    if t.data is not None:
        data = schema_ordered(t.data, prepared)
        specification = not t.variant.startswith("generation")  # generation's language has one key order
        if specification and t.rewrite(data) != t.text and verdicts.agree(t.rewrite(data)):
            return "key order", flagged
        if t.variant.startswith("json.dumps") and verdicts.agree(t.rewrite(data, separators=(",", ":"))):
            return "whitespace", flagged
        if t.ensure_ascii and "\\u" in t.text and verdicts.agree(t.rewrite(data, ensure_ascii=False)):
            return "unicode escape", flagged
    if verdicts.grammar_accepts(rejecting, t.text):
        return f"{rejecting} mask narrower than its grammar", flagged
    superset = _superset_keywords(compiled[accepting], compiled[rejecting])
    if flagged and superset:
        return f"{accepting} grammar superset: {'/'.join(superset)}", flagged
    _, stops = verdicts(t.text)
    path, where = _json_context(t.text, stops[rejecting])
    candidates = _alternatives(prepared, prepared)
    along = list(candidates)  # every subschema from the root down to where the rejecting engine stopped
    for part in path:
        candidates = _member_schemas(candidates, part, prepared)
        along += candidates
    if where == "value":  # the rejecting engine refused the whole value: what is inside matters too
        along += _subtree(candidates, prepared)
    if any(("anyOf" in c or "oneOf" in c) and any(k in c for k in _BESIDE_BRANCHES) for c in along):
        return "keywords beside anyOf", flagged
    if any(set(c.get("required") or ()) - set(c.get("properties") or ()) for c in along):
        return "required key not in properties", flagged
    if rejecting == "xgrammar" and any(_ANNOTATION_NAMES & set(c.get("properties") or ()) for c in along):
        return "property named like an annotation", flagged
    if where == "string" and "\\" in verdicts.refused_token(t.text, rejecting):
        return f"string: escape{_string_keywords(candidates)}", flagged
    if flagged:
        return f"{accepting} accepts a violation of {_violated(compiled[accepting].validate(t.text)[0])}", flagged
    return _located_cause(where, candidates), flagged


_VIOLATIONS = (
    ("is a required property", "required"),
    ("is not of type", "type"),
    ("is not one of", "enum"),
    ("was expected", "const"),
    ("does not match", "pattern"),
    ("is not a '", "format"),
    ("Additional properties are not allowed", "additionalProperties"),
    ("do not match any of the regexes", "additionalProperties"),
    ("properties", "minProperties/maxProperties"),
    ("is too long", "maxLength/maxItems"),
    ("is too short", "minLength/minItems"),
    ("should be non-empty", "minLength/minItems"),
    ("is expected to be empty", "maxLength/maxItems"),
    ("than the m", "minimum/maximum"),
    ("multiple of", "multipleOf"),
    ("non-unique elements", "uniqueItems"),
    ("is not valid under any of the given schemas", "anyOf/oneOf"),
    ("is valid under each of", "oneOf"),
    ("is a dependency of", "dependentRequired"),
    ("not valid JSON", "JSON syntax"),
)
"""A ``validate`` message (``jsonschema``'s wording) -> the keyword it reports, first match wins."""


def _violated(message: str) -> str:
    """The keyword a :meth:`~constrain.compile.compiler.CompiledConstraint.validate` message reports."""
    return next((keyword for words, keyword in _VIOLATIONS if words in message), "another keyword")


_ANNOTATION_NAMES = frozenset({"description", "title", "default", "examples"})
"""Property names xgrammar 0.2.8's schema converter loses in a closed object when an object that differs
only by them was converted before (it reuses that object's rule)."""


def _string_keywords(candidates: list[dict[str, Any]]) -> str:
    """`` in a length-bounded string``, `` in a pattern string``, or ``""``: what constrains a string."""
    if any("minLength" in c or "maxLength" in c for c in candidates):
        return " in a length-bounded string"
    if any("pattern" in c or "format" in c for c in candidates):
        return " in a pattern or format string"
    return ""


def _subtree(candidates: list[dict[str, Any]], root: Any, limit: int = 500) -> list[dict[str, Any]]:
    """The subschemas nested in ``candidates`` (members, items, branches, references), up to ``limit``."""
    found: list[dict[str, Any]] = []
    seen = {id(c) for c in candidates}
    pending = list(candidates)
    while pending and len(found) < limit:
        node = pending.pop()
        nested: list[Any] = []
        for key in ("properties", "patternProperties"):
            if isinstance(node.get(key), dict):
                nested += node[key].values()
        for key in ("items", "additionalProperties", "not"):
            nested.append(node.get(key))
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list):
                nested += node[key]
        if isinstance(node.get("$ref"), str):
            nested.append(_resolve(root, node["$ref"]))
        for sub in nested:
            if isinstance(sub, dict) and id(sub) not in seen:
                seen.add(id(sub))
                found.append(sub)
                pending.append(sub)
    return found


_BESIDE_BRANCHES = frozenset(
    {
        "properties", "required", "additionalProperties", "patternProperties", "items", "prefixItems",
        "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "enum", "const", "minimum",
        "maximum", "exclusiveMinimum", "exclusiveMaximum", "minProperties", "maxProperties",
    }
)  # fmt: skip
"""Keywords that constrain a value beside its ``anyOf``/``oneOf`` (the prepared schema keeps some there)."""


def run_differential(
    name: str,
    schema: Any,
    tests: list[dict[str, Any]],
    tokenizer: Any,
    *,
    hypothesis_count: int = 3,
    seed: int = 0,
    hypothesis_time_s: float = 1.0,
    compile_timeout_s: float = 5.0,
    max_chars: int = 4000,
    examples_per_cause: int = 5,
) -> dict[str, DifferentialCounts]:
    """Compare xgrammar and llguidance on one schema in both modes: the counts per mode.

    Instances: ``tests`` (MaskBench's ``[{"valid": bool, "data": ...}]``), up to ``hypothesis_count``
    drawn by :func:`hypothesis_instances`, and the :func:`mutations` and :func:`text_mutations` of
    the first valid one (MaskBench's, else the first drawn). Each is written as the mode writes it
    (generation: as it writes a value, keys as given and in the schema's order; specification:
    ``json.dumps`` and compact; see :func:`_mode_texts`), then walked through both engines' masks (:func:`walk`) and
    ``is_completed``. A schema an engine refuses (a :class:`~constrain.errors.ConstraintError`: a
    keyword, a compile past ``compile_timeout_s``) is counted refused for it, not compared. Texts
    over ``max_chars`` characters are skipped (counted). Deterministic for a given ``seed``.
    """
    instances = [(f"maskbench {'valid' if t['valid'] else 'invalid'}", t["data"]) for t in tests]
    drawn = hypothesis_instances(schema, count=hypothesis_count, seed=seed, time_limit_s=hypothesis_time_s)
    instances += [("hypothesis", d) for d in drawn]
    valid = [t["data"] for t in tests if t["valid"]] + drawn
    base = valid[0] if valid else None
    counts: dict[str, DifferentialCounts] = {}
    for mode in DIFFERENTIAL_MODES:
        c = counts[mode] = DifferentialCounts(mode, schemas=1)
        compiled: dict[str, CompiledConstraint] = {}
        for engine in DIFFERENTIAL_ENGINES:
            try:
                constraint = json_schema(schema, mode=mode)  # type: ignore[arg-type]
                compiled[engine] = compile_constraint(constraint, tokenizer, engine=engine, timeout_s=compile_timeout_s)
            except ConstraintError as err:
                c.refused[engine] += 1
                c.refusals.append(f"{name} ({engine}): {type(err).__name__}: {str(err)[:200]}")
        if len(compiled) < len(DIFFERENTIAL_ENGINES):
            continue
        c.compiled = 1
        prepared = compiled["xgrammar"].engine_schema
        mutated = []
        if base is not None:
            mutated = [(f"mutation: {label}", d) for label, d in mutations(schema_ordered(base, prepared), prepared)]
        verdicts = _Verdicts(compiled, tokenizer)
        for t in _mode_texts(instances, mutated, base, mode, constraint, prepared):
            if len(t.text) > max_chars:
                c.skipped += 1
                continue
            try:
                accepted, _ = verdicts(t.text)
            except ValueError:  # the tokenizer does not round-trip the text
                c.skipped += 1
                continue
            except Exception as err:  # an engine failed: reported, the run goes on
                c.errors.append(f"{name} ({t.source}): {type(err).__name__}: {str(err)[:200]}")
                continue
            c.texts += 1
            source = c.by_source.setdefault(t.source, {"texts": 0, "disagreements": 0})
            source["texts"] += 1
            if accepted["xgrammar"] == accepted["llguidance"]:
                c.both_accept += accepted["xgrammar"]
                c.both_reject += not accepted["xgrammar"]
                continue
            winner = "xgrammar" if accepted["xgrammar"] else "llguidance"
            c.xgrammar_only += winner == "xgrammar"
            c.llguidance_only += winner == "llguidance"
            source["disagreements"] += 1
            try:
                cause, flagged = _classify(t, verdicts, winner, prepared)
            except Exception as err:  # an engine failed on a variant of the text
                cause, flagged = "unclassified (an engine raised)", False
                c.errors.append(f"{name} ({t.source}, classifying): {type(err).__name__}: {str(err)[:200]}")
            tally = c.causes.setdefault(cause, {"xgrammar": 0, "llguidance": 0, "validated": 0})
            tally[winner] += 1
            tally["validated"] += flagged
            kept = c.examples.setdefault(cause, [])
            if len(kept) < examples_per_cause:
                kept.append(
                    {"schema": name, "source": t.source, "variant": t.variant, "accepted_by": winner,
                     "validate_flags": flagged, "text": t.text}
                )  # fmt: skip
    return counts


__all__ += [
    "DIFFERENTIAL_ENGINES",
    "DIFFERENTIAL_MODES",
    "UNDECLARED_KEY",
    "DifferentialCounts",
    "hypothesis_instances",
    "mutations",
    "run_differential",
    "schema_ordered",
    "text_mutations",
]
