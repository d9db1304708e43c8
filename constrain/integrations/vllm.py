"""constrain as a vLLM V1 logits processor: vLLM serves, constrain enforces each request's constraint.

Load it with ``LLM(model, logits_processors=[ConstrainLogitsProcessor])``, or with ``vllm serve MODEL
--logits-processors constrain.integrations.vllm:ConstrainLogitsProcessor``. It is opt-in: constrain
registers no ``vllm.logits_processors`` entry point, because vLLM loads every such plugin into every
engine, and its V2 model runner (the default where Triton is present, so on GPUs) refuses V1-interface
plugins at start-up: installing constrain would stop ``vllm serve`` from starting.
A request opts in with ``SamplingParams(extra_args={"constrain": ARGS})``, or through the OpenAI
server with ``extra_body={"vllm_xargs": {"constrain": json.dumps(ARGS)}}`` (the server takes only
strings and numbers there). ``ARGS`` is what :func:`~constrain.integrations.guide.guide_spec` reads:
``{"json_schema": ...}``, ``{"regex": ...}``, ``{"grammar": ...}``, ``{"choices": [...]}`` or
``{"tools": [...], "tool_choice": ...}``, with options. Requests without it are left alone.

- A bad constraint is refused when the request arrives (``validate_params``: a ``ValueError``, which
  the server answers with HTTP 400), before it reaches the engine.
- Compiling happens when vLLM adds the request to its persistent batch (cached and shared across
  requests). If it fails there (a schema no output fits), the request may only end: its mask allows
  EOS alone, and the engine goes on serving the others.
- Each step, the masks of every constrained row are filled in one batched call, then narrowed per row
  (the closing path near the end of ``max_tokens``, the repetition guard), and applied to the logits on
  their device before penalties and temperature (``is_argmax_invariant`` is False).

vLLM 0.32 (the V1 model runner: vLLM's CPU build, and GPUs with ``VLLM_USE_V2_MODEL_RUNNER=0``; the V2
runner refuses the class even when named) calls
``update_state`` with the batch's changes (removed, then added, then moved rows) and ``apply`` with the
logits. Requests refer to their live output token lists, so the guides follow what vLLM sampled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from constrain.integrations.guide import Guide, allow_only, guide_spec
from constrain.match.bitmask import allocate_token_bitmask
from constrain.match.matcher import fill_next_token_bitmasks
from constrain.models.loading import load_tokenizer
from constrain.sampler.ops.bitmask import apply_token_bitmask_inplace

__all__ = ["EXTRA_ARGS_KEY", "PROCESSOR", "ConstrainLogitsProcessor"]

EXTRA_ARGS_KEY = "constrain"
"""The key of a request's ``SamplingParams.extra_args`` (the server's ``vllm_xargs``) that holds its
constrain arguments."""

PROCESSOR = "constrain.integrations.vllm:ConstrainLogitsProcessor"
"""The processor as ``--logits-processors`` names it."""

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Row:
    guide: Guide | None  # None: compiling failed, the request may only end
    output_ids: list[int]  # vLLM's live list of the request's output tokens
    eos: tuple[int, ...]


class ConstrainLogitsProcessor(LogitsProcessor):  # type: ignore[misc]
    """Enforces constrain's constraints per request in vLLM's V1 engine (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Refuse a request whose constrain arguments are bad (a ``ValueError`` naming the culprit)."""
        args = (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is not None:
            try:
                guide_spec(args)
            except ValueError:
                raise
            except Exception as err:  # a ConstraintError that is no ValueError: still the client's
                raise ValueError(f"{type(err).__name__}: {err}") from err

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        model_config = vllm_config.model_config
        self.tokenizer = load_tokenizer(str(model_config.tokenizer))
        self.vocab_size = int(model_config.get_vocab_size())
        self.device = device
        self.rows: dict[int, _Row] = {}  # batch row -> its request's state, for the constrained requests only

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is likeliest

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            args = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
            if args is None:
                self.rows.pop(index, None)  # a row may be reused without being removed first
                continue
            eos = tuple(t for t in (params.eos_token_id, *(params.stop_token_ids or ())) if t is not None)
            try:
                guide: Guide | None = Guide(
                    guide_spec(args), self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=eos,
                    max_tokens=int(params.max_tokens),
                )  # fmt: skip
            except Exception:  # never take the engine down: this request may only end
                logger.exception("constrain could not prepare a request's constraint; it will end at once")
                guide = None
            self.rows[index] = _Row(guide, output_ids, eos)
        for source, target, direction in batch_update.moved:
            moving, displaced = self.rows.pop(source, None), self.rows.pop(target, None)
            if moving is not None:
                self.rows[target] = moving
            if displaced is not None and direction == MoveDirectionality.SWAP:
                self.rows[source] = displaced

    def apply(
        self,
        # [num_requests, V] float32, on the model's device; masked in place
        logits: torch.Tensor,
    ) -> torch.Tensor:
        if not self.rows:
            return logits
        indices = sorted(self.rows)
        rows = [self.rows[i] for i in indices]
        bitmask = allocate_token_bitmask(len(rows), logits.shape[-1])  # [n, ceil(V / 32)] int32, CPU
        guided = [(at, row.guide) for at, row in enumerate(rows) if row.guide is not None]
        for at, guide in guided:
            guide.advance(rows[at].output_ids)
        live = [(at, guide) for at, guide in guided if guide.live]
        fill_next_token_bitmasks([g.matcher for _, g in live], bitmask, [at for at, _ in live])
        for at, guide in guided:
            guide.restrict(bitmask[at])
        for at, row in enumerate(rows):
            if row.guide is None:
                allow_only(bitmask[at], row.eos)
        where = torch.tensor(indices, dtype=torch.int64, device=logits.device)  # [n]: the logits row of each
        apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), where)
        return logits
