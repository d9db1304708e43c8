"""constrain's peers on the same transformers model, for the benchmarks (bench/termination.py, bench/e2e.py).

- transformers ``generate`` with a logits processor: xgrammar's ``xgrammar.contrib.hf.LogitsProcessor``,
  or :class:`LlguidanceProcessor` (llguidance 1.9 ships tokenizer and bitmask helpers, ``llguidance.hf``
  and ``llguidance.torch``, but no transformers logits processor);
- Outlines' ``Generator`` (its output types, :func:`outlines_type`);
- each peer's grammar for a constrain constraint (:func:`xgrammar_grammar`, :func:`llguidance_grammar`),
  so that every system runs the same constraint, at the peer's defaults or, for JSON schemas, at its best
  setting (``compact=True``: :data:`COMPACT_JSON`);
- :class:`Meter`: counts ``model.forward`` calls and keeps the tokens ``model.generate`` returns.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Collection
from typing import Any

import torch

import constrain
from constrain.backends.xgrammar import choice_ebnf
from constrain.sampler.ops.bitmask import apply_token_bitmask_inplace

gen = importlib.import_module("constrain.generation")

COMPACT_JSON: dict[str, dict[str, Any]] = {
    "xgrammar": {"any_whitespace": False, "separators": (",", ":")},  # GrammarCompiler.compile_json_schema
    "llguidance": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},  # JsonCompileOptions
    "outlines": {"whitespace_pattern": ""},  # outlines.types.JsonSchema (its outlines_core backend)
}
"""Each peer's best JSON-schema setting, as keyword arguments of the call named in the comment: compact JSON
(``{"a":[1,2]}``), no whitespace the model may choose. Their defaults let it choose: xgrammar and llguidance any
run of whitespace between two JSON tokens, Outlines one optional space (``[ ]?``). Only JSON schemas have
the setting: for a regex, a choice or a grammar the best setting is the default."""


def prompt_ids(handle: constrain.ModelHandle, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids, exactly those ``constrain.generation`` feeds the model."""
    return gen.prompt_ids(handle, messages)


def new_tokens(handle: constrain.ModelHandle, output: torch.Tensor, prompt_length: int) -> list[list[int]]:
    """Per row of ``generate``'s output, the generated ids without EOS (and the padding after it)."""
    return [[t for t in row if t not in handle.eos_token_ids] for row in output[:, prompt_length:].tolist()]


def hf_generate(
    handle: constrain.ModelHandle,
    ids: list[int],
    *,
    batch: int = 1,
    max_new_tokens: int,
    processor: Any = None,
    **kwargs: Any,
) -> list[list[int]]:
    """transformers ``generate`` on ``batch`` copies of the prompt ``ids``, with ``processor`` if given;
    ``kwargs`` go to ``generate`` (sampling, ``eos_token_id``...). Returns each row's new ids (no EOS)."""
    inputs = torch.tensor([ids] * batch)
    output = handle.model.generate(
        inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
        logits_processor=[processor] if processor is not None else None, pad_token_id=handle.eos_token_ids[0],
        **kwargs,
    )  # fmt: skip
    return new_tokens(handle, output, inputs.shape[1])


def json_options(peer: str, compact: bool) -> dict[str, Any]:
    """``peer``'s JSON-schema keyword arguments: :data:`COMPACT_JSON`'s if ``compact``, else none (its defaults)."""
    return COMPACT_JSON[peer] if compact else {}


def xgrammar_compiler(handle: constrain.ModelHandle) -> Any:
    """An ``xgrammar.GrammarCompiler`` for the model's tokenizer (builds its vocabulary: ~1 s)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(handle.tokenizer, vocab_size=handle.vocab_size)
    return xgr.GrammarCompiler(info)


def xgrammar_grammar(compiler: Any, constraint: constrain.Constraint, *, compact: bool = False) -> Any:
    """xgrammar's compiled grammar for ``constraint``, with xgrammar's default settings (``compact``: a JSON
    schema's with :data:`COMPACT_JSON`)."""
    if isinstance(constraint, constrain.JsonSchema):
        return compiler.compile_json_schema(constraint.schema, **json_options("xgrammar", compact))
    if isinstance(constraint, constrain.Regex):
        return compiler.compile_regex(constraint.pattern)
    if isinstance(constraint, constrain.Grammar):
        return compiler.compile_grammar(constraint.ebnf)
    return compiler.compile_grammar(choice_ebnf(constraint.options))


def xgrammar_processor(grammar: Any) -> Any:
    """A fresh logits processor for one ``generate`` call (xgrammar's can be used only once)."""
    import xgrammar.contrib.hf

    return xgrammar.contrib.hf.LogitsProcessor(grammar)


def llguidance_tokenizer(handle: constrain.ModelHandle) -> Any:
    """llguidance's tokenizer for the model (~1 s)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(handle.tokenizer, n_vocab=handle.vocab_size)


def llguidance_grammar(constraint: constrain.Constraint, *, compact: bool = False) -> str:
    """llguidance's grammar for ``constraint`` (EBNF through its GBNF converter; ``compact``: a JSON schema's
    with :data:`COMPACT_JSON`); ``ValueError`` if it cannot convert it."""
    import llguidance

    if isinstance(constraint, constrain.JsonSchema):
        options = json_options("llguidance", compact) or None
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.schema, overrides=options)
    if isinstance(constraint, constrain.Regex):
        return llguidance.grammar_from("regex", constraint.pattern)
    if isinstance(constraint, constrain.Grammar):
        return llguidance.grammar_from("gbnf", constraint.ebnf)
    return llguidance.grammar_from("choice", json.dumps(list(constraint.options)))


def llguidance_checked_grammar(tokenizer: Any, constraint: constrain.Constraint, *, compact: bool = False) -> str:
    """:func:`llguidance_grammar`, checked by building a matcher (llguidance compiles lazily, as masks are
    asked); ``ValueError`` if llguidance refuses it."""
    import llguidance

    grammar = llguidance_grammar(constraint, compact=compact)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return grammar


class LlguidanceProcessor:
    """A transformers logits processor over llguidance matchers, one per row of the batch.

    The first call sees the prompt; each later call first feeds every row's last token to its matcher.
    A row whose last token was an EOS id in ``eos`` has ended (``generate`` pads it from then on): it is
    fed nothing more and left unmasked. Use once per ``generate`` call.
    """

    def __init__(self, tokenizer: Any, grammar: str, eos: Collection[int]) -> None:
        self.tokenizer, self.grammar, self.eos = tokenizer, grammar, frozenset(eos)
        self.matchers: list[Any] = []
        self.ended: list[bool] = []
        self.mask = torch.empty(0, dtype=torch.int32)  # [batch, ceil(vocab / 32)], allocated by the first call

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import llguidance

        if not self.matchers:
            self.matchers = [llguidance.LLMatcher(self.tokenizer, self.grammar) for _ in range(input_ids.shape[0])]
            self.ended = [False] * len(self.matchers)
            self.mask = torch.full((len(self.matchers), (scores.shape[1] + 31) // 32), -1, dtype=torch.int32)
        else:
            for row, matcher in enumerate(self.matchers):
                if not self.ended[row]:
                    token = int(input_ids[row, -1])
                    matcher.consume_token(token)
                    self.ended[row] = token in self.eos
        for row, matcher in enumerate(self.matchers):
            if self.ended[row]:
                self.mask[row] = -1
            else:
                matcher.unsafe_compute_mask_ptr(self.mask[row].data_ptr(), self.mask.shape[1] * 4)
        apply_token_bitmask_inplace(scores, self.mask)
        return scores


def outlines_type(constraint: constrain.Constraint, *, compact: bool = False) -> Any:
    """Outlines' output type for ``constraint`` (its default backends: outlines_core for JSON Schema and
    regexes, llguidance for grammars; ``compact``: a JSON schema's with :data:`COMPACT_JSON`)."""
    import outlines
    import outlines.types

    if isinstance(constraint, constrain.JsonSchema):
        return outlines.types.JsonSchema(constraint.schema, **json_options("outlines", compact))
    if isinstance(constraint, constrain.Regex):
        return outlines.regex(constraint.pattern)
    if isinstance(constraint, constrain.Grammar):
        return outlines.cfg(constraint.ebnf)
    return outlines.types.Choice(list(constraint.options))


class Meter:
    """While entered: counts the model's forward passes (``forwards``) and keeps the new ids of every
    ``model.generate`` call (``generated``, one list per row, without EOS). Meters nest."""

    def __init__(self, handle: constrain.ModelHandle) -> None:
        self.handle = handle
        self.forwards = 0
        self.generated: list[list[int]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> Meter:
        model = self.handle.model
        self._saved = {name: model.__dict__.get(name) for name in ("forward", "generate")}
        forward, generate = model.forward, model.generate

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.forwards += 1
            return forward(*args, **kwargs)

        def kept(*args: Any, **kwargs: Any) -> Any:
            output = generate(*args, **kwargs)
            inputs = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.generated += new_tokens(self.handle, output, inputs.shape[1])
            return output

        model.forward, model.generate = counted, kept
        return self

    def __exit__(self, *exc: object) -> None:
        for name, value in self._saved.items():  # an outer meter's wrapper, or the class's method
            if value is None:
                delattr(self.handle.model, name)
            else:
                setattr(self.handle.model, name, value)
