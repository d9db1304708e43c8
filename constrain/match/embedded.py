"""JSON values embedded in text, checked as they are written: the state of a grammar's text that holds them.

A grammar's text may embed JSON values (tool calls' arguments, :class:`~constrain.constraints.EmbeddedJson`):
:class:`CallValues` follows the text between them only to find where the next one starts, and runs a
:class:`~constrain.match.values.ValueState` of that value's schema on each, so that each is checked
as :mod:`constrain.match.values` checks a whole document.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import regex
import torch

from constrain.backends.tokenizer import TokenizerInfo
from constrain.match.values import VIABLE, Checks, ValueState
from constrain.match.vocab import ValueVocab, value_vocab

__all__ = ["CallValues", "EmbeddedChecks"]


class EmbeddedChecks(Protocol):
    """What :class:`CallValues` asks of the checks of a text that embeds JSON values
    (:class:`constrain.match.checks.CallChecks`, which makes the initial state: it sits above this module)."""

    @property
    def trigger(self) -> bytes: ...  # the text after which values may appear

    @property
    def opener(self) -> regex.Pattern[bytes]: ...  # where a value starts; group 1: its name

    @property
    def checks(self) -> Mapping[str, Checks]: ...  # per name, the checks of its values

    @property
    def keep(self) -> int: ...  # bytes of text between values kept (an opener may span tokens)


@dataclass(frozen=True, slots=True)
class CallValues:
    """A text with embedded JSON values: the text around them is followed only to find where the next
    value starts (``calls.opener``, once ``calls.trigger`` has appeared); inside one, a
    :class:`ValueState` of its name's checks is ``inner``, and every call goes to it. Immutable."""

    calls: EmbeddedChecks
    vocab: ValueVocab
    started: bool = False  # the trigger has appeared
    tail: bytes = b""  # the end of the text since the last value (the trigger or an opener may span tokens)
    inner: ValueState | None = None  # the value being written

    @classmethod
    def initial(cls, calls: EmbeddedChecks, info: TokenizerInfo) -> CallValues:
        """The state before any output, for ``calls`` and a tokenizer."""
        return cls(calls, value_vocab(info))

    def advance(self, token_id: int, *, strict: bool = True) -> CallValues | None:
        """As :meth:`~constrain.match.values.ValueState.advance`."""
        return self.advance_bytes(self.vocab.texts[token_id], strict=strict)

    def advance_bytes(self, data: bytes, *, strict: bool = True) -> CallValues | None:
        """As :meth:`~constrain.match.values.ValueState.advance_bytes`."""
        calls, started, tail, inner = self.calls, self.started, self.tail, self.inner
        at = 0
        while at < len(data):
            if inner is None:  # between values: look for the next one's opener
                text = tail + data[at:]
                start = 0
                if not started:
                    start = text.find(calls.trigger)
                    started = start >= 0
                found = calls.opener.search(text, start) if started else None
                if found is None:
                    tail, at = text[-calls.keep :], len(data)
                    continue
                at += found.end() - len(tail)
                tail = b""
                checks = calls.checks.get(found.group(1).decode("utf-8", "replace"))
                if checks is None:  # a name the grammar would not have allowed
                    return None
                inner = ValueState(checks, self.vocab)
                continue
            scanned, read = inner.advance_value(data[at:], strict=strict)  # inside one: up to where it ends
            if scanned is None:
                return None
            at += read
            inner = None if scanned.finished else scanned
        return CallValues(calls, self.vocab, started, tail, inner)

    def can_end(self) -> bool:
        """Whether the output may end here: not inside a value."""
        return self.inner is None

    def digest(self) -> int:
        """As :meth:`~constrain.match.values.ValueState.digest`, for the value being written."""
        return 0 if self.inner is None else hash((id(self.inner.checks), self.inner.digest()))

    def forbid_violations(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row; updated in place
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
        viable: Callable[[int], bool] | None = None,
    ) -> int:
        """As :meth:`~constrain.match.values.ValueState.forbid_violations`, inside a value; between values
        nothing is checked."""
        return VIABLE if self.inner is None else self.inner.forbid_violations(row, eos_token_ids, viable)

    def leaves_viable(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row (read only)
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
        viable: Callable[[int], bool],
    ) -> bool:
        """As :meth:`~constrain.match.values.ValueState.leaves_viable`, inside a value; between values
        nothing is checked (:meth:`forbid_violations` returns ``VIABLE``)."""
        return self.inner is None or self.inner.leaves_viable(row, eos_token_ids, viable)

    def leaves_some(
        self,
        # [ceil(V / 32)] int32 on the CPU: a filled mask row (read only)
        row: torch.Tensor,
        eos_token_ids: Iterable[int],
    ) -> bool:
        """As :meth:`~constrain.match.values.ValueState.leaves_some`, inside a value; between values
        nothing is checked."""
        return bool(row.any()) if self.inner is None else self.inner.leaves_some(row, eos_token_ids)

    def refuses(
        self,
        token: int,
        allowed: Callable[[], int],
        eos_token_ids: Collection[int],
        viable: Callable[[int], bool] | None = None,
    ) -> bool:
        """As :meth:`~constrain.match.values.ValueState.refuses`, inside a value; between values nothing is
        refused."""
        return self.inner is not None and self.inner.refuses(token, allowed, eos_token_ids, viable)
