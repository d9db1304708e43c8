"""Stop strings and stop regexes over streamed text, with hold-back.

Text that could still turn out to be the start of a stop string (or of a stop
regex's match) is held back until it is known not to be, so a stream never shows
text that the final result cuts. A stop string or match and everything after it
are removed from the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import regex as regex_module

from constrain.errors import RegexError

__all__ = ["StopText", "StopUpdate"]


@dataclass(slots=True)
class StopUpdate:
    """What one call of :meth:`StopText.feed` lets out."""

    text: str  # safe to show now
    stopped: bool = False  # a stop string or regex matched: generation ends
    matched: str | None = None  # the stop string, or the regex match, that ended it


@dataclass
class StopText:
    """Watches streamed text for stop strings and stop regexes (Python ``regex`` syntax).

    Raises ``ValueError`` for an empty stop string and :class:`~constrain.errors.RegexError`
    for a bad stop regex, at construction.
    """

    stop: Sequence[str] = ()
    stop_regex: Sequence[str] = ()
    _pending: str = field(default="", init=False)
    _patterns: list[regex_module.Pattern[str]] = field(default_factory=list, init=False)
    _done: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        for name, value in (("stop", self.stop), ("stop_regex", self.stop_regex)):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} is a string or a list of strings, got {type(value).__name__}: {value!r}")
        for pattern in self.stop_regex:
            if not isinstance(pattern, str):
                raise ValueError(f"stop_regex patterns must be strings, got {pattern!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for pattern in self.stop_regex:
            try:
                self._patterns.append(regex_module.compile(pattern))
            except regex_module.error as err:
                raise RegexError(pattern, getattr(err, "msg", str(err)), getattr(err, "pos", None)) from err

    def feed(self, delta: str) -> StopUpdate:
        """Take the next text delta; return what may be shown and whether to stop."""
        if self._done:
            raise ValueError("feed() after a stop: start a new StopText per request")
        text = self._pending + delta
        cut, matched = self._first_match(text)
        if cut is not None:
            self._done = True
            self._pending = ""
            return StopUpdate(text[:cut], True, matched)
        hold = min(self._string_hold(text), self._regex_hold(text))
        self._pending = text[hold:]
        return StopUpdate(text[:hold])

    def flush(self) -> str:
        """The held-back text, at the end of generation (no stop string can complete any more)."""
        text, self._pending = self._pending, ""
        return text

    def _first_match(self, text: str) -> tuple[int | None, str | None]:
        best: tuple[int | None, str | None] = (None, None)
        for s in self.stop:
            at = text.find(s)
            if at != -1 and (best[0] is None or at < best[0]):
                best = (at, s)
        for pattern in self._patterns:
            m = pattern.search(text)
            if m is not None and (best[0] is None or m.start() < best[0]):
                best = (m.start(), m.group())
        return best

    def _string_hold(self, text: str) -> int:
        """Index from which ``text`` might be the start of a stop string."""
        hold = len(text)
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if s.startswith(text[-k:]):
                    hold = min(hold, len(text) - k)
                    break
        return hold

    def _regex_hold(self, text: str) -> int:
        """Index from which ``text`` might be the start of a stop regex's match."""
        hold = len(text)
        for pattern in self._patterns:
            m = pattern.search(text, partial=True)
            if m is not None and m.partial:
                hold = min(hold, m.start())
        return hold
