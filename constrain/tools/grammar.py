"""The grammar of a reply that may call tools: :func:`reply_grammar`, a :class:`ToolGrammar`.

The calls are written as their :class:`~constrain.tools.formats.ToolFormat` spells them; each call's
arguments follow its tool's JSON Schema through our strict grammar
(:func:`constrain.compiler.json_schema.json_schema_ebnf`). In ``"auto"`` replies, free text runs until
the format's trigger, after which the calls are enforced: xgrammar's structural tags compile this
into one grammar (:func:`constrain.backends.xgrammar.structural_tag_ebnf`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from xgrammar import structural_tag as st

from constrain.backends.tokenizer import TokenizerInfo
from constrain.backends.xgrammar import structural_tag_ebnf
from constrain.caches import bounded
from constrain.compiler.json_schema import json_schema_ebnf
from constrain.constraints.constraint import EmbeddedJson, Grammar, grammar
from constrain.tools.definitions import Tool
from constrain.tools.formats import CALL_END, CALL_OPEN, NAME_END, ToolFormat
from constrain.tools.parser import ToolCallParser
from constrain.tools.repeats import CallParser, RepeatedCallFilter

__all__ = ["ToolGrammar", "reply_grammar"]


@dataclass(frozen=True, slots=True)
class ToolGrammar(Grammar):
    """The grammar of a reply with tools (:func:`reply_grammar`): a :class:`Grammar` everywhere
    (compiled, validated, served the same), which also gives each request its repeated-call filter.

    ``call_parser`` makes a fresh parser of the reply for that filter; None where at most one call may
    come (no filter). It is not compared: requests whose grammars are equal share one compiled
    constraint, and the filter reads only what the grammar fixes (the format, the tool names, "auto"
    or not).
    """

    call_parser: Callable[[], CallParser] | None = field(default=None, compare=False, repr=False)

    def mask_filter(self, tokenizer: TokenizerInfo) -> RepeatedCallFilter | None:
        """A fresh :class:`~constrain.tools.repeats.RepeatedCallFilter` for one request (the decode loop asks
        every constraint that has this method), or None where at most one call may come."""
        if self.call_parser is None:
            return None
        return RepeatedCallFilter(self.call_parser(), tokenizer)


@bounded("tools.reply_grammar", maxsize=256)
def reply_grammar(tools: tuple[Tool, ...], format: ToolFormat, *, auto: bool, multiple: bool) -> ToolGrammar:
    """The grammar of a reply that calls ``tools`` (at least one), written in ``format``. Pure, memoized.

    Parameters
    ----------
    tools : tuple of Tool
        The tools the reply may call.
    format : ToolFormat
    auto : bool
        Free text first (without the format's trigger), then optionally the calls, which end the
        reply; False: the calls alone.
    multiple : bool
        One or more calls (with a filter against repeating one, :meth:`ToolGrammar.mask_filter`);
        False: exactly one.
    """
    one_call = st.OrFormat(
        elements=[
            st.SequenceFormat(
                elements=[
                    st.ConstStringFormat(value=t.name + NAME_END),
                    st.GrammarFormat(grammar=json_schema_ebnf(t.constraint)[0]),  # our strict grammar
                    st.ConstStringFormat(value=CALL_END),
                ]
            )
            for t in tools
        ]
    )
    more = st.SequenceFormat(elements=[st.ConstStringFormat(value=format.separator + CALL_OPEN), one_call])
    content = st.SequenceFormat(elements=[one_call, st.StarFormat(content=more)]) if multiple else one_call
    calls = st.TagFormat(begin=format.begin + CALL_OPEN, content=content, end=format.end)
    root: st.Format = calls
    if auto:
        root = st.TriggeredTagsFormat(triggers=[format.trigger], tags=[calls], stop_after_first=True)
    checked = grammar(structural_tag_ebnf(root))
    # the schemas as the checks read them (key order and a Python type aside: tools from a dict, a model
    # and a function that give one grammar share one compiled constraint)
    arguments = tuple(
        (
            t.name,
            replace(t.constraint, schema=json.dumps(json.loads(t.constraint.schema), sort_keys=True), python_type=None),
        )
        for t in tools
    )
    embedded = EmbeddedJson(format.trigger, CALL_OPEN, NAME_END, arguments)  # the arguments, checked as they complete
    # the filter's parser: "required" stands for any choice that makes the reply calls alone
    parser = functools.partial(ToolCallParser, tools, format, choice="auto" if auto else "required")
    return ToolGrammar(checked.ebnf, checked.name, embedded, call_parser=parser if multiple else None)
