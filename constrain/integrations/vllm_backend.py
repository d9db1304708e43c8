"""constrain as vLLM's structured-output backend: standard requests (``response_format``, ``tools``,
``structured_outputs``) enforced by constrain, switched on with ``CONSTRAIN_VLLM=1``.

vLLM's backends are a closed list (the engine's ``StructuredOutputManager`` picks one with an if/elif
chain). constrain registers a ``vllm.general_plugins`` entry point, :func:`register`, which vLLM runs in
every process it starts (API server, engine core, workers) before any request. With ``CONSTRAIN_VLLM``
unset (or ``0``) it does nothing: installing constrain never changes a vLLM server. With ``CONSTRAIN_VLLM=1``
it calls :func:`install`, which hooks four places (checked at start-up: a vLLM version outside
:data:`SUPPORTED_VLLM`, or a hooked function whose signature differs, stops the server with
:class:`VllmVersionError` naming what changed):

1. **Admission** (the API server; ``SamplingParams._validate_structured_outputs``): the request's
   constraint is compiled by constrain, so a bad schema, regex, grammar or choice list is an HTTP 400
   naming the culprit (keyword path, position), and a schema vLLM's own backends would refuse is served.
2. **Tool calls** (the API server; ``DelegatingParser._apply_structural_tag``): with a tool-call parser
   whose format constrain writes (``--tool-call-parser hermes``), ``tools`` with ``tool_choice`` auto,
   required or named, and ``parallel_tool_calls``, become constrain's tool-calling constraint: free text
   or calls where ``auto`` allows them, every call's name one of the tools and its arguments valid
   against that tool's schema. vLLM's parser reads the calls back, as it does without constrain.
3. **The backend** (the engine core; ``StructuredOutputManager.grammar_init``): :class:`ConstrainBackend`
   serves every structured request, whatever ``--structured-outputs-config`` names.
4. **Each request's grammar** (``StructuredOutputManager._create_grammar``): :class:`ConstrainGrammar`
   knows the request's ``max_tokens``, so the output closes within it.

vLLM samples after the mask with no way back (a token the grammar refuses ends the request with an
error), so the mask filled here is exact: the grammar's, with constrain's value checks and key guard
applied eagerly (:meth:`~constrain.match.matcher.Matcher.fill_next_token_bitmask`), then narrowed near
the end of the budget (:class:`~constrain.integrations.guide.Guide`). What constrain does not compile (a
Lark grammar, an xgrammar structural tag from a tool parser whose format constrain does not write) goes
to vLLM's xgrammar backend, with a log line.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from constrain.caches import bounded
from constrain.compiler.compiler import compile
from constrain.constraints.constraint import choice, grammar, json_object, json_schema, regex
from constrain.errors import ConstraintError
from constrain.integrations.guide import Guide, GuideSpec, guide_spec
from constrain.match.bitmask import allocate_token_bitmask
from constrain.models.loading import load_tokenizer

__all__ = [
    "ENV_SWITCH",
    "SUPPORTED_VLLM",
    "TOOL_FORMATS",
    "ConstrainBackend",
    "ConstrainGrammar",
    "VllmVersionError",
    "install",
    "register",
    "uninstall",
]

ENV_SWITCH = "CONSTRAIN_VLLM"
"""The environment variable that turns the backend on (``1``, ``true`` or ``yes``) in a vLLM server."""

SUPPORTED_VLLM = ("0.32.0",)
"""The vLLM versions whose hooked functions :func:`install` knows (``vllm.__version__``)."""

TOOL_FORMATS = {"hermes": "hermes"}
"""A vLLM tool parser's ``structural_tag_model`` -> the constrain tool format that writes what it reads."""

STRUCTURAL_TAG_KEY = "constrain"
"""The key of the structural tag that carries constrain's tool-calling arguments from the API server to
the engine (vLLM passes a structural tag through as text)."""

logger = logging.getLogger(__name__)

# the hooked functions' parameters, as vLLM 0.32 declares them
_HOOKS = {
    "vllm.v1.structured_output:StructuredOutputManager.grammar_init": ["self", "request"],
    "vllm.v1.structured_output:StructuredOutputManager._create_grammar": ["self", "request"],
    "vllm.sampling_params:SamplingParams._validate_structured_outputs": [
        "self", "model_config", "structured_outputs_config", "tokenizer"
    ],
    "vllm.parser.abstract_parser:DelegatingParser._apply_structural_tag": ["self", "request"],
    "vllm.v1.structured_output.backend_types:StructuredOutputBackend.compile_grammar": [
        "self", "request_type", "grammar_spec", "stop_token_ids"
    ],
    "vllm.v1.structured_output.backend_types:StructuredOutputGrammar.fill_bitmask": ["self", "bitmask", "batch_index"],
}  # fmt: skip
_GRAMMAR_METHODS = {"accept_tokens", "validate_tokens", "rollback", "fill_bitmask", "is_terminated", "reset"}

_originals: dict[tuple[type, str], Callable[..., Any]] = {}  # what install() replaced: uninstall() restores it


class VllmVersionError(RuntimeError):
    """The installed vLLM is not one :func:`install` knows: its version, or a hooked function, differs."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: :func:`install` when ``CONSTRAIN_VLLM`` is on, else nothing."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes"):
        install()


def install() -> None:
    """Make constrain vLLM's structured-output backend in this process (see the module docstring).
    Idempotent. Raises :class:`VllmVersionError` on a vLLM it does not know, before changing anything."""
    if _originals:
        return
    import vllm
    from vllm import sampling_params as vllm_params
    from vllm.parser import abstract_parser
    from vllm.v1 import structured_output as manager_module

    if vllm.__version__ not in SUPPORTED_VLLM:
        raise VllmVersionError(
            f"{ENV_SWITCH}=1 needs vLLM {' or '.join(SUPPORTED_VLLM)}; this is vLLM {vllm.__version__}. "
            f"Install a supported vLLM, or unset {ENV_SWITCH} to use vLLM's own backends."
        )
    _check_hooks()
    manager = manager_module.StructuredOutputManager
    _wrap(manager, "grammar_init", _grammar_init)
    _wrap(manager, "_create_grammar", _create_grammar)
    _wrap(vllm_params.SamplingParams, "_validate_structured_outputs", _validate_structured_outputs)
    _wrap(abstract_parser.DelegatingParser, "_apply_structural_tag", _apply_structural_tag)
    logger.info("constrain is vLLM's structured-output backend (%s=1)", ENV_SWITCH)


def uninstall() -> None:
    """Give vLLM its own backends back in this process (what :func:`install` replaced)."""
    while _originals:
        (owner, name), original = _originals.popitem()
        setattr(owner, name, original)


def _check_hooks() -> None:
    import importlib

    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    for where, expected in _HOOKS.items():
        module, _, path = where.partition(":")
        owner, _, name = path.partition(".")
        function = getattr(getattr(importlib.import_module(module), owner, None), name, None)
        if function is None:
            raise VllmVersionError(f"vLLM has no {where}: constrain's backend cannot hook it")
        found = list(inspect.signature(function).parameters)
        if found != expected:
            raise VllmVersionError(f"vLLM's {where} takes {found}, not {expected}: constrain cannot hook it")
    abstract = set(getattr(StructuredOutputGrammar, "__abstractmethods__", ()))
    if abstract != _GRAMMAR_METHODS:
        expected = sorted(_GRAMMAR_METHODS)
        raise VllmVersionError(f"vLLM's StructuredOutputGrammar asks for {sorted(abstract)}, not {expected}")


def _wrap(owner: type, name: str, hook: Callable[..., Any]) -> None:
    original = getattr(owner, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    hooked.__wrapped__ = original  # type: ignore[attr-defined]
    hooked.__name__ = name
    _originals[owner, name] = original
    setattr(owner, name, hooked)


# -- the constraint of a request ----------------------------------------------------------------------------


def request_spec(request_type: Any, text: str, *, compact: bool = False) -> GuideSpec | None:
    """The :class:`GuideSpec` of one structured-output request (vLLM's ``StructuredOutputKey``: its type and
    text), or None where constrain leaves it to vLLM's xgrammar backend (a Lark grammar, an xgrammar
    structural tag). ``compact``: vLLM's ``disable_any_whitespace``.

    Raises
    ------
    ConstraintError, ValueError
        The constraint is bad (the message names the culprit).
    """
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions as Options
    from vllm.v1.structured_output.utils import grammar_is_likely_lark

    whitespace = {"whitespace": "compact"} if compact else {}
    if request_type == Options.JSON:
        return GuideSpec(json_schema(text, **whitespace))  # type: ignore[arg-type]
    if request_type == Options.JSON_OBJECT:
        return GuideSpec(json_object(**whitespace))  # type: ignore[arg-type]
    if request_type == Options.REGEX:
        return GuideSpec(regex(text))
    if request_type == Options.CHOICE:
        return GuideSpec(choice(json.loads(text)))
    if request_type == Options.GRAMMAR:
        return None if grammar_is_likely_lark(text) else GuideSpec(grammar(text))
    if request_type == Options.STRUCTURAL_TAG:
        tag = json.loads(text)
        if isinstance(tag, dict) and set(tag) == {STRUCTURAL_TAG_KEY}:
            return guide_spec(tag[STRUCTURAL_TAG_KEY])
        return None
    raise ValueError(f"constrain does not know vLLM's structured-output type {request_type}")


# -- the engine's backend ----------------------------------------------------------------------------------


class ConstrainBackend:
    """vLLM's engine-level structured-output backend, built on constrain's compiler (cached and shared,
    thread-safe: vLLM compiles in a thread pool). Subclasses ``StructuredOutputBackend`` when made by
    :func:`backend` (vLLM is imported only there)."""

    vllm_config: Any
    tokenizer: Any
    vocab_size: int

    def __post_init__(self) -> None:
        model = self.vllm_config.model_config
        self.hf_tokenizer = hf_tokenizer(str(model.tokenizer))
        self.compact = bool(self.vllm_config.structured_outputs_config.disable_any_whitespace)
        self.fallback: Any = None  # vLLM's xgrammar backend, for what constrain leaves to it (made when needed)

    def compile_grammar(self, request_type: Any, grammar_spec: str, stop_token_ids: set[int] | None = None) -> Any:
        """vLLM's hook, without the request: no output budget known (``max_tokens`` unbounded)."""
        return self.compile_request(request_type, grammar_spec, stop_token_ids, max_tokens=1 << 30)

    def compile_request(
        self,
        request_type: Any,
        grammar_spec: str,
        stop_token_ids: set[int] | None,
        *,
        max_tokens: int,
        request: Any = None,
        after_reasoning: bool = False,
    ) -> Any:
        """The grammar of one request. ``request``: vLLM's ``Request`` (held weakly), whose output so far
        counts against ``max_tokens`` where ``after_reasoning`` (the grammar starts after a reasoning
        section). Raises what compiling raises; vLLM then fails this request alone."""
        spec = request_spec(request_type, grammar_spec, compact=self.compact)
        if spec is None:
            logger.info("constrain leaves a %s request to vLLM's xgrammar backend", request_type.name)
            return self._fallback().compile_grammar(request_type, grammar_spec, stop_token_ids=stop_token_ids)
        eos = sorted(stop_token_ids) if stop_token_ids else list(_eos_ids(self.hf_tokenizer))
        guide = Guide(spec, self.hf_tokenizer, vocab_size=self.vocab_size, eos_token_ids=eos, max_tokens=max_tokens)
        return grammar_class()(guide, None if request is None else weakref.ref(request), after_reasoning)

    def _fallback(self) -> Any:
        if self.fallback is None:
            from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

            self.fallback = XgrammarBackend(self.vllm_config, tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        return self.fallback

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return allocate_token_bitmask(max_num_seqs, self.vocab_size)  # [max_num_seqs, ceil(V / 32)] int32

    def destroy(self) -> None:
        if self.fallback is not None:
            self.fallback.destroy()


@bounded("integrations.vllm_backend.tokenizers", maxsize=4)
def hf_tokenizer(path: str) -> Any:
    """The model's Hugging Face tokenizer, loaded once per process: constrain's compile cache and its
    tokenizer tables are kept per tokenizer object, so one object serves every request."""
    return load_tokenizer(path)


def _eos_ids(tokenizer: Any) -> tuple[int, ...]:
    eos = tokenizer.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class ConstrainGrammar:
    """One request's grammar for vLLM: a :class:`~constrain.integrations.guide.Guide` that takes tokens and
    rolls them back (speculative decoding), and fills its exact row. Subclasses ``StructuredOutputGrammar``
    when made by :func:`grammar_class`. One request, one thread at a time (vLLM's parallel fill gives each
    grammar to one thread)."""

    def __init__(self, guide: Guide, request: weakref.ref[Any] | None, after_reasoning: bool) -> None:
        self.guide = guide
        self.request = request
        self.after_reasoning = after_reasoning

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Take ``tokens``; False at the first the grammar refuses (vLLM then ends the request)."""
        if self.after_reasoning and not self.guide.taken and self.request is not None:
            request = self.request()  # its output so far (appended before this call) counts: closes early by one
            self.guide.used = 0 if request is None else int(request.num_output_tokens)
        for token in tokens:
            if self.guide.matcher.is_terminated():
                return True  # vLLM stops the request at the EOS: what follows is not the output
            if not self.guide.accept(token):
                logger.error("constrain refused token %s of request %s", token, request_id)
                return False
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` (a draft) whose every token its step's mask allows (the budget's
        narrowing included, not only the grammar). Does not change the state."""
        row = allocate_token_bitmask(1, self.guide.matcher.compiled.vocab_size)  # [1, ceil(V / 32)] int32
        taken = 0
        for token in tokens:
            if self.guide.matcher.is_terminated():
                break
            self.guide.fill(row, 0)
            if not (int(row[0, token >> 5]) >> (token & 31)) & 1 or not self.guide.accept(token):
                break
            taken += 1
        self.guide.rollback(taken)
        return tokens[:taken]

    def rollback(self, num_tokens: int) -> None:
        self.guide.rollback(num_tokens)

    def fill_bitmask(
        self,
        # [B, ceil(V / 32)] int32 on the CPU; row ``batch_index`` is overwritten
        bitmask: torch.Tensor,
        batch_index: int,
    ) -> None:
        self.guide.fill(bitmask, batch_index)

    def is_terminated(self) -> bool:
        return self.guide.matcher.is_terminated()

    def reset(self) -> None:
        self.guide.advance([])


_classes: dict[str, type] = {}


def backend_class() -> type:
    """:class:`ConstrainBackend` as a vLLM ``StructuredOutputBackend`` (a dataclass of vLLM's fields)."""
    if "backend" not in _classes:
        from vllm.v1.structured_output.backend_types import StructuredOutputBackend

        bases = (ConstrainBackend, StructuredOutputBackend)
        _classes["backend"] = dataclasses.dataclass(type("ConstrainBackend", bases, {}))
    return _classes["backend"]


def grammar_class() -> type:
    """:class:`ConstrainGrammar` as a vLLM ``StructuredOutputGrammar``."""
    if "grammar" not in _classes:
        from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

        _classes["grammar"] = type("ConstrainGrammar", (ConstrainGrammar, StructuredOutputGrammar), {})
    return _classes["grammar"]


# -- the hooks ---------------------------------------------------------------------------------------------


def _grammar_init(original: Callable[..., None], manager: Any, request: Any) -> None:
    if request.structured_output_request is not None and manager.backend is None:
        vocab_size = manager.vllm_config.model_config.get_vocab_size()
        manager.backend = backend_class()(manager.vllm_config, tokenizer=manager.tokenizer, vocab_size=vocab_size)
    original(manager, request)


def _create_grammar(original: Callable[..., Any], manager: Any, request: Any) -> Any:
    if not isinstance(manager.backend, ConstrainBackend):
        return original(manager, request)
    try:
        request_type, text = request.structured_output_request.structured_output_key
        params = request.sampling_params
        return manager.backend.compile_request(
            request_type, text, params.all_stop_token_ids if params is not None else None,
            max_tokens=int(request.max_tokens), request=request,
            after_reasoning=manager.reasoner_cls is not None and not manager.enable_in_reasoning,
        )  # fmt: skip
    except Exception:
        logger.exception("constrain could not compile the grammar of request %s", request.request_id)
        raise


def _validate_structured_outputs(
    original: Callable[..., None], params: Any, model_config: Any, config: Any, tokenizer: Any
) -> None:
    so = params.structured_outputs
    if config is None or so is None or tokenizer is None or model_config.is_diffusion:
        return original(params, model_config, config, tokenizer)  # vLLM's own refusals
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import check_json_nesting
    from vllm.v1.structured_output.request import get_structured_output_key

    check_json_nesting(so.json)
    if so.json_object is False:
        raise VLLMValidationError("structured_outputs.json_object must be true if set", parameter="json_object")
    try:
        request_type, text = get_structured_output_key(so)
    except ValueError as err:
        raise VLLMValidationError(str(err), parameter="structured_outputs") from err
    parameter = f"structured_outputs.{request_type.name.lower()}"
    try:
        compact = bool(config.disable_any_whitespace or so.disable_any_whitespace)
        spec = request_spec(request_type, text, compact=compact)
        if spec is not None:  # compiled here too, so what fails to compile is refused now (then cached)
            hf = hf_tokenizer(str(model_config.tokenizer))
            compile(spec.constraint, hf, vocab_size=model_config.get_vocab_size(), eos_token_ids=list(_eos_ids(hf)))
    except (ConstraintError, ValueError) as err:
        raise VLLMValidationError(f"{type(err).__name__}: {err}", parameter=parameter) from err
    if spec is None:  # to vLLM's xgrammar backend: its checks
        return original(params, model_config, dataclasses.replace(config, backend="xgrammar"), tokenizer)
    so._backend = config.backend
    so.__post_init__()
    return None


def _apply_structural_tag(original: Callable[..., Any], parser: Any, request: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.sampling_params import StructuredOutputsParams

    tool_parser = parser._tool_parser
    fmt = TOOL_FORMATS.get(getattr(tool_parser, "structural_tag_model", None) or "")
    choice_ = request.tool_choice if isinstance(request, ChatCompletionRequest) else None
    if fmt is None or not request.tools or choice_ in (None, "none"):
        return original(parser, request)
    if choice_ == "auto" and request.extract_structured_outputs() is not None:
        return original(parser, request)  # calls or a response format: vLLM's own (xgrammar) tag
    if choice_ != "auto" and tool_parser.supports_required_and_named:
        return original(parser, request)  # vLLM parses forced calls as JSON: its JSON schema, compiled by constrain
    args = {
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools],
        "tool_choice": choice_ if isinstance(choice_, str) else choice_.model_dump(exclude_none=True),
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_format": fmt,
    }
    request.structured_outputs = StructuredOutputsParams(structural_tag=json.dumps({STRUCTURAL_TAG_KEY: args}))
    request.response_format = None
    return request
