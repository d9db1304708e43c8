"""Exporting a model as a plain Hugging Face folder that other engines load as is.

``export_model(handle, "out/")`` writes ``model.safetensors``, ``config.json``, the tokenizer files
(with the chat template) and ``generation_config.json``; ``transformers``' ``from_pretrained`` and
vLLM load the folder without any constrain code.

Tied embeddings are written under both names (the input embedding's and the output embedding's).
``safetensors``' own ``save_model`` keeps only one name of a shared tensor; a loader that skips
``lm_head.weight`` for a tied model (vLLM does) then leaves the input embedding at zero, and every
logit comes out equal.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from constrain.models.loading import ModelHandle, load_model, model_handle

__all__ = ["export_model"]

EXPORT_MARK = {"format": "pt", "written_by": "constrain.models.export"}
"""The metadata of an exported ``model.safetensors``: it marks a folder as a previous export."""


def export_model(
    model: Any, folder: str | Path, *, dtype: torch.dtype | str | None = None, overwrite: bool = False
) -> Path:
    """Write ``model`` to ``folder`` as a Hugging Face model folder; return the folder.

    The folder is written next to its destination, then renamed into place, so a failed export
    leaves nothing behind. The model is not changed: its weights are copied (and cast) on the CPU,
    so the export needs host memory for one copy of the weights.

    Parameters
    ----------
    model : ModelHandle, or anything :func:`~constrain.models.loading.load_model` takes
        A name or path is loaded in ``dtype`` (float32 when None: lossless for the packaged GGUF
        models, which are dequantized to float32); a ``(model, tokenizer)`` pair keeps its dtype.
    folder : str or Path
        Created (with its parents) if missing. It must be empty, or hold a previous export and
        ``overwrite`` be True; it is then replaced as a whole.
    dtype : torch.dtype or its name ("float32", "bfloat16", "float16"), default: None
        The dtype of the floating-point weights on disk; None keeps the model's.
    overwrite : bool, default: False
        Replace a previous export in ``folder``. A folder that holds anything else is never replaced.

    Raises
    ------
    ValueError
        ``folder`` is a file, holds something other than a previous export, or holds a previous
        export and ``overwrite`` is False; ``dtype`` is not a floating-point dtype.
    """
    folder = Path(folder).resolve()
    target = _dtype(dtype)
    _check_folder(folder, overwrite=overwrite)
    handle = _handle(model, target)
    if target is None:
        target = handle.model.dtype
    tmp = folder.with_name(f".{folder.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed export
    tmp.mkdir(parents=True)
    try:
        save_file(_state_dict(handle.model, target), str(tmp / "model.safetensors"), metadata=EXPORT_MARK)
        (tmp / "config.json").write_text(_json(_config(handle.model, target)))
        _save_tokenizer(handle.tokenizer, tmp)
        generation = getattr(handle.model, "generation_config", None)
        if generation is not None:
            (tmp / "generation_config.json").write_text(_json(_generation(generation, handle.eos_token_ids)))
        _check_folder(folder, overwrite=overwrite)  # again: loading took a while, and rmtree must be safe
        if folder.exists():
            shutil.rmtree(folder)  # empty, or a previous export with overwrite=True
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if dtype is not None and not (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch dtype such as 'bfloat16', got {dtype!r}")
    return resolved


def _is_export(folder: Path) -> bool:
    weights = folder / "model.safetensors"
    if not weights.is_file():
        return False
    try:
        with safe_open(str(weights), "pt") as file:
            metadata = file.metadata() or {}
    except (OSError, SafetensorError):
        return False
    return bool(metadata.get("written_by") == EXPORT_MARK["written_by"])


def _check_folder(folder: Path, *, overwrite: bool) -> None:
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file: pass a folder to export the model into")
    if not folder.exists() or not any(folder.iterdir()):
        return
    if not _is_export(folder):
        raise ValueError(f"{folder} is not empty and holds no previous export: pass an empty or new folder")
    if not overwrite:
        raise ValueError(f"{folder} holds a previous export: pass overwrite=True (--overwrite) to replace it")


def _handle(model: Any, dtype: torch.dtype | None) -> ModelHandle:
    if isinstance(model, tuple):
        return load_model(model)  # keeps the pair's dtype (casting it would change the caller's model)
    return model_handle(model, dtype=torch.float32 if dtype is None else dtype, prepack=False)  # (never run here)


def _state_dict(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Separate CPU copies of every tensor (safetensors refuses shared storage), floats cast to
    ``dtype``; tied embeddings under both their names."""
    tensors = {
        name: tensor.detach().to("cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
        for name, tensor in model.state_dict().items()
    }
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) or (
        outputs is not None and outputs.weight is inputs.weight
    )
    if tied and outputs is not None:
        names = {id(module): name for name, module in model.named_modules()}
        embedding = tensors[f"{names[id(inputs)]}.weight"]
        tensors[f"{names[id(outputs)]}.weight"] = embedding.clone()
    return tensors


def _config(model: Any, dtype: torch.dtype) -> dict[str, Any]:
    config: dict[str, Any] = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are written dequantized
    config.pop("_name_or_path", None)  # where the model was loaded from, meaningless here
    name = str(dtype).removeprefix("torch.")
    config.update(architectures=[type(model).__name__], dtype=name, torch_dtype=name)  # older loaders read torch_dtype
    return config


def _generation(generation: Any, eos_token_ids: tuple[int, ...]) -> dict[str, Any]:
    settings: dict[str, Any] = generation.to_diff_dict()
    # Edited, so no longer the model config's defaults (older transformers rebuild those from config.json).
    settings.pop("_from_model_config", None)
    settings["eos_token_id"] = list(eos_token_ids)
    return settings


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """The tokenizer's files, with the chat template also in ``tokenizer_config.json``: recent
    transformers write it to ``chat_template.jinja`` only, older releases read it only from there."""
    tokenizer.save_pretrained(folder)
    template = getattr(tokenizer, "chat_template", None)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if template is not None and "chat_template" not in config:
        if isinstance(template, dict):  # named templates: the list form of tokenizer_config.json
            template = [{"name": name, "template": text} for name, text in template.items()]
        config["chat_template"] = template
        path.write_text(_json(config))
