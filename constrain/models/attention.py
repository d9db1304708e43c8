"""The attention :func:`~constrain.models.loading.load_model` runs: transformers' SDPA, with grouped key/value heads
handed to torch's kernel as they are where a CPU pass comes with a mask.

transformers' ``sdpa`` attention copies a layer's key and value heads ``num_key_value_groups`` times
(``repeat_kv``: every key and value of the context, in every layer) whenever a pass of several tokens per row
comes with a mask: what the decode loop's drafts, jump-forward and padded prefills feed. It keeps the heads
grouped only without a mask (as CUDA's kernels need) or for one token per row. torch's CPU kernel takes grouped
heads with a mask (``enable_gqa``), so on a CPU this attention passes them as they are, and transformers'
``sdpa`` does the rest, with the same logits. Measured with SmolLM2-135M (9 query heads, 3 key/value heads)
in bfloat16 on an Intel Xeon (AVX-512/AMX), 2 cores, 8 rows of 128 tokens of context: a pass of 2 tokens per
row took 65.5 to 68.3 ms copying, 59.8 to 60.2 ms grouped (a pass of 1: 53.5 to 56.8).

For one token per row with a mask (rows of different lengths, or a hole a rejected draft left), transformers
packs each key/value head's queries as the rows of one attention (``pack_gqa``), which torch's CPU kernel
runs slower than the grouped heads: the same model, 8 rows of 200 and 800 tokens of context with a hole in
one row, a step (median of 120, interleaved) took 39.2 and 54.8 ms packed, 37.4 and 51.7 ms grouped, 37.6
and 51.5 ms with no hole (no mask). The grouped kernel's output equals the attention over copied heads
bitwise; it differs from the packed queries' in the last bits.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GROUPED_SDPA", "grouped_sdpa_attention", "use_grouped_sdpa"]

GROUPED_SDPA = "constrain_grouped_sdpa"
"""The name :func:`grouped_sdpa_attention` is registered under in transformers' attention interfaces."""


def grouped_sdpa_attention(
    module: Any,
    query: torch.Tensor,  # [b, heads, q, head_dim]
    key: torch.Tensor,  # [b, kv_heads, k, head_dim]
    value: torch.Tensor,  # [b, kv_heads, k, head_dim]
    attention_mask: torch.Tensor | None,  # [b, 1, q, k] bool or additive, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, except that a CPU pass with a mask runs on the grouped key/value
    heads (``enable_gqa``), neither on copies (several tokens per row) nor on packed queries (one). Returns
    ``([b, q, heads, head_dim], None)``, as transformers' attention functions do. Does not change its inputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = attention_mask is None or query.device.type != "cpu"
    extras = any(kwargs.get(k) is not None for k in ("position_bias", "softcap")) or kwargs.get("output_attentions")
    if not grouped or plain or extras or key.shape[-1] != value.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [b, heads, q, head_dim]
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: Any) -> bool:
    """Run ``model`` (a transformers model in ``sdpa`` attention) with :func:`grouped_sdpa_attention`, its masks
    built as for ``sdpa``. Mutates ``model`` (its attention implementation); returns whether it did (a model in
    another attention, or one that cannot switch, is left as it is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)  # (transformers warns where it cannot)
    if getattr(config, "_attn_implementation", None) != "sdpa" or (can_set is not None and not can_set()):
        return False
    if GROUPED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
        AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    try:
        model.set_attn_implementation(GROUPED_SDPA)
    except (AttributeError, KeyError, ValueError):  # a model or transformers that cannot switch: as it was
        return False
    return getattr(config, "_attn_implementation", None) == GROUPED_SDPA
