"""The instances a differential run compares: drawn by hypothesis-jsonschema, mutated (values and text),
and written as each ``json_schema`` mode writes them.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from constrain.constraints.constraint import SEPARATORS, JsonSchema
from constrain.testing.jsontext import structural_characters
from constrain.testing.subschemas import alternatives, schema_ordered, walk_values

__all__ = ["UNDECLARED_KEY", "ComparedText", "hypothesis_instances", "mode_texts", "mutations", "text_mutations"]


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


def _replaced(value: Any, path: tuple[str | int, ...], new: Any) -> Any:
    """A copy of ``value`` with the value at ``path`` replaced by ``new``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: _replaced(v, rest, new) if k == head else v for k, v in value.items()}


UNDECLARED_KEY = "zz_undeclared"
"""The key the ``undeclared key`` mutation adds (no MaskBench schema declares it)."""


def mutations(data: Any, schema: Any) -> list[tuple[str, Any]]:
    """Labelled variants of ``data`` that are likely invalid for ``schema`` (prepared; see
    :func:`~constrain.testing.subschemas.schema_ordered`), each changing the first place in document
    order where it applies:

    - ``drop required key``: an object loses a key its schema requires;
    - ``undeclared key``: an object gains :data:`UNDECLARED_KEY` (valid where objects are open);
    - ``change type``: a scalar becomes a value of another type (a string ``12345``, anything else ``"x"``);
    - ``extra item``: an array gets a copy of its last item (``0`` if empty) appended.

    Text-level mutations (a key written twice, whitespace) are :func:`text_mutations`.
    """
    out: list[tuple[str, Any]] = []
    values = list(walk_values(data, alternatives(schema, schema), schema))
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


def text_mutations(text: str) -> list[tuple[str, str]]:
    """Labelled variants of the JSON ``text`` that no JSON mode admits, or that only some admit:

    - ``duplicate key``: the first member of the first non-empty object written twice (``{"a":1,"a":1,...}``);
    - ``whitespace: two spaces``: two spaces after the first ``:`` or ``,`` (no mode admits it);
    - ``whitespace: newline``: a newline after the first ``:`` or ``,`` (specification mode admits it);
    - ``whitespace: trailing newline``: a newline after the value.
    """
    out: list[tuple[str, str]] = []
    marks = list(structural_characters(text))
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


@dataclass(frozen=True)
class ComparedText:
    """One text a differential run walks through both engines: where it came from and how it was written."""

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


def mode_texts(
    instances: list[tuple[str, Any]], mutated: list[tuple[str, Any]], base: Any, mode: str, constraint: JsonSchema,
    prepared: Any,
) -> list[ComparedText]:  # fmt: skip
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
    texts: list[ComparedText] = []
    for source, data in instances:
        for name, separators, ascii_only in forms:
            written = json.dumps(data, separators=separators, ensure_ascii=ascii_only)
            texts.append(ComparedText(source, name, written, data, None, separators, ascii_only))
            if mode == "generation":
                ordered = json.dumps(schema_ordered(data, prepared), separators=separators, ensure_ascii=ascii_only)
                texts.append(ComparedText(source, f"{name}, schema order", ordered, data, None, separators, ascii_only))
    name, separators, ascii_only = forms[0]
    for source, data in mutated:
        written = json.dumps(schema_ordered(data, prepared), separators=separators, ensure_ascii=ascii_only)
        texts.append(ComparedText(source, f"{name}, schema order", written, data, None, separators, ascii_only))
    if base is not None:
        written = json.dumps(schema_ordered(base, prepared), separators=separators, ensure_ascii=ascii_only)
        for label, text in text_mutations(written):
            texts.append(ComparedText(f"mutation: {label}", "text", text, None, written))
    unique: dict[str, ComparedText] = {}
    for t in texts:
        unique.setdefault(t.text, t)
    return list(unique.values())
