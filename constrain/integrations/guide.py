"""One request guided from outside constrain's decode loop: another engine samples, constrain masks.

A serving engine (vLLM) or transformers' ``generate`` owns the model, the batch and the sampler; the
integrations give it, per request, a :class:`Guide` that follows the tokens it took and fills the
request's row of the token bitmask. The guide keeps what constrain's own loop guarantees that a mask
can give:

- the constraint, EOS only where the grammar can end (the :class:`~constrain.match.matcher.Matcher`, value
  checks included);
- termination within ``max_tokens``: the closing path (:func:`constrain.match.closing.completion`) is
  found again as the end nears (after as many tokens as half the gap between the tokens left and its
  length plus :data:`SLACK`, so every step near the threshold); within twice its length plus ``NEAR``
  of the end, where at most :data:`VET_TOKENS` tokens are allowed, each is kept only if a closing fits
  after it; and once the tokens left come down to its length plus :data:`SLACK` the mask allows only its
  next token. Unlike the loop's :class:`~constrain.match.budget.Budget`, which vets the sampled
  token, a mask cannot see it: where many tokens are allowed near the end, one that lengthens the
  closing path by more than ``SLACK`` tokens can still run the output past ``max_tokens``;
- the repetition guard (:class:`~constrain.match.repetition.RepetitionGuard`) for JSON and tool constraints.

Per-request arguments arrive as a mapping, or its JSON text (:func:`guide_spec`), so that a server's
string-valued extra arguments can carry a schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from constrain.compiler.compiler import compile
from constrain.constraints.constraint import Constraint, Grammar, JsonSchema, choice, grammar, json_schema, regex
from constrain.decode.request import GUARD_WINDOW
from constrain.match.bitmask import clear_bits, count_allowed, set_bits
from constrain.match.budget import NEAR, SEARCH_NODES, encodings
from constrain.match.closing import completion
from constrain.match.matcher import Matcher
from constrain.match.repetition import RepetitionGuard
from constrain.match.vocab import token_texts
from constrain.tools.calling import tool_calling

__all__ = [
    "CONSTRAINT_KEYS", "SLACK", "TAILS_KEPT", "VET_TOKENS", "Guide", "GuideSpec", "allow_only",
    "guide_spec",
]  # fmt: skip

CONSTRAINT_KEYS = ("json_schema", "regex", "grammar", "choices", "tools")
"""The keys that name a request's constraint: exactly one per request."""

_OPTIONS = {
    "mode", "whitespace", "tool_choice", "parallel_tool_calls", "tool_format", "close_in_budget", "repetition_guard"
}  # fmt: skip

SLACK = 16
"""The closing path is forced once the tokens left are at most its length plus this."""

VET_TOKENS = 8
"""Near the end, where at most this many tokens are allowed, each is kept only if a closing fits after it."""

TAILS_KEPT = 16
"""The guard's text is kept after each of the last this many tokens: a longer rollback rebuilds it."""


@dataclass(frozen=True, slots=True)
class GuideSpec:
    """What one request asks for: its constraint, and whether to keep it finishable within ``max_tokens``
    (``close_in_budget``, default True) and to stop repeated JSON items (``repetition_guard``, default True)."""

    constraint: Constraint
    close_in_budget: bool = True
    repetition_guard: bool = True


def guide_spec(args: Mapping[str, Any] | str) -> GuideSpec:
    """A request's :class:`GuideSpec` from its arguments: a mapping, or its JSON text.

    Exactly one of ``json_schema`` (a schema, or its JSON text), ``regex``, ``grammar`` (EBNF or a
    shipped grammar's name), ``choices`` (a list of strings) or ``tools`` (OpenAI tool definitions, or
    their JSON text; with ``tool_choice``, default "required", ``parallel_tool_calls``, default True,
    ``tool_format``, default "hermes"); options ``mode`` and ``whitespace`` (JSON schemas, as
    :func:`constrain.json_schema`), ``close_in_budget`` and ``repetition_guard`` (booleans, or 0/1).

    Raises
    ------
    ValueError
        Arguments that are not a mapping, unknown keys, none or several constraints, a bad option.
    ConstraintError
        A bad schema, regex, grammar, choice list or tool (also a ``ValueError``, except
        :class:`~constrain.errors.UnsupportedSchemaError`), naming the culprit.
    """
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as err:
            raise ValueError(f"constrain's request arguments are not valid JSON: {err}") from None
    if not isinstance(args, Mapping):
        raise ValueError(f"constrain's request arguments are a mapping (or its JSON text), got {type(args).__name__}")
    unknown = sorted(set(args) - set(CONSTRAINT_KEYS) - _OPTIONS)
    if unknown:
        raise ValueError(f"unknown constrain argument(s) {unknown}; known: {sorted((*CONSTRAINT_KEYS, *_OPTIONS))}")
    given = [key for key in CONSTRAINT_KEYS if key in args]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(CONSTRAINT_KEYS)}; got {given or 'none'}")
    key, value = given[0], args[given[0]]
    flags = {name: _flag(args, name) for name in ("close_in_budget", "repetition_guard")}
    return GuideSpec(_constraint(key, value, args), **flags)


def _flag(args: Mapping[str, Any], name: str) -> bool:
    value = args.get(name, True)
    if value not in (True, False, 0, 1):  # JSON booleans, or 0/1 where only numbers travel
        raise ValueError(f"{name} must be true or false (or 1 or 0), got {value!r}")
    return bool(value)


def _constraint(key: str, value: Any, args: Mapping[str, Any]) -> Constraint:
    if key == "json_schema":
        options = {name: args[name] for name in ("mode", "whitespace") if name in args}
        return json_schema(value, **options)
    if key == "regex":
        if not isinstance(value, str):
            raise ValueError(f"regex must be a string, got {type(value).__name__}")
        return regex(value)
    if key == "grammar":
        if not isinstance(value, str):
            raise ValueError(f"grammar must be EBNF text or a shipped grammar's name, got {type(value).__name__}")
        return grammar(value)
    if key == "choices":
        return choice(value)
    tools = json.loads(value) if isinstance(value, str) else value
    parallel = args.get("parallel_tool_calls", True)
    if parallel not in (True, False, 0, 1):
        raise ValueError(f"parallel_tool_calls must be true or false (or 1 or 0), got {parallel!r}")
    spec = tool_calling(
        tools, tool_choice=args.get("tool_choice", "required"), parallel_tool_calls=bool(parallel),
        format=args.get("tool_format", "hermes"),
    )  # fmt: skip
    constraint = spec.constraint()
    if constraint is None:
        raise ValueError('tool_choice "none" asks for no constraint: send the request without constrain arguments')
    return constraint


class Guide:
    """One request's masks, for an engine that samples elsewhere (see the module docstring).

    ``tokenizer``: the model's Hugging Face tokenizer; ``vocab_size``: the logits' width (a padded
    vocabulary included); ``eos_token_ids``: the ids that end this request; ``max_tokens``: its output
    budget, of which ``used`` (default 0) were spent before the guide's first token (a reasoning
    section). Compiling is cached and shared (:func:`constrain.compile`); raises what it raises
    (:class:`~constrain.errors.ConstraintError`). Not thread-safe: one request, one thread.
    """

    def __init__(
        self,
        spec: GuideSpec,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_tokens: int,
        used: int = 0,
    ) -> None:
        compiled = compile(spec.constraint, tokenizer, vocab_size=vocab_size, eos_token_ids=list(eos_token_ids))
        self.matcher: Matcher = compiled.matcher()
        self.tokenizer = tokenizer
        # a piece of text to the tokenizer's ids (no special tokens), kept across requests as the budget's are
        self._encode = encodings.encoder(compiled.tokenizer.fingerprint, self._encode_text)
        self.max_tokens = max_tokens
        self.used = used
        self.close_in_budget = spec.close_in_budget
        constraint = spec.constraint
        json_text = isinstance(constraint, JsonSchema) or (isinstance(constraint, Grammar) and constraint.embedded)
        guarded = spec.repetition_guard and bool(json_text)  # JSON, or tool calls
        self.guard = RepetitionGuard(compiled.tokenizer) if guarded else None
        self._texts = token_texts(compiled.tokenizer).texts  # per token id, its bytes
        self.eos = tuple(eos_token_ids)
        self.taken: list[int] = []  # the output tokens seen, in order
        self._tails: list[bytes] = [b""]  # the last GUARD_WINDOW bytes of the output after each of the last
        # TAILS_KEPT tokens (where the guard is on): what a rollback restores
        self.failed = False  # a token the matcher refused was taken: only EOS is allowed from then on
        self._plan: list[int] | None = None  # the closing path from the matcher's state, when known
        self._estimate = 0  # the closing path's length when last found
        self._found_at = -1  # how many tokens were taken when it was last looked for (-1: never)

    def accept(self, token: int) -> bool:
        """Take one output token: ``False`` (nothing changed) where the matcher refuses it. After EOS,
        tokens are taken unchecked (an engine may run on past it)."""
        token = int(token)
        if not self.matcher.is_terminated():
            if not self.matcher.accept_token(token):
                return False
            self._plan = self._plan[1:] if self._plan and self._plan[0] == token else None
        self.taken.append(token)
        if self.guard is not None:
            text = self._texts[token] if token < len(self._texts) else b""
            self._tails = [*self._tails[-TAILS_KEPT:], (self._tails[-1] + text)[-GUARD_WINDOW:]]
        return True

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` tokens taken (speculative decoding's drafts)."""
        if count <= 0:
            return
        if count > len(self.taken) or self.failed:
            raise ValueError(f"cannot roll back {count} of {len(self.taken)} tokens (failed: {self.failed})")
        kept = self.taken[:-count]
        accepted = self.matcher.num_accepted  # a prefix of ``taken``: tokens after an EOS never reached it
        self.matcher.rollback(accepted - min(accepted, len(kept)))
        self.taken, self._plan = kept, None
        self._found_at = min(self._found_at, len(kept))
        if self.guard is not None:
            if count < len(self._tails):
                self._tails = self._tails[:-count]
            else:  # past what was kept: from the tokens (most hold a byte or more: enough of them)
                tail = b"".join(self._texts[t] for t in kept[-GUARD_WINDOW:] if t < len(self._texts))
                self._tails = [tail[-GUARD_WINDOW:]]

    def advance(self, output_ids: Sequence[int]) -> None:
        """Follow the engine's output so far (the whole of it, prompt excluded): accept the tokens not seen
        yet. Where it is not an extension of what was seen (a beam reordered), start again from the top.
        A token the matcher refuses leaves the guide :attr:`failed` (EOS only from then on)."""
        seen = len(self.taken)
        if len(output_ids) < seen or list(output_ids[:seen]) != self.taken:
            self.matcher.reset()
            self.taken, self.failed, self._plan, seen = [], False, None, 0
            self._found_at = -1
            self._tails = [b""]
        for token in map(int, output_ids[seen:]):
            if token < 0:  # a placeholder for a token still being sampled (vLLM's async scheduling)
                break
            if self.failed or not self.accept(token):
                self.failed = True
                self.taken.append(token)

    @property
    def live(self) -> bool:
        """Whether the matcher fills this request's mask: no EOS taken, no token refused (else
        :meth:`restrict` alone writes it: EOS only)."""
        return not self.failed and not self.matcher.is_terminated()

    def fill(
        self,
        # [B, ceil(V / 32)] int32 on the CPU; row ``index`` is overwritten
        bitmask: torch.Tensor,
        index: int,
    ) -> None:
        """The whole of this request's row: the matcher's exact mask (value checks included), narrowed by
        :meth:`restrict`. Does not change the guide's state."""
        if self.live:
            self.matcher.fill_next_token_bitmask(bitmask, index)
        self.restrict(bitmask[index])

    def restrict(
        self,
        # [ceil(V / 32)] int32 on the CPU: this request's row, filled by the matcher; updated in place
        row: torch.Tensor,
    ) -> None:
        """Narrow the filled row (unfilled where the guide is not :attr:`live`): only EOS after a refused
        token or EOS; the closing path's next token near the end of the budget; no separator that repeats
        a JSON item again (the guard)."""
        if not self.live:
            allow_only(row, self.eos)
            return
        if self.close_in_budget:
            remaining = self.max_tokens - self.used - len(self.taken)
            plan = self._closing(remaining, few=count_allowed(row) <= VET_TOKENS)
            if plan is not None and remaining <= 2 * len(plan) + NEAR:
                self._vet(row, remaining)
            if plan is not None and (remaining <= len(plan) + SLACK or not row.any()):
                allow_only(row, plan[:1] or self.eos)
                return
        if self.guard is not None:
            self.guard.apply(self._tails[-1].decode("utf-8", "ignore"), row)

    def _vet(
        self,
        # [ceil(V / 32)] int32 on the CPU: the filled row; updated in place
        row: torch.Tensor,
        remaining: int,
    ) -> None:
        """Near the end, where at most :data:`VET_TOKENS` tokens are allowed, clear those after which no
        closing fits in the tokens left (a ``\\n`` that starts another tool call when the reply could end)."""
        words = row.numpy()  # a view: writes go to ``row``
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")  # [32 * ceil(V / 32)] uint8
        allowed = np.flatnonzero(bits).tolist()
        if len(allowed) > VET_TOKENS:
            return
        for token in allowed:
            if token in self.eos:
                continue
            probe = self.matcher.fork()
            after = (
                completion(probe, self._encode, max_tokens=remaining - 1, max_nodes=0)
                if probe.accept_token(token)
                else None
            )
            if after is None or len(after) > remaining - 1:
                clear_bits(words, [token])

    def _closing(self, remaining: int, *, few: bool) -> list[int] | None:
        """The closing path from here: kept while the output follows it; else found again (the greedy
        closing, then a search of ``SEARCH_NODES`` states) when it may soon be forced, or may be vetted
        against: once as many tokens were taken since it was last found as half the gap between the tokens
        left and its last length plus ``SLACK``, and at every step where ``few`` tokens are allowed (at most
        :data:`VET_TOKENS`) within twice its length plus ``NEAR`` of the end. None when not looked for, or
        not found."""
        if self._plan is not None:
            return self._plan
        gap = remaining - self._estimate - SLACK
        due = self._found_at < 0 or len(self.taken) - self._found_at >= max(1, gap // 2)
        if due or (few and remaining <= 2 * self._estimate + NEAR):
            room = 2 * remaining + 64
            self._plan = completion(self.matcher, self._encode, max_tokens=room, max_nodes=0)
            if self._plan is None:
                self._plan = completion(self.matcher, self._encode, max_tokens=room, max_nodes=SEARCH_NODES)
            if self._plan is not None:
                self._estimate = len(self._plan)
            self._found_at = len(self.taken)
        return self._plan

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def allow_only(
    # [ceil(V / 32)] int32 on the CPU: a mask row; overwritten
    row: torch.Tensor,
    tokens: Sequence[int],
) -> None:
    """Allow exactly ``tokens`` in ``row``."""
    row.zero_()
    set_bits(row, tokens)
