"""Tool calls that repeat an earlier call of the same reply: a per-request mask filter that forbids them.

A reply that may hold several calls (``tool_choice`` "auto" or "required" with ``parallel_tool_calls``)
should not call a tool twice with the same arguments, as small models do when they loop. A grammar
cannot say "not a call made before" (the earlier calls are the request's own state), so the decode
loop applies a :class:`RepeatedCallFilter` to each filled mask, as it applies the
:class:`~constrain.match.repetition.RepetitionGuard`:

- A token is forbidden when the text it adds completes a call (the closing brace of its arguments)
  whose name and arguments equal an earlier call's (arguments compared as JSON values: key order,
  whitespace and escapes aside).
- Where the mask is narrow (at most :data:`LOOKAHEAD` tokens: between calls, at a tool's name, after
  a value), the text the grammar forces after the token counts too. So the separator that could only
  lead to the same call again (the one tool, without arguments) is forbidden and the end of the
  calls stays open; so is a name whose arguments are all forced.
- Where the mask is wide (a string being written in a call of a tool called before), the tokens that
  may close the arguments are tried (those holding a ``"`` and a ``}``), and so are the tokens that
  close the string with a value some earlier call of that tool holds, each with the text the grammar
  forces after it: so the last string of a call cannot repeat an earlier call through the ``}`` forced
  after it.
- Where text is forced, the tokens within it are not filtered (nothing can be avoided there), but those
  that go on past it are: after ``{}``, where ``}`` is forced, ``},`` chooses the separator. A filter
  that would leave no token forbids nothing: the reply never reaches a dead end. What the filter cannot see it lets
  through: a started call whose every continuation repeats an earlier one through a choice (an enum
  whose values were all used), or through text forced after a wide mask where it ends a value other
  than a string (a number written at the end of a bound), is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.caches import bounded
from constrain.match.bitmask import clear_bits, unpack
from constrain.match.matcher import Matcher
from constrain.match.vocab import TOKENIZERS_KEPT, token_texts

__all__ = ["LOOKAHEAD", "RepeatedCallFilter"]

LOOKAHEAD = 64
"""A mask of at most this many tokens is filtered with the text the grammar forces after each token
(a matcher fork per token). A wider mask is a string's (elsewhere JSON allows a few tokens): there,
only the tokens holding a ``"`` and a ``}``, which may close the string and then the arguments, are
tried, without the forced text."""


class CallParser(Protocol):
    """What the filter needs of :class:`constrain.tools.parser.ToolCallParser`."""

    def feed(self, text: str) -> Any: ...

    def fork(self) -> CallParser: ...

    def complete_calls(self) -> list[tuple[str, str]]: ...

    def open_call(self) -> str | None: ...

    def open_arguments(self) -> str: ...


@dataclass(frozen=True, slots=True)
class _Pieces:
    raw: tuple[bytes, ...]  # per token id, its bytes
    skip: frozenset[int]  # special and EOS tokens: never filtered
    closers: np.ndarray  # [n] int64: the ids of the tokens whose text holds a '"' and a "}"
    quoted: np.ndarray  # [m] int64: the ids of the tokens whose text holds a '"'


@bounded("tools.repeats.pieces", maxsize=TOKENIZERS_KEPT)
def _pieces(info: TokenizerInfo) -> _Pieces:
    texts = token_texts(info)  # shared: reading the vocabulary out of the engine takes ~0.6 s
    raw = texts.pieces
    skip = texts.special | frozenset(info.eos_token_ids)
    quoted = np.array([t for t, piece in enumerate(raw) if b'"' in piece], dtype=np.int64)
    closers = np.array([t for t in quoted.tolist() if b"}" in raw[t]], dtype=np.int64)
    return _Pieces(raw, skip, closers, quoted)


_OPEN_STRING = re.compile(r'"(?:[^"\\]|\\.)*\Z', re.DOTALL)
"""The JSON string being written at the end of a call's arguments, from its opening quote."""


def _key(name: str, arguments: str) -> tuple[str, str]:
    """A call as compared: its name and its arguments as canonical JSON text (the raw text if not JSON)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return name, arguments
    return name, json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class RepeatedCallFilter:
    """Forbids the tokens that would complete a tool call identical to an earlier one of the same reply
    (see the module docstring). One per request; built by
    :meth:`constrain.tools.grammar.ToolGrammar.mask_filter`.

    ``feed(text)`` takes each piece of text the request generates; ``apply(matcher, text, row)``
    filters a filled mask. ``steps`` counts the masks it changed.
    """

    def __init__(self, parser: CallParser, tokenizer: TokenizerInfo) -> None:
        self.parser = parser  # fed the reply as it is generated
        self.tokenizer = tokenizer
        self.steps = 0
        self._keys: list[tuple[str, str]] = []  # of the parser's complete calls

    def feed(self, text: str) -> None:
        """Take the next piece of the reply's text."""
        self.parser.feed(text)

    def apply(
        self,
        matcher: Matcher,
        text: str,
        # [ceil(V / 32)] int32 on the CPU: the mask ``matcher`` filled; updated in place
        row: torch.Tensor,
    ) -> bool:
        """Clear from ``row`` the tokens that would complete a repeated call, unless nothing would be left.

        ``matcher`` is in the state ``row`` was filled in: the reply fed so far followed by ``text``
        (drafts not yet taken). Changes neither; returns whether it cleared any token.
        """
        parser = self.parser
        if text:
            parser = parser.fork()
            parser.feed(text)
        done = parser.complete_calls()
        if not done:
            return False
        seen = self._seen(done)
        bits = unpack(row)  # [32 * ceil(V / 32)] bool: token t's at t
        allowed = np.count_nonzero(bits)
        pieces = _pieces(self.tokenizer)
        forced = matcher.forced_text().encode()
        if allowed <= LOOKAHEAD:  # (where text is forced, a token within it makes no choice: not tried)
            tries = [
                (token, True)
                for token in np.flatnonzero(bits).tolist()
                if not (forced and token < len(pieces.raw) and forced.startswith(pieces.raw[token]))
            ]
        elif forced:
            return False
        else:
            name = parser.open_call()
            earlier = [arguments for called, arguments in seen if called == name]
            if not earlier:
                return False
            tries = [(token, False) for token in pieces.closers[bits[pieces.closers]].tolist()]
            quoted = pieces.quoted[bits[pieces.quoted]]  # [k] int64: allowed tokens holding a '"'
            tries += [(token, True) for token in _closing_seen_strings(parser, earlier, pieces, quoted)]
        banned = [
            token
            for token, lookahead in tries
            if token < len(pieces.raw)
            and token not in pieces.skip
            and self._repeats(parser, len(done), seen, matcher, pieces.raw[token], token, lookahead)
        ]
        if not banned or len(banned) == allowed:
            return False
        clear_bits(row, banned)
        self.steps += 1
        return True

    def _seen(self, done: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """The keys of ``done`` (the fed parser's calls, then any the drafts completed)."""
        fed = len(self.parser.complete_calls())
        if len(self._keys) < fed:
            self._keys += [_key(name, arguments) for name, arguments in done[len(self._keys) : fed]]
        return set(self._keys) | {_key(name, arguments) for name, arguments in done[fed:]}

    @staticmethod
    def _repeats(
        parser: CallParser,
        done: int,
        seen: set[tuple[str, str]],
        matcher: Matcher,
        piece: bytes,
        token: int,
        lookahead: bool,
    ) -> bool:
        """Whether ``piece`` (token ``token``'s bytes), and with ``lookahead`` the text forced after it,
        completes a call whose key is in ``seen`` (or that another one it completes repeats)."""
        text = piece.decode(errors="replace")
        if lookahead:
            probe = matcher.fork()
            if not probe.accept_token(token) or probe.is_terminated():
                return False
            text += probe.forced_text()
        trial = parser.fork()
        trial.feed(text)
        keys = set(seen)
        for name, arguments in trial.complete_calls()[done:]:
            key = _key(name, arguments)
            if key in keys:
                return True
            keys.add(key)
        return False


def _closing_seen_strings(
    parser: CallParser,
    earlier: list[str],
    pieces: _Pieces,
    # [k] int64: allowed token ids whose text holds a '"'
    quoted: np.ndarray,
) -> list[int]:
    """The ``quoted`` tokens that would close the string being written in the open call's arguments with a
    value one of the ``earlier`` arguments (canonical JSON text, :func:`_key`) holds: what a repeat of an
    earlier call needs (tried with the forced text after them); tokens sharing their text up to the quote
    are judged once."""
    open_string = _OPEN_STRING.search(parser.open_arguments())
    if open_string is None:
        return []
    verdicts: dict[bytes, bool] = {}
    found = []
    for token in quoted.tolist():
        head = pieces.raw[token].split(b'"', 1)[0]
        if head not in verdicts:
            try:
                value = json.loads(open_string[0] + head.decode(errors="replace") + '"')
            except ValueError:  # the quote is escaped, or the text is no string
                verdicts[head] = False
            else:
                literal = json.dumps(value, ensure_ascii=False)
                verdicts[head] = any(literal in arguments for arguments in earlier)
        if verdicts[head]:
            found.append(token)
    return found
