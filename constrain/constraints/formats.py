"""``format``: which names JSON Schema defines, which constrain can check, and the checker that does.

A ``format`` is one of three things here, decided when the schema compiles (:func:`format_status`):

- *checked*: a format draft 2020-12 defines and :data:`FORMATS` has a checker for: asserted (a value
  that does not match is refused, wherever the grammar does not enforce it already);
- *approximated*: a format the draft defines that no checker here can run (a checker's library is
  missing): refused in strict mode, accepted unchecked with ``lenient=True``;
- *ignored*: a name no draft of JSON Schema defines (``"int32"``, ``"textarea"``): an annotation, as the
  specification says of unknown formats; valid values never depend on it.
"""

from __future__ import annotations

from typing import Literal

import jsonschema
import regex

__all__ = ["DEFINED_FORMATS", "FORMATS", "format_status"]

DEFINED_FORMATS = (
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
)  # fmt: skip
"""The ``format`` values draft 2020-12 defines (section 7.3 of its validation specification), in its order."""

FORMATS = jsonschema.FormatChecker(formats=())
FORMATS.checkers = dict(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
"""Every format jsonschema checks in draft 2020-12, whatever the schema's draft: ``format`` is an
assertion here (a draft-04 schema saying ``"format": "date"`` means a date too). Not a bare
``FormatChecker()``: that one mixes the drafts, and its ``time`` is draft 3's (``12:00:00``, no
offset), which refuses the RFC 3339 times (``12:00:00Z``) the grammars' regexes require."""


@FORMATS.checks("iri", raises=ValueError)
def _is_iri(instance: object) -> bool:
    """IRIs need a GPL checker in jsonschema; this one asks for what every IRI has: a scheme."""
    return not isinstance(instance, str) or regex.match(r"[A-Za-z][A-Za-z0-9+.\-]*:", instance) is not None


def format_status(name: str) -> Literal["checked", "approximated", "ignored"]:
    """How a ``format`` of this name is treated (see the module docstring)."""
    if name in FORMATS.checkers:
        return "checked"
    return "approximated" if name in DEFINED_FORMATS else "ignored"
