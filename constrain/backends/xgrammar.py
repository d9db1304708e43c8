"""The xgrammar engine: masks precomputed per grammar position at compile time, the fastest to serve.

Syntax checks of the grammar language (``check_ebnf``, ``check_regex``), the EBNF
of a JSON schema with xgrammar's spelling fixed where it is not JSON
(``json_schema_ebnf``), and :class:`XGrammarBackend`, one per tokenizer, which
compiles EBNF and regexes into :class:`XGrammarGrammar` and fills many requests'
masks at once. Nothing here knows constrain's constraint types.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any, cast

import torch
import xgrammar as xgr
from xgrammar import structural_tag as st

from constrain.backends.base import GrammarState, forced_prefix
from constrain.caches import bounded

__all__ = [
    "KEYS_MAX",
    "OPEN_KEY_RULES_MAX",
    "XGrammarBackend",
    "XGrammarGrammar",
    "check_ebnf",
    "check_regex",
    "choice_ebnf",
    "engine_message",
    "excluded_key_rules",
    "inline_optional_whitespace",
    "json_schema_ebnf",
    "keys_in_any_order",
    "never_ending_rules",
    "open_extra_keys",
    "structural_tag_ebnf",
]


def engine_message(err: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    return re.sub(r"^\[[^\]]*\] [^ ]+: ", "", str(err)).strip()


def check_regex(pattern: str) -> None:
    """Raise ``RuntimeError`` (:func:`engine_message` reads it) if xgrammar cannot serve ``pattern``."""
    xgr.Grammar.from_regex(pattern)


def check_ebnf(ebnf: str) -> None:
    """Raise ``RuntimeError`` (:func:`engine_message` reads it) if ``ebnf`` is not a valid grammar."""
    xgr.Grammar.from_ebnf(ebnf)


_CLASS, _RULE_REF, _SEQUENCE, _CHOICES, _REPEAT = 1, 4, 5, 6, 8
"""The kinds of expression :func:`never_ending_rules` reads, as xgrammar's serialized grammars number them
(``Grammar.serialize_json``, format v16 in xgrammar 0.2.8: each expression is ``[kind, length, *data]``).
The others (byte strings, character classes' stars, the empty string, tag dispatches) end."""


def _no_character(data: list[int]) -> bool:
    """Whether a character class (``[negated, lo, hi, lo, hi, ...]``, code points) matches no character:
    none listed, or negated and its ranges cover them all (``[^\\x00-\\U0010FFFF]``)."""
    ranges = sorted(zip(data[1::2], data[2::2], strict=True))
    if not data[0]:
        return not ranges
    reach = 0  # the first code point the ranges so far leave out
    for lo, hi in ranges:
        if lo > reach:
            return False
        reach = max(reach, hi + 1)
    return reach > 0x10FFFF


def never_ending_rules(ebnf: str) -> list[str]:
    """The rules of ``ebnf`` that ``root`` reaches and that match no finite text, in rule order: each of their
    alternatives needs such a rule again (``x ::= "a" x``; a required key whose schema refers back to its
    object). Decoding can never complete inside one, and xgrammar's jump-forward there never stops: it grows
    its text until memory runs out. Callers refuse such a grammar (``[]``: none). Reads the grammar xgrammar
    parsed (``RuntimeError`` where ``ebnf`` is invalid); lookaheads are not read (they never make a rule end)."""
    grammar = json.loads(xgr.Grammar.from_ebnf(ebnf).serialize_json())
    values: list[int] = grammar["grammar_expr_data"]
    starts: list[int] = grammar["grammar_expr_indptr"]
    exprs = [(values[at], values[at + 2 : at + 2 + values[at + 1]]) for at in starts]  # (kind, data)
    bodies = [rule[1] for rule in grammar["rules"]]

    def ends(expr: int) -> bool:
        kind, data = exprs[expr]
        if kind == _RULE_REF:
            return ending[data[0]]
        if kind == _SEQUENCE:
            return all(map(ends, data))
        if kind == _CHOICES:
            return any(map(ends, data))
        if kind == _REPEAT:  # (rule, min, max)
            return data[1] == 0 or ending[data[0]]
        return kind != _CLASS or not _no_character(data)

    def refs(rule: int) -> set[int]:  # the rules ``rule``'s body refers to
        found, pending = set(), [bodies[rule]]
        while pending:
            kind, data = exprs[pending.pop()]
            if kind in (_RULE_REF, _REPEAT):
                found.add(data[0])
            elif kind in (_SEQUENCE, _CHOICES):
                pending += data
        return found

    uses = [refs(rule) for rule in range(len(bodies))]
    users: list[list[int]] = [[] for _ in bodies]  # per rule, the rules whose bodies refer to it
    for rule, used in enumerate(uses):
        for other in used:
            users[other].append(rule)
    ending: list[bool] = [False] * len(bodies)
    todo = list(range(len(bodies)))  # a worklist: a rule is read again only once a rule it refers to ends
    while todo:
        rule = todo.pop()
        if not ending[rule] and ends(bodies[rule]):
            ending[rule] = True
            todo += users[rule]
    reached, todo = set(), [grammar["root_rule_id"]]
    while todo:
        rule = todo.pop()
        if rule not in reached:
            reached.add(rule)
            todo += uses[rule]
    return [grammar["rules"][r][0] for r in sorted(reached) if not ending[r]]


def structural_tag_ebnf(tag_format: Any) -> str:
    """The EBNF of a structural tag's ``format`` (``xgrammar.structural_tag`` format objects)."""
    return str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=tag_format)))


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_ebnf(options: tuple[str, ...]) -> str:
    """The EBNF grammar of exactly one of ``options``."""
    alternatives = " | ".join(_ebnf_string(o) if o else '""' for o in options)
    return f"root ::= {alternatives}\n"


_CHARACTERS_RULE = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_CHARACTER = r"(([^\"\\\0-\x1f]))"
"""xgrammar spells one character of a string with a length bound as ``[^"\\\r\n]``, which lets raw
control characters through (invalid JSON): this is JSON's unescaped character. (Escapes stay out: an
alternation here makes xgrammar's masks 300x slower, 14 ms instead of 49 µs, measured.)"""

_ANY_SEPARATOR = re.compile(r'^((?:basic_array_items|basic_object_properties) ::= \(\()", "', re.MULTILINE)
"""xgrammar 0.2.8 writes the separator of untyped values (``{}``, an open object's extra values) as
``", "`` whatever ``separators`` says, so compact output of ``{"type": "object"}`` rejected
``{"a":[1,2]}`` where llguidance accepted it: compact means ``","`` there too."""


@bounded("xgrammar.json_schema_ebnf", maxsize=64)
def json_schema_ebnf(
    schema_json: str, *, separators: tuple[str, str] | None, max_whitespace: int, any_order: bool
) -> str:
    """xgrammar's EBNF for a JSON schema (already prepared), its strings limited to JSON's characters.

    ``separators``: fixed item and key separators (compact output), or None for free whitespace of at
    most ``max_whitespace`` characters per run. Pure, memoized.
    """
    ebnf = str(
        xgr.Grammar.from_json_schema(
            schema_json,
            any_whitespace=separators is None,
            separators=separators,
            strict_mode=False,  # closing is written into the prepared schema, the same for both engines
            max_whitespace_cnt=None if separators else max_whitespace,
            any_order=any_order,
        )
    )
    ebnf = _CHARACTERS_RULE.sub(lambda found: f"{found.group(1)} ::= {_JSON_CHARACTER}", ebnf)
    if separators is not None:
        ebnf = _ANY_SEPARATOR.sub(rf'\1"{separators[0]}"', ebnf)
    return ebnf


_OPTIONAL_WHITESPACE_RULE = re.compile(r'^(\w+) ::= \(""\s*\|\s*\(\[ \\n\\r\\t\]\)\)$\n?', re.MULTILINE)
_LEXEME = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_]\w*')


def inline_optional_whitespace(ebnf: str) -> str:
    """``ebnf`` with each rule that is one optional whitespace character (``x ::= ("" | ([ \\n\\r\\t]))``, what
    xgrammar writes for every gap between JSON tokens under a whitespace bound of 1) written in place as
    ``[ \\n\\r\\t]?``: the same language, in fewer rules for xgrammar's parser to predict. Measured on the
    150 first MaskBench schemas of the 400-schema sample that xgrammar serves in specification mode
    (SmolLM2's tokenizer, Intel Xeon family 6 model 167, 2 cores, 2026-11-28): mask p50 / p99 8.3 / 32.3
    µs became 7.6 / 23.4, compile p50 7.9 ms became 3.5. Names inside string literals and character
    classes are left alone. Pure."""
    names = set(_OPTIONAL_WHITESPACE_RULE.findall(ebnf))
    names.discard("root")
    if not names:
        return ebnf
    kept = _OPTIONAL_WHITESPACE_RULE.sub(lambda found: "" if found.group(1) in names else found.group(0), ebnf)
    return _LEXEME.sub(lambda found: r"[ \n\r\t]?" if found.group(0) in names else found.group(0), kept)


OPEN_KEY_RULES_MAX = 16
"""An open object (extra keys allowed) makes xgrammar spell out "any key but the declared
ones" as a trie of rules, one per prefix of a declared name; past this many such rules
in a schema, extra keys become any string instead. Measured on a 20-property object
with the SmolLM2 tokenizer: 251 ms to compile exactly, 9 ms with any-string keys."""

_EXCLUDED_KEY_RULE = re.compile(r"^(\S+_addl_key) ::= ")
_EXCLUDED_KEY_PART = re.compile(r"^\S+_addl_key_\d+ ::= ")


def excluded_key_rules(ebnf: str) -> int:
    """How many rules the "any key but the declared ones" tries of open objects take in ``ebnf``."""
    return sum(bool(_EXCLUDED_KEY_PART.match(line)) for line in ebnf.split("\n"))


def open_extra_keys(ebnf: str) -> str | None:
    """``ebnf`` with its extra-key exclusion tries replaced by ``basic_string`` (any key), or None to keep
    it exact (at most :data:`OPEN_KEY_RULES_MAX` such rules)."""
    lines = ebnf.split("\n")
    if excluded_key_rules(ebnf) <= OPEN_KEY_RULES_MAX:
        return None
    if not any(line.startswith("basic_string ::= ") for line in lines):
        return None
    kept = []
    for line in lines:
        if _EXCLUDED_KEY_PART.match(line):
            continue
        found = _EXCLUDED_KEY_RULE.match(line)
        kept.append(f"{found.group(1)} ::= basic_string" if found else line)
    return "\n".join(kept)


KEYS_MAX = 4
"""Most keys of one object that :func:`keys_in_any_order` follows: it writes one rule per subset of them
(16 at most)."""

_OBJECT_RULE = re.compile(
    r'^(?P<name>\S+) ::= \(\("\{" (?P<before>.*?)(?P=name)_item (?P=name)_properties\{(?P<count>\d+), -1\}'
    r'(?P<after>.*?) "\}"\)(?P<empty> \| \("\{" .*?"\}"\))?\)$'
)
"""xgrammar's object with properties in any order: ``{``, a member, at least ``count`` more, ``}`` (or, where
it may be empty, ``{}``)."""


def keys_in_any_order(
    ebnf: str, required: dict[frozenset[str], frozenset[str] | None]
) -> tuple[str, bool, frozenset[frozenset[str]]]:
    """``ebnf`` (xgrammar's, properties in any order) with its objects' keys followed: whether every
    object ``required`` names now has its required keys enforced, and the objects (their declared keys)
    whose every key now comes at most once, with a ``,`` only where a key is left to write.

    xgrammar writes such an object as ``{`` member (``,`` member){k,} ``}``, each member any declared key
    or an extra one: it counts the members, never which keys came. ``required`` maps the declared keys of
    the schema's objects to the keys they require (None where objects with those declared keys require
    different ones: then none of them is changed). An object is rewritten as one rule per subset of the
    keys it follows, written so far: each of those comes once, ``}`` only once the required ones are
    there, and any other key (optional or extra) any number of times (the key guard refuses a repeat).
    Followed: every declared key of an object that takes no other (at most :data:`KEYS_MAX`), else its
    required keys (as many). Left as it is: an object with more, a required key not declared, keys that
    a pattern takes, or a count xgrammar bounds otherwise (``minProperties``, ``maxProperties``). Extra
    keys must be xgrammar's exact "any key but the declared ones" (:func:`open_extra_keys` not applied):
    else a followed key could be written as an extra one. Pure."""
    lines = ebnf.split("\n")
    at = {line.split(" ::= ", 1)[0]: index for index, line in enumerate(lines) if " ::= " in line}
    enforced: set[frozenset[str]] = set()  # the objects whose required keys are enforced
    tracked: set[frozenset[str]] = set()
    added: list[str] = []
    dropped: set[int] = set()  # the member rules of the objects spelled out again
    for index, line in enumerate(lines):  # (only the line at hand is replaced)
        found = _OBJECT_RULE.match(line)
        members = None if found is None else _members(lines, at, found["name"])
        if found is None or members is None:
            continue
        name, separator, (keyed, others) = found["name"], members[0], members[1:]
        declared = frozenset(keyed)
        needed = required.get(declared, frozenset())
        if needed is None or not needed <= declared or any(not o.startswith(f"({name}_addl_key ") for o in others):
            continue
        if int(found["count"]) != max(len(needed) - 1, 0) or (found["empty"] is not None) == bool(needed):
            continue  # another count: minProperties, maxProperties
        follows = declared if not others and len(declared) <= KEYS_MAX else needed
        if not follows or len(follows) > KEYS_MAX:
            continue
        order = sorted(follows)
        bits = {key: 1 << place for place, key in enumerate(order)}
        due = sum(bits[key] for key in needed)
        repeated = [member for key, member in keyed.items() if key not in follows] + others
        state = f"{name}_keys_"  # + the keys written so far, as bits of ``order``
        first = [f"({keyed[key]} {state}{bits[key]})" for key in order]
        if repeated:
            added.append(f"{name}_keys_other ::= ({' | '.join(repeated)})")
            added.append(f"{name}_keys_more ::= (({separator}{name}_keys_other))")
            first.append(f"({name}_keys_other {state}0)")
        lines[index] = f'{name} ::= (("{{" {found["before"]}({" | ".join(first)})){found["empty"] or ""})'
        for seen in range(1 << len(order)):
            then = [f"({separator}{keyed[key]} {state}{seen | bits[key]})" for key in order if not seen & bits[key]]
            if seen & due == due:
                then.append(f'({found["after"].lstrip()}{" " if found["after"].strip() else ""}"}}")')
            more = f"{name}_keys_more* " if repeated else ""
            added.append(f"{state}{seen} ::= (({more}({' | '.join(then)})))")
        dropped.update((at[f"{name}_item"], at[f"{name}_properties"]))
        enforced.add(declared)
        if follows == declared:
            tracked.add(declared)
    complete = all(needed is not None and (not needed or keys in enforced) for keys, needed in required.items())
    kept = [line for index, line in enumerate(lines) if index not in dropped]
    return "\n".join(kept + added), complete, frozenset(tracked)


def _members(lines: list[str], at: dict[str, int], name: str) -> tuple[str, dict[str, str], list[str]] | None:
    """Object rule ``name``'s separator before a member, its members by declared key (each alternative's
    text) and its other members (extra or pattern keys); None where they are not as xgrammar writes them."""
    item, properties = lines[at.get(f"{name}_item", -1)], lines[at.get(f"{name}_properties", -1)]
    prefix = f"{name}_properties ::= (("
    if not properties.startswith(prefix) or not properties.endswith(f"{name}_item))"):
        return None
    separator = properties[len(prefix) : -len(f"{name}_item))")]
    alternatives = _alternatives(item.split(" ::= ", 1)[1]) if item.startswith(f"{name}_item ::= ") else None
    if alternatives is None:
        return None
    keyed: dict[str, str] = {}
    others = []
    for alternative in alternatives:
        key = _leading_key(alternative)
        if key is None:
            others.append(alternative)
        elif key in keyed:
            return None
        else:
            keyed[key] = alternative
    return separator, keyed, others


def _alternatives(body: str) -> list[str] | None:
    """The top-level alternatives of a rule's body ``((a) | (b))``, each with its parentheses; None where
    the body is not so."""
    if not (body.startswith("(") and body.endswith(")")):
        return None
    inner, found, depth, start = body[1:-1], [], 0, 0
    for token in _RULE_TOKENS.finditer(inner):  # strings and character classes skipped whole
        text = token.group()
        if text == "(":
            depth += 1
        elif text == ")":
            depth -= 1
        elif text == " | " and depth == 0:
            found.append(inner[start : token.start()])
            start = token.end()
    found.append(inner[start:])
    return found if all(part.startswith("(") and part.endswith(")") for part in found) else None


_RULE_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[()]| \| ')
"""What :func:`_alternatives` reads of a rule's body: a string, a character class, a parenthesis, a ``|``."""


def _leading_key(alternative: str) -> str | None:
    """The key an object member's alternative ``("\\"key\\"" ...)`` begins with, or None (another member)."""
    found = re.match(r'\("((?:[^"\\]|\\.)*)" ', alternative)
    if found is None:
        return None
    try:
        key = json.loads(json.loads(f'"{found.group(1)}"'))
    except ValueError:
        return None
    return key if isinstance(key, str) else None


class _Matcher(xgr.GrammarMatcher):
    """xgrammar's matcher, whose forced text never raises: xgrammar hands it over as ``str`` and fails to
    decode it where it begins or ends inside a character (the grammar forces the rest of a Cyrillic key
    after a token that wrote its first byte); the bytes are then read from the error."""

    def find_jump_forward_string(self) -> str:
        try:
            return super().find_jump_forward_string()
        except UnicodeDecodeError as error:
            return forced_prefix(bytes(error.object))

    def fork(self) -> _Matcher:
        return cast(_Matcher, _Matcher._create_from_handle(self._handle.fork()))  # type: ignore[union-attr]


class XGrammarGrammar:
    """An xgrammar grammar compiled for one tokenizer (a :class:`~constrain.backends.base.CompiledGrammar`)."""

    engine = "xgrammar"

    def __init__(self, grammar: xgr.CompiledGrammar, backend: XGrammarBackend) -> None:
        self.grammar = grammar
        self.backend = backend

    @property
    def memory_size_bytes(self) -> int:
        return int(self.grammar.memory_size_bytes)

    def new_state(self, *, max_rollback_tokens: int = -1) -> GrammarState:
        return _Matcher(
            self.grammar,
            override_stop_tokens=list(self.backend.eos_token_ids) or None,
            max_rollback_tokens=max_rollback_tokens,
        )

    def completes(self, state: GrammarState, token_ids: Sequence[int]) -> bool:
        """Token by token, then rolled back (an xgrammar step costs a few microseconds)."""
        taken = 0
        for token in token_ids:
            if not state.accept_token(token):
                break
            taken += 1
        done = taken == len(token_ids) and bool(state.is_completed())
        state.rollback(taken)
        return done


class XGrammarBackend:
    """xgrammar for one tokenizer: compiles grammars, and fills many states' masks in one call.

    Owns xgrammar's compiler (its own cache off: constrain's compile cache sits in front, and
    would otherwise hold every grammar twice) and a batch filler (xgrammar's thread pool), both
    made on first use. Thread-safe.
    """

    def __init__(self, info: xgr.TokenizerInfo, eos_token_ids: tuple[int, ...]) -> None:
        self.info = info
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()

    @functools.cached_property
    def _compiler(self) -> xgr.GrammarCompiler:
        return xgr.GrammarCompiler(self.info, cache_enabled=False)

    @functools.cached_property
    def _batch(self) -> xgr.BatchGrammarMatcher:
        return xgr.BatchGrammarMatcher()

    def compile_ebnf(self, ebnf: str) -> XGrammarGrammar:
        """Compile EBNF text (``RuntimeError`` from the engine on failure)."""
        with self._lock:
            compiler = self._compiler
        return XGrammarGrammar(compiler.compile_grammar(ebnf), self)

    def compile_regex(self, pattern: str) -> XGrammarGrammar:
        """Compile a regex the whole output must match (``RuntimeError`` from the engine on failure)."""
        with self._lock:
            compiler = self._compiler
        return XGrammarGrammar(compiler.compile_regex(pattern), self)

    def fill_next_token_bitmasks(
        self,
        states: Sequence[GrammarState],
        # [B, ceil(V / 32)] int32, on the CPU
        bitmask: torch.Tensor,
        rows: Sequence[int],
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``states[i]`` across xgrammar's threads. Does not change the states."""
        with self._lock:
            batch = self._batch
        batch.batch_fill_next_token_bitmask([cast(xgr.GrammarMatcher, s) for s in states], bitmask, list(rows))
