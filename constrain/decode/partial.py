"""Typed partial values while streaming JSON: which values are complete, and the value so far.

:class:`PartialJson` is fed the text of a JSON value piece by piece (a stream's deltas) and says, for
each piece, which values became complete in it, as RFC 6901 JSON pointers (``"/items/0/name"``; ``""``
is the whole value). It scans each character once and keeps only the open containers and the text of
the token being written, so a whole stream costs O(characters), with no re-parse. A value is complete:

- a string at its closing quote, an object or array at its closing bracket;
- a number, ``true``, ``false`` or ``null`` once a character after it is written (``12`` may still
  become ``123``), or, for a top-level one, when the caller says the text is final.

Pointers of one feed come innermost first, in text order (``{"a": 1}`` completes ``/a``, then ``""``);
each value completes exactly once. Keys are decoded (``\\"``, ``\\u00e9``) and escaped as RFC 6901 says
(``~`` as ``~0``, ``/`` as ``~1``).

:attr:`PartialJson.value` is the value so far, built from the complete values only (a string or number
being written is left out), with every container still open on the way to the one being written:

- no Python type (a JSON Schema dict): the JSON value itself, restricted so;
- a Pydantic model: an instance whose complete fields are validated (by the model's own validator, as
  an assignment: field validators and the field's constraints apply) and whose other fields are None
  (defaults are not filled in while the object is open; ``model_fields_set`` names the complete
  fields); a nested model being written is such a partial instance itself, a list being written holds
  its complete items, each validated as the item type; JSON keys are the fields' aliases;
- any other type (``list[int]``, ``dict[str, Model]``, ``tuple[A, B]``): containers being written hold
  their complete members, each validated as its declared type; unions, dataclasses and the like hold
  the JSON value until they complete;
- once the whole value is complete: the value validated as the type (``TypeAdapter.validate_python``),
  model validators included, as :class:`~constrain.results.GenerationResult` would give it.

A complete member that fails validation (a model validator that rejects a half-built object, say) keeps
its JSON value: the final result reports the violation. :func:`resolve` reads the value at a pointer.

A stream (:func:`constrain.stream`) feeds each answer delta of a ``schema=`` request to one of these:
``StreamEvent.completed`` holds the pointers each event completed and ``StreamEvent.value`` the value
after it; the last event (at the finish) passes ``final``. Servers turn it off with ``InFlight.partials``.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from constrain.constraints.schema_refs import pointer_token

__all__ = ["PartialJson", "resolve"]

_MISSING: Any = object()
"""No value (distinct from JSON null)."""

_WHITESPACE = frozenset(" \t\n\r")
_DELIMITERS = frozenset(" \t\n\r,]}")  # what may follow a number or a literal
_SCALAR_START = frozenset("-0123456789tfn")
_STRING_STOP = re.compile(r'["\\]')

# what the next character may be (outside a token)
_VALUE, _FIRST_ITEM, _KEY, _FIRST_KEY, _COLON, _AFTER = range(6)
# inside a token
_STRING, _KEY_STRING, _SCALAR = range(6, 9)


class PartialJson:
    """The JSON value being streamed, as complete pointers and a (typed) partial value.

    Parameters
    ----------
    python_type : Any, default: None
        The Pydantic model or type the value should be (``JsonSchema.python_type``); None for a value
        described by a JSON Schema only (no validation).
    """

    def __init__(self, python_type: Any = None) -> None:
        self.python_type = python_type
        self._stack: list[_Frame] = []  # the open containers, outermost first
        self._state = _VALUE
        self._token: list[str] = []  # the text of the string, key or scalar being written
        self._escaped = False  # inside a string, after a backslash
        self._root: Any = _MISSING  # the whole value, once complete
        self._adapters: dict[Any, pydantic.TypeAdapter[Any]] = {}  # per member type; goes with this parser

    def feed(self, text: str, *, final: bool = False) -> tuple[str, ...]:
        """Take the next piece of the text; return the pointers of the values it completed (innermost
        first, in text order). ``final``: the text ends here, so a top-level number or literal completes.
        Raises ValueError when the text so far is not the start of one JSON value."""
        completed: list[str] = []
        i = 0
        while i < len(text):
            i = self._step(text, i, completed)
        if final and self._state == _SCALAR and not self._stack:
            self._complete(self._scalar(), completed)
        return tuple(completed)

    @property
    def done(self) -> bool:
        """Whether the whole value is complete."""
        return self._root is not _MISSING

    @property
    def value(self) -> Any:
        """The value so far (see the module docstring); None before any of it is written. Each read
        builds a new object (the open containers are copied; complete members are shared): O(members of
        the open containers)."""
        if self._root is not _MISSING:
            return self._root
        child = _MISSING
        for frame in reversed(self._stack):
            child = frame.node.snapshot(frame.raw, frame.open_key, child)
        return None if child is _MISSING else child

    def _step(self, text: str, i: int, done: list[str]) -> int:
        """Consume ``text`` from index ``i``; return the index of the next character to read."""
        state, c = self._state, text[i]
        if state in (_STRING, _KEY_STRING):
            if self._escaped:
                self._token.append(c)
                self._escaped = False
                return i + 1
            stop = _STRING_STOP.search(text, i)
            if stop is None:  # the whole rest is string content
                self._token.append(text[i:])
                return len(text)
            end = stop.end()
            self._token.append(text[i:end])
            if stop.group() == "\\":
                self._escaped = True
            elif state == _KEY_STRING:
                self._stack[-1].key = self._decode()
                self._state = _COLON
            else:
                self._complete(self._decode(), done)
            return end
        if state == _SCALAR:
            if c not in _DELIMITERS:
                self._token.append(c)
                return i + 1
            self._complete(self._scalar(), done)  # then read the delimiter after the value
            return i
        if c in _WHITESPACE:
            return i + 1
        if state in (_VALUE, _FIRST_ITEM):
            if c == "]" and state == _FIRST_ITEM:
                self._close(done)
            elif c in "{[":
                self._open(c == "{")
            elif c == '"':
                self._token, self._state = ['"'], _STRING
            elif c in _SCALAR_START:
                self._token, self._state = [c], _SCALAR
            else:
                raise self._error(c)
        elif state in (_KEY, _FIRST_KEY):
            if c == "}" and state == _FIRST_KEY:
                self._close(done)
            elif c == '"':
                self._token, self._state = ['"'], _KEY_STRING
            else:
                raise self._error(c)
        elif state == _COLON and c == ":":
            self._state = _VALUE
        elif state == _AFTER and self._stack:
            is_object = isinstance(self._stack[-1].raw, dict)
            if c == ",":
                self._state = _KEY if is_object else _VALUE
            elif c == ("}" if is_object else "]"):
                self._close(done)
            else:
                raise self._error(c)
        else:
            raise self._error(c)
        return i + 1

    def _error(self, c: str) -> ValueError:
        return ValueError(f"not the start of a JSON value: unexpected {c!r}")

    def _decode(self) -> Any:
        return json.loads("".join(self._token))

    def _scalar(self) -> Any:
        try:
            return self._decode()
        except ValueError as err:
            raise ValueError(f"not a JSON number or literal: {''.join(self._token)!r}") from err

    def _open(self, is_object: bool) -> None:
        if self._stack:
            parent = self._stack[-1]
            pointer = f"{parent.pointer}/{pointer_token(parent.open_key)}"
            node = parent.node.child(parent.open_key, is_object)
        else:
            pointer, node = "", self._node(self.python_type, is_object)
        self._stack.append(_Frame(pointer, {} if is_object else [], node))
        self._state = _FIRST_KEY if is_object else _FIRST_ITEM

    def _close(self, done: list[str]) -> None:
        frame = self._stack.pop()
        self._complete(frame.raw, done, frame.pointer)

    def _complete(self, raw: Any, done: list[str], pointer: str | None = None) -> None:
        """A value is complete: add it to its container (or make it the root)."""
        self._state = _AFTER
        if not self._stack:
            done.append("")
            self._root = raw if self.python_type is None else self._validate(self.python_type, raw)
            return
        parent = self._stack[-1]
        key = parent.open_key
        done.append(pointer if pointer is not None else f"{parent.pointer}/{pointer_token(key)}")
        parent.node.add(key, raw)
        if isinstance(parent.raw, dict):
            assert isinstance(key, str)
            parent.raw[key] = raw
            parent.key = None
        else:
            parent.raw.append(raw)

    def _validate(self, tp: Any, raw: Any) -> Any:
        """``raw`` validated as ``tp``, or ``raw`` itself where that fails."""
        try:
            return self._adapter(tp).validate_python(raw)
        except Exception:  # a validator's own error on this value (or a type Pydantic cannot validate)
            return raw

    def _adapter(self, tp: Any) -> pydantic.TypeAdapter[Any]:
        try:
            adapter = self._adapters.get(tp)
        except TypeError:  # an unhashable annotation: not cached
            return pydantic.TypeAdapter(tp)
        if adapter is None:
            adapter = self._adapters[tp] = pydantic.TypeAdapter(tp)
        return adapter

    def _node(self, tp: Any, is_object: bool) -> _Node:
        """How a container declared as ``tp`` shows while it is being written."""
        tp = _unwrap(tp)
        origin = typing.get_origin(tp) or tp
        args = typing.get_args(tp)
        if not isinstance(origin, type) or origin in (str, bytes):
            return _MembersNode(self, is_object, None)
        if issubclass(origin, pydantic.RootModel):
            return self._node(origin.model_fields["root"].annotation, is_object)
        if is_object and issubclass(origin, pydantic.BaseModel):
            return _ModelNode(self, origin)
        if is_object and issubclass(origin, Mapping):
            return _MembersNode(self, True, lambda key: args[1] if len(args) == 2 else Any)
        if not is_object and origin is tuple and args and args[-1] is not Ellipsis:
            return _MembersNode(self, False, lambda index: args[index] if index < len(args) else Any)
        if not is_object and issubclass(origin, Sequence | set | frozenset):
            return _MembersNode(self, False, lambda index: args[0] if args else Any)
        return _MembersNode(self, is_object, None)


def _unwrap(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and without ``None`` in a union (an open container is not None)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return tp


@dataclass(eq=False)
class _Frame:
    """One open container."""

    pointer: str
    raw: dict[str, Any] | list[Any]  # its complete members, as JSON
    node: _Node
    key: str | None = None  # an object's: the key of the member being written, once the key is complete

    @property
    def open_key(self) -> str | int:
        """The key or index of the member being written (or next)."""
        if isinstance(self.raw, list):
            return len(self.raw)
        return self.key if self.key is not None else ""


class _Node(typing.Protocol):
    """The typed side of one open container."""

    def add(self, key: Any, raw: Any) -> None:
        """Member ``key`` is complete, with JSON value ``raw``."""

    def child(self, key: Any, is_object: bool) -> _Node:
        """The node of member ``key``, a container that opens."""

    def snapshot(self, raw: dict[str, Any] | list[Any], key: Any, child: Any) -> Any:
        """The partial value, with ``child`` (or ``_MISSING``) as the member being written at ``key``."""


class _MembersNode:
    """A list, tuple, set or dict: its complete members, each validated as ``member_type(key)``; with
    ``member_type`` None (no type, or one shown as JSON until complete), the members' JSON values."""

    def __init__(self, owner: PartialJson, is_object: bool, member_type: Callable[[Any], Any] | None) -> None:
        self.owner, self.member_type = owner, member_type
        self.members: dict[str, Any] | list[Any] = {} if is_object else []  # validated (with member_type)

    def add(self, key: Any, raw: Any) -> None:
        if self.member_type is None:
            return
        value = self.owner._validate(self.member_type(key), raw)
        if isinstance(self.members, dict):
            self.members[key] = value
        else:
            self.members.append(value)

    def child(self, key: Any, is_object: bool) -> _Node:
        if self.member_type is None:
            return _MembersNode(self.owner, is_object, None)
        return self.owner._node(self.member_type(key), is_object)

    def snapshot(self, raw: dict[str, Any] | list[Any], key: Any, child: Any) -> Any:
        members = raw if self.member_type is None else self.members
        if isinstance(members, list):
            return list(members) if child is _MISSING else [*members, child]
        return dict(members) if child is _MISSING else {**members, key: child}


class _ModelNode:
    """A Pydantic model: an instance (built without validation, every field None) to which each
    complete field is assigned through the model's validator."""

    def __init__(self, owner: PartialJson, model: type[pydantic.BaseModel]) -> None:
        self.owner, self.model = owner, model
        self.names = _field_names(model)
        self.instance = model.model_construct(_fields_set=set(), **dict.fromkeys(model.model_fields))

    def add(self, key: Any, raw: Any) -> None:
        name = self.names.get(key)
        if name is None:  # not a field (extra="allow" and the like): left out
            return
        try:
            self.model.__pydantic_validator__.validate_assignment(self.instance, name, raw)
        except Exception:  # the field, or a model validator seeing the half-built object, said no
            self.instance.__dict__[name] = raw

    def child(self, key: Any, is_object: bool) -> _Node:
        name = self.names.get(key)
        if name is None:
            return _MembersNode(self.owner, is_object, None)
        return self.owner._node(self.model.model_fields[name].annotation, is_object)

    def snapshot(self, raw: dict[str, Any] | list[Any], key: Any, child: Any) -> Any:
        copy = self.instance.model_copy()  # model_fields_set: the complete fields
        name = self.names.get(key)
        if child is not _MISSING and name is not None:
            copy.__dict__[name] = child
        return copy


def _field_names(model: type[pydantic.BaseModel]) -> dict[str, str]:
    """JSON key -> field name: the key is the field's validation alias, else its alias, else its name
    (what ``model_json_schema()`` writes)."""
    names = {}
    for name, info in model.model_fields.items():
        alias = info.validation_alias if isinstance(info.validation_alias, str) else info.alias
        names[alias or name] = name
    return names


def resolve(value: Any, pointer: str) -> Any:
    """The part of ``value`` at RFC 6901 ``pointer`` (``""``: ``value`` itself): a mapping's key, a
    list's or tuple's index, a Pydantic model's field by its JSON key (its alias) or its name. Raises
    LookupError when there is none (ValueError for a pointer that does not start with ``/``)."""
    if pointer == "":
        return value
    if not pointer.startswith("/"):
        raise ValueError(f"a JSON pointer starts with '/': {pointer!r}")
    for token in pointer[1:].split("/"):
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, pydantic.BaseModel):
            name = _field_names(type(value)).get(key, key)
            if name not in type(value).model_fields:
                raise LookupError(f"{type(value).__name__} has no field {key!r} (in {pointer!r})")
            value = getattr(value, name)
        elif isinstance(value, Mapping):
            value = value[key]
        elif isinstance(value, Sequence) and not isinstance(value, str) and key.isdigit():
            value = value[int(key)]
        else:
            raise LookupError(f"nothing at {key!r} in {type(value).__name__} (in {pointer!r})")
    return value
