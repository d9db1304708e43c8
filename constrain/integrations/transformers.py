"""constrain as a transformers logits processor: ``model.generate(..., logits_processor=[...])``.

    processor = ConstrainLogitsProcessor({"json_schema": Person}, tokenizer, max_new_tokens=128)
    out = model.generate(ids, logits_processor=LogitsProcessorList([processor]), max_new_tokens=128)

Every row of the batch (every beam too) gets its own :class:`~constrain.integrations.guide.Guide`: the
constraint, EOS only where it can end, the closing path within ``max_new_tokens`` and the repetition
guard. Rows are followed by their tokens, so beam search's reordering is handled (a row whose tokens
are no extension of what its guide saw is replayed from the start). One processor per ``generate``
call: it learns the prompt length on its first call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from constrain.constraints.constraint import Constraint
from constrain.integrations.guide import Guide, GuideSpec, guide_spec
from constrain.match.bitmask import allocate_token_bitmask
from constrain.match.matcher import fill_next_token_bitmasks
from constrain.models.loading import end_token_ids
from constrain.sampler.ops.bitmask import apply_token_bitmask_inplace

__all__ = ["ConstrainLogitsProcessor"]


class ConstrainLogitsProcessor:
    """A transformers ``LogitsProcessor`` (a callable ``(input_ids, scores) -> scores``) that masks each
    row to its constraint.

    Parameters
    ----------
    constraint : a constraint (``constrain.json_schema(...)``...), a :class:`GuideSpec`, or the argument
        mapping :func:`~constrain.integrations.guide.guide_spec` reads (``{"json_schema": ...}``...)
    tokenizer : the model's Hugging Face tokenizer
    max_new_tokens : int
        ``generate``'s ``max_new_tokens``: the budget the closing path keeps to.
    eos_token_ids : sequence of int or None, default: None (the model's end-of-turn and EOS tokens)
    vocab_size : int or None, default: None (the scores' width, read on the first call)

    Raises
    ------
    ValueError, ConstraintError
        Bad arguments or a bad constraint, here rather than inside ``generate``.
    """

    def __init__(
        self,
        constraint: Constraint | GuideSpec | Mapping[str, Any],
        tokenizer: Any,
        *,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if isinstance(constraint, Mapping):
            constraint = guide_spec(constraint)
        self.spec = constraint if isinstance(constraint, GuideSpec) else GuideSpec(constraint)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.eos = tuple(eos_token_ids) if eos_token_ids is not None else end_token_ids(None, tokenizer)
        self.vocab_size = vocab_size
        self.prompt_length: int | None = None
        self.guides: list[Guide] = []

    def _guide(self) -> Guide:
        assert self.vocab_size is not None
        return Guide(
            self.spec, self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos,
            max_tokens=self.max_new_tokens,
        )  # fmt: skip

    def __call__(
        self,
        # [B, L] int64: the prompt and the tokens generated so far
        input_ids: torch.Tensor,
        # [B, V] float: the next token's scores; masked in place
        scores: torch.Tensor,
    ) -> torch.Tensor:
        if self.prompt_length is None:
            self.prompt_length, self.vocab_size = input_ids.shape[1], self.vocab_size or scores.shape[-1]
        while len(self.guides) < input_ids.shape[0]:
            self.guides.append(self._guide())
        generated = input_ids[:, self.prompt_length :].tolist()
        for guide, ids in zip(self.guides, generated, strict=False):
            guide.advance(ids)
        batch = self.guides[: input_ids.shape[0]]
        bitmask = allocate_token_bitmask(len(batch), scores.shape[-1])  # [B, ceil(V / 32)] int32, CPU
        live = [row for row, guide in enumerate(batch) if guide.live]  # finished rows go on padded: EOS only
        fill_next_token_bitmasks([batch[row].matcher for row in live], bitmask, live)
        for row, guide in enumerate(batch):
            guide.restrict(bitmask[row])
        apply_token_bitmask_inplace(scores, bitmask.to(scores.device))
        return scores
