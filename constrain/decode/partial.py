"""Typed partial values while streaming JSON: which values are complete, and the value so far.

:class:`PartialJson` is fed the text of a JSON value piece by piece (a stream's deltas) and says, for
each piece, which values became complete in it, as RFC 6901 JSON pointers (``"/items/0/name"``; ``""``
is the whole value). It reads the text with :mod:`constrain.jsonscan`, each character once, and keeps
only the open containers and the text of the token being written, so a whole stream costs
O(characters), with no re-parse. A value is complete:

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
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from constrain.constraints.schema_refs import pointer_token
from constrain.jsonscan import START

__all__ = ["PartialJson", "resolve"]

_MISSING: Any = object()
"""No value (distinct from JSON null)."""


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
        self._scan = START
        self._stack: list[_Frame] = []  # the open containers, outermost first
        self._done: list[str] = []  # the pointers completed by the piece being fed
        self._root: Any = _MISSING  # the whole value, once complete
        self._adapters: dict[Any, pydantic.TypeAdapter[Any]] = {}  # per member type; goes with this parser
        self._events = _Events(self)

    def feed(self, text: str, *, final: bool = False) -> tuple[str, ...]:
        """Take the next piece of the text; return the pointers of the values it completed (innermost
        first, in text order). ``final``: the text ends here, so a top-level number or literal completes.
        Raises ValueError (:class:`~constrain.jsonscan.JsonSyntaxError`) when the text so far is not the
        start of one JSON value."""
        self._done = []
        self._scan = self._scan.feed(text.encode(), self._events)
        if final:
            self._scan = self._scan.end(self._events)
        return tuple(self._done)

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

    # -- the scan's events (through _Events) -------------------------------------------------------
    def _open(self, is_object: bool) -> None:
        if self._stack:
            parent = self._stack[-1]
            pointer = f"{parent.pointer}/{pointer_token(parent.open_key)}"
            node = parent.node.child(parent.open_key, is_object)
        else:
            pointer, node = "", self._node(self.python_type, is_object)
        self._stack.append(_Frame(pointer, {} if is_object else [], node))

    def _close(self) -> None:
        frame = self._stack.pop()
        self._complete(frame.raw, frame.pointer)

    def _key(self, text: bytes) -> None:
        self._stack[-1].key = json.loads(text)

    def _leaf(self, text: bytes) -> None:
        try:
            raw = json.loads(text)
        except ValueError as err:
            raise ValueError(f"not a JSON string, number or literal: {text.decode(errors='replace')!r}") from err
        self._complete(raw)

    def _complete(self, raw: Any, pointer: str | None = None) -> None:
        """A value is complete: add it to its container (or make it the root)."""
        if not self._stack:
            self._done.append("")
            self._root = raw if self.python_type is None else self._validate(self.python_type, raw)
            return
        parent = self._stack[-1]
        key = parent.open_key
        self._done.append(pointer if pointer is not None else f"{parent.pointer}/{pointer_token(key)}")
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


class _Events:
    """The scan's events (:class:`~constrain.jsonscan.JsonEvents`), passed to their parser."""

    __slots__ = ("close", "key", "open", "value")

    def __init__(self, parser: PartialJson) -> None:
        self.open, self.close, self.key, self.value = parser._open, parser._close, parser._key, parser._leaf


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
