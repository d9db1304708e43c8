"""constrain inside other engines: a vLLM logits processor (``constrain.integrations.vllm``, imported only
where vLLM is installed) and a transformers logits processor (``constrain.integrations.transformers``),
both built on :class:`~constrain.integrations.guide.Guide`."""

from constrain.integrations.guide import CONSTRAINT_KEYS, Guide, GuideSpec, guide_spec

__all__ = ["CONSTRAINT_KEYS", "Guide", "GuideSpec", "guide_spec"]
