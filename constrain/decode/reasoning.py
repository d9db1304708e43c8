"""Think first, then answer in structure: ``generate(..., reasoning=True)``.

A request with reasoning has two parts. The **thinking** is free text between a start and an end
tag (``<think>`` … ``</think>``, or the chat template's own); the **answer** follows the end tag and
is what the constraint governs. While the model thinks, the grammar is not consulted; once the end
tag is written, the constraint applies from the next character on.

What the mask does while the model thinks (:class:`Thinking`):

- EOS is forbidden: a constrained request must get to its answer (so must a free one: it would
  otherwise end with no answer at all).
- A token that would complete the end tag and carry on past it with anything but whitespace is
  forbidden (``">{"`` after ``"</think"``): the answer starts on a token boundary, under the grammar.
  Whitespace after the tag separates the parts and belongs to neither.
- Where the prompt does not already open the thinking (a template whose generation prompt ends with
  the start tag), the start tag is forced first.
- The thinking has its own budget (``max_tokens``, tags included; default: the request's
  ``max_tokens``, so a request generates at most twice that). When only the end tag still fits, the
  end tag is forced, token by token. ``max_tokens`` keeps bounding the answer alone, so the budget's
  closing path (:class:`~constrain.match.budget.Budget`) still ends it complete and valid.

The tags come from :class:`Reasoning` where given; else from the chat template (:data:`KNOWN_TAGS`,
the first pair whose tags the template or the vocabulary holds); else ``<think>``/``</think>``, which
any model can write as text when asked to think. A tag that is one special token (which the
detokenizer skips) is recognised by its id.

Stop strings and the repetition guard apply to the answer only; ``GenerationResult.reasoning`` holds
the thinking (tags excluded, its text exact), ``text`` and ``value`` the answer; ``token_ids`` and
``usage.completion_tokens`` count both parts (``usage.reasoning_tokens`` the thinking's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from constrain.backends.tokenizer import TokenizerInfo
from constrain.caches import bounded
from constrain.errors import ReasoningError
from constrain.match.bitmask import bitmask_size, pack, set_bits

__all__ = [
    "KNOWN_TAGS",
    "Reasoning",
    "Thinking",
    "prompt_opens",
    "reasoning_options",
    "template_tags",
]

KNOWN_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),  # DeepSeek-R1, Qwen3, QwQ, SmolLM3, Phi-4-reasoning
    ("<thinking>", "</thinking>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Command A Reasoning
    ("◁think▷", "◁/think▷"),  # Kimi
    ("<seed:think>", "</seed:think>"),  # Seed-OSS
)
"""Thinking tags recognised in a chat template or vocabulary, in order of preference."""


class Reasoning(BaseModel):
    """How a request thinks before it answers (validated at construction).

    ``max_tokens``: the thinking's budget in tokens, tags included (None: the request's ``max_tokens``).
    ``start``/``end``: the tags (None: the chat template's, see :func:`template_tags`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1)
    start: str | None = Field(default=None, min_length=1)
    end: str | None = Field(default=None, min_length=1)


def reasoning_options(value: Any) -> Reasoning | None:
    """``generate``'s ``reasoning=`` argument as :class:`Reasoning` (None: no reasoning).

    Takes None/False, True, a mapping of :class:`Reasoning`'s fields, or a :class:`Reasoning`;
    raises :class:`ReasoningError` naming the bad key."""
    if value is None or value is False:
        return None
    if value is True:
        return Reasoning()
    if isinstance(value, Reasoning):
        return value
    if not isinstance(value, dict):
        raise ReasoningError(f"reasoning= takes True, a dict or a Reasoning, got {type(value).__name__}")
    try:
        return Reasoning(**value)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"])) or "reasoning"
        raise ReasoningError(f"reasoning.{where}: {first['msg']}") from None


def template_tags(tokenizer: Any) -> tuple[str, str]:
    """The thinking tags of ``tokenizer``'s chat template (see the module docstring)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for start, end in KNOWN_TAGS:
        if end in template or (start in vocab and end in vocab):
            return start, end
    return KNOWN_TAGS[0]


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@bounded("decode.thinking_masks", maxsize=16)
def _thinking_masks(info: TokenizerInfo, end: str, eos: tuple[int, ...]) -> torch.Tensor:
    """``[len(end), ceil(V / 32)]`` int32: the tokens allowed while thinking, by how many characters
    of ``end`` the text ends with: all but EOS and those that would complete ``end`` and carry on
    with more than whitespace (the answer must start on a token boundary). Built once per tokenizer
    and tag (a pass over the tokens holding ``end``'s last character)."""
    vocab = info.vocab_size
    allowed = np.ones((len(end), 32 * bitmask_size(vocab)), dtype=bool)  # [L, 32 * ceil(V / 32)]
    allowed[:, list(eos)] = False
    last = end[-1].encode()
    for token_id, raw in enumerate(info.xgr_info.decoded_vocab[:vocab]):
        if last not in raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        for held in range(len(end)):
            joined = end[:held] + text
            at = joined.find(end)
            if at >= 0 and joined[at + len(end) :].strip():
                allowed[held, token_id] = False
    return torch.from_numpy(pack(allowed))  # [L, ceil(V / 32)] int32


class Thinking:
    """One request's thinking: feeds its text, fills its mask rows, ends at the end tag.

    ``encode`` tokenizes forced text (the start tag; the end tag and ``separator`` when the budget
    runs out: models put a blank line between the parts); ``opened``: the prompt already opens the
    thinking; ``special_ids``: the tokenizer's special tokens (a tag that is one of them is recognised
    by its id). Mutable, one per request.
    """

    def __init__(
        self,
        info: TokenizerInfo,
        tags: tuple[str, str],
        budget: int,
        encode: Callable[[str], list[int]],
        *,
        opened: bool,
        eos: Sequence[int],
        special_ids: Sequence[int] = (),
        separator: str = "\n\n",
    ) -> None:
        self.start, self.end = tags
        self.separator = separator
        self.budget = budget
        self.encode = encode
        self.masks = _thinking_masks(info, self.end, tuple(sorted(eos)))
        self.forced: list[int] = [] if opened else encode(self.start)
        self.started = opened  # the start tag is behind (in the prompt, or written)
        self.open = True  # until the end tag is written
        self.tokens = 0  # tokens of thinking so far, tags included
        self.text = ""  # the thinking so far, tags excluded (what was emitted)
        self._raw = ""  # text not emitted yet: before the start tag, or a possible beginning of the end tag
        self._closings: dict[int, list[int]] = {}  # per end-tag characters held: at most len(end) entries
        ids = {self.start: encode(self.start), self.end: encode(self.end)}
        self._special = {tag: ids[tag][0] for tag in tags if len(ids[tag]) == 1 and ids[tag][0] in set(special_ids)}
        self._longest_closing = max(len(self._closing(held)) for held in range(len(self.end)))
        tags_length = self._longest_closing + (0 if opened else len(ids[self.start]))
        if tags_length >= budget:
            raise ReasoningError(f"reasoning.max_tokens={budget} leaves no room: the tags take {tags_length} tokens")

    def fill(
        self,
        # [ceil(V / 32)] int32: this request's mask row; overwritten
        row: torch.Tensor,
    ) -> None:
        """The tokens allowed next: the forced token if any, else all but EOS and the tokens that
        would run past the end tag into the answer."""
        if not self.forced and self.started and self.tokens + 1 + self._longest_closing > self.budget:
            self.forced = list(self._closing(self._held()))  # after one more free token the end tag might not fit
        if self.forced:
            row.zero_()
            token = self.forced[0]
            set_bits(row, [token])
            return
        row.copy_(self.masks[self._held()])

    def _closing(self, held: int) -> list[int]:
        """The tokens of the end tag's rest after ``held`` of its characters, and the separator."""
        if held not in self._closings:
            self._closings[held] = self.encode(self.end[held:] + self.separator)
        return self._closings[held]

    def _held(self) -> int:
        return _held(self._raw, self.end) if self.started else 0

    def feed(self, token: int, piece: str) -> tuple[str, str | None]:
        """Take the next token and its text. Returns ``(reasoning delta, answer text)``: the answer
        text is None while thinking goes on, else what followed the end tag (whitespace dropped)."""
        self.tokens += 1
        if self.forced and token == self.forced[0]:
            self.forced.pop(0)
        else:
            self.forced = []  # (a forced token is the only one allowed: this is a free one)
        special = self._special.get(self.start if not self.started else self.end)
        if special is not None and token == special:
            piece = self.start if not self.started else self.end  # skipped by the detokenizer
        self._raw += piece
        if not self.started:
            at = self._raw.find(self.start)
            if at < 0:
                return "", None
            self.started, self._raw = True, self._raw[at + len(self.start) :]
        at = self._raw.find(self.end)
        if at >= 0:
            delta, answer = self._raw[:at], self._raw[at + len(self.end) :]
            self.open, self._raw, self.forced = False, "", []
            self.text += delta
            return delta, answer.lstrip()
        keep = len(self._raw) - _held(self._raw, self.end)
        delta, self._raw = self._raw[:keep], self._raw[keep:]
        self.text += delta
        return delta, None

    def flush(self, rest: str = "") -> str:
        """At an early end (length, cancellation): ``rest`` (the detokenizer's last text) and the text held
        back, as the thinking's last delta."""
        delta, self._raw = (self._raw + rest if self.started else ""), ""
        self.text += delta
        return delta


def prompt_opens(tokenizer: Any, prompt_ids: Sequence[int], start: str) -> bool:
    """Whether the prompt leaves the thinking open: its text ends with ``start`` (whitespace aside),
    as chat templates that make their model think end their generation prompt."""
    tail = str(tokenizer.decode(list(prompt_ids[-64:]), skip_special_tokens=False)).rstrip()
    return tail.endswith(start)
