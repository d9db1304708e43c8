"""The model: loading the packaged models, what a forward pass costs, exporting a Hugging Face folder."""

from constrain.models.cost import KNEE, MEASURE_TOKENS, ForwardCost, cache_keyword, forward_cost, measure_forward_cost
from constrain.models.export import export_model
from constrain.models.loading import (
    PACKAGED_MODELS,
    ModelHandle,
    ModelNotFoundError,
    cache_dir,
    end_token_ids,
    gguf_path,
    load_model,
    load_tokenizer,
    prepack_linears,
)

__all__ = [
    "KNEE",
    "MEASURE_TOKENS",
    "PACKAGED_MODELS",
    "ForwardCost",
    "ModelHandle",
    "ModelNotFoundError",
    "cache_dir",
    "cache_keyword",
    "end_token_ids",
    "export_model",
    "forward_cost",
    "gguf_path",
    "load_model",
    "load_tokenizer",
    "measure_forward_cost",
    "prepack_linears",
]
