"""Writes guarantees.md at build time (mkdocs-gen-files): what happens to each JSON Schema keyword, measured.

Every row comes from :mod:`constrain.testing.guarantees`, which compiles one example per keyword in each
mode and tests the result on instances, so the page cannot drift from the code.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import mkdocs_gen_files

from constrain.testing.guarantees import (
    MODE_ORDER,
    STATUSES,
    TOKENIZER,
    VOCABULARIES,
    FormatRow,
    Row,
    format_rows,
    keyword_rows,
)

INTRO = """\
# Guarantees

For every keyword of JSON Schema draft 2020-12, this page says what constrain does with it. The tables
are generated when the documentation is built: each keyword's example schema is compiled with
`constrain.compile` (the {tokenizer} tokenizer, the default engine), its status is read from
`compiled.coverage`, and the example's instances are fed through a matcher token by token: a keyword shown
as enforced ("grammar" or "value check") has been seen to refuse an instance that breaks it.

## What the statuses mean

- **grammar**: the grammar the engine compiles expresses the keyword exactly. At each decoding step
  the token mask allows only tokens that keep the output inside the grammar, so the model cannot
  write a value that breaks it.
- **value check**: the grammar cannot express the keyword (`uniqueItems`, `not`, `if`/`then`/`else`,
  `multipleOf` on decimals, ...), so it admits a superset there, and the matcher follows the output
  value by value. The token that would *complete* a value (a string's closing quote, a number's end,
  an item's `,` or `]`, an object's `}`, the end of the output) is masked out when the completed
  value would break the schema, so the model writes another value instead. This is still enforced
  during decoding, by the same mask; it only acts at value boundaries. Where the grammar has led to a
  point from which no valid value can be completed (a *dead end*), the mask keeps the grammar's
  tokens and the result reports the violation.
- **validated afterwards**: not enforced while decoding; the finished output is validated and a
  violation is reported in the result, never passed silently.
- **approximated**: only with `json_schema(..., lenient=True)`: a keyword that can be neither enforced
  nor checked is accepted, the grammar admits any value in its place, and `compiled.coverage` lists it
  as `"approximated"`.
- **ignored**: the keyword does not change which outputs are valid (annotations such as `title`, or
  keywords draft 2020-12 does not define).
- **refused**: in the default strict mode, compiling raises `UnsupportedSchemaError` (or `SchemaError`
  for a schema that is not valid draft 2020-12); the message names the keyword and its JSON pointer.
  The note says whether `lenient=True` approximates it instead.

Every finished output is also validated against the schema as written (`compiled.validate(text)`,
formats included), so a violation of any kind is reported in the result.

## The two modes

`constrain.json_schema(schema, mode=...)` reads a schema in one of two modes:

- **specification** (`mode="specification"`): the schema exactly as JSON Schema defines it: keys in any
  order, undeclared keys allowed where the schema does not forbid them, whitespace between tokens.
- **generation** (the default, and what `generate`, streaming, the server and the CLI use): objects that
  declare their `properties` take no other keys unless the schema says what else may appear
  (`additionalProperties`, `patternProperties`, `unevaluatedProperties`, `dependentSchemas`, `if`),
  keys come in the schema's order, and the text is formatted as `json.dumps` formats it.

## Summary

{summary}
"""

FORMATS_INTRO = """\
## Formats

constrain asserts `format`, which draft 2020-12 treats as an annotation by default. Where the grammar
has a pattern for a format, it enforces it; where the checker behind the value checks knows a format,
the value check also catches what the pattern lets through (such as February 31st). A format neither
knows is not asserted.

| format | specification mode | generation mode | note |
|---|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    return f"`{_cell(json.dumps(value, ensure_ascii=False))}`"


def _summary(rows: list[Row]) -> str:
    counts = {mode: collections.Counter(row.status[mode] for row in rows) for mode in MODE_ORDER}
    lines = ["| status | meaning | " + " | ".join(f"{mode} mode" for mode in MODE_ORDER) + " |", "|---|---|---|---|"]
    for status, meaning in STATUSES.items():
        lines.append(f"| {status} | {meaning} | " + " | ".join(str(counts[m][status]) for m in MODE_ORDER) + " |")
    return f"{len(rows)} keywords.\n\n" + "\n".join(lines) + "\n"


def _keyword_table(rows: list[Row]) -> str:
    lines = ["| keyword | example | specification mode | generation mode | note |", "|---|---|---|---|---|"]
    for row in rows:
        statuses = " | ".join(row.status[mode] for mode in MODE_ORDER)
        lines.append(f"| `{row.keyword}` | {_code(row.example.schema)} | {statuses} | {_cell(row.note)} |")
    return "\n".join(lines) + "\n"


def _format_table(rows: list[FormatRow]) -> str:
    return "".join(
        f"| `{row.name}` | " + " | ".join(row.status[mode] for mode in MODE_ORDER) + f" | {_cell(row.note)} |\n"
        for row in rows
    )


def page() -> str:
    """The whole page, in Markdown."""
    rows = keyword_rows()
    parts = [INTRO.replace("{tokenizer}", TOKENIZER).replace("{summary}", _summary(rows))]
    titles = {vocabulary: f"Vocabulary: {vocabulary}" for vocabulary in VOCABULARIES}
    titles["compatibility"] = "Kept for compatibility (in the draft 2020-12 metaschema, in no vocabulary)"
    for vocabulary, title in titles.items():
        chosen = [row for row in rows if row.vocabulary == vocabulary]
        if chosen:
            parts.append(f"## {title}\n\n{_keyword_table(chosen)}")
    parts.append(FORMATS_INTRO + _format_table(format_rows()))
    return "\n".join(parts)


with mkdocs_gen_files.open("guarantees.md", "w") as f:
    f.write(page())
