"""Differential testing of the two engines (issue 13): the same constraint compiled by xgrammar and by
llguidance, the same texts walked through both, and each disagreement classified by its likely cause.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from constrain.compiler.compiler import CompiledConstraint
from constrain.compiler.compiler import compile as compile_constraint
from constrain.constraints.constraint import json_schema
from constrain.errors import ConstraintError
from constrain.testing.instances import ComparedText, hypothesis_instances, mode_texts, mutations
from constrain.testing.jsontext import json_context
from constrain.testing.matching import Verdicts
from constrain.testing.subschemas import alternatives, member_schemas, schema_ordered, subtree

__all__ = ["DIFFERENTIAL_ENGINES", "DIFFERENTIAL_MODES", "DifferentialCounts", "run_differential"]


DIFFERENTIAL_ENGINES = ("xgrammar", "llguidance")
"""The engines a differential run compares, in the order its counts name them."""

DIFFERENTIAL_MODES = ("generation", "specification")
"""The :func:`~constrain.constraints.constraint.json_schema` modes a differential run compiles each schema in."""


def _located_cause(where: str, candidates: list[dict[str, Any]]) -> str:
    """The likely cause of a disagreement where one engine stopped (``where``, see
    :func:`~constrain.testing.jsontext.json_context`), named after the keywords of the subschemas that
    apply there."""
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


def _classify(t: ComparedText, verdicts: Verdicts, accepting: str, prepared: Any) -> tuple[str, bool]:
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
    annotation (xgrammar), an escape the rejecting engine refused inside a string or a key; else, when the accepting
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
    path, where = json_context(t.text, stops[rejecting])
    candidates = alternatives(prepared, prepared)
    along = list(candidates)  # every subschema from the root down to where the rejecting engine stopped
    for part in path:
        candidates = member_schemas(candidates, part, prepared)
        along += candidates
    if where == "value":  # the rejecting engine refused the whole value: what is inside matters too
        along += subtree(candidates, prepared)
    if any(("anyOf" in c or "oneOf" in c) and any(k in c for k in _BESIDE_BRANCHES) for c in along):
        return "keywords beside anyOf", flagged
    if any(set(c.get("required") or ()) - set(c.get("properties") or ()) for c in along):
        return "required key not in properties", flagged
    if rejecting == "xgrammar" and any(_ANNOTATION_NAMES & set(c.get("properties") or ()) for c in along):
        return "property named like an annotation", flagged
    if where in ("string", "key") and "\\" in verdicts.refused_token(t.text, rejecting):
        return (f"string: escape{_string_keywords(candidates)}" if where == "string" else "key: escape"), flagged
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
    """The keyword a :meth:`~constrain.compiler.compiler.CompiledConstraint.validate` message reports."""
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
    drawn by :func:`~constrain.testing.instances.hypothesis_instances`, and the
    :func:`~constrain.testing.instances.mutations` and :func:`~constrain.testing.instances.text_mutations`
    of the first valid one (MaskBench's, else the first drawn). Each is written as the mode writes it
    (generation: as it writes a value, keys as given and in the schema's order; specification:
    ``json.dumps`` and compact; see :func:`~constrain.testing.instances.mode_texts`), then walked through
    both engines' masks (:func:`~constrain.testing.matching.walk`) and ``is_completed``. A schema an
    engine refuses (a :class:`~constrain.errors.ConstraintError`: a keyword, a compile past
    ``compile_timeout_s``) is counted refused for it, not compared. Texts
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
        verdicts = Verdicts(compiled, tokenizer)
        for t in mode_texts(instances, mutated, base, mode, constraint, prepared):
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
