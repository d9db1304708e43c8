"""The ``constrain`` command line: ``constrain generate "prompt" --schema person.json``,
``constrain serve`` (an OpenAI-compatible server) and ``constrain export FOLDER`` (a Hugging Face
model folder for other engines)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="constrain", description="Structured generation with language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate one completion, streamed")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="packaged model name, .gguf file or model folder (default SmolLM2)")
    what = gen.add_mutually_exclusive_group()
    what.add_argument("--schema", type=Path, help="a JSON Schema file")
    what.add_argument("--regex")
    what.add_argument("--grammar", help="EBNF text, a .ebnf file, or a shipped grammar's name")
    what.add_argument("--choices", nargs="+")
    gen.add_argument("--raw", action="store_true", help="use the prompt as is (default: the model's chat template)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    gen.add_argument("--reasoning", type=int, nargs="?", const=0, default=None, metavar="BUDGET",
                     help="think first (thinking on stderr), then answer; BUDGET: the thinking's tokens "
                          "(default: --max-tokens)")  # fmt: skip
    gen.add_argument("--num-beams", type=int, default=1, help="beam search of this width (prints every beam)")
    for name, kind in (("temperature", float), ("top-k", int), ("top-p", float), ("min-p", float),
                       ("repetition-penalty", float), ("seed", int)):  # fmt: skip
        gen.add_argument(f"--{name}", type=kind, default=None)
    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model", default=None, help="packaged model name, .gguf file or model folder (default SmolLM2)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=32, help="most requests decoded together")
    serve.add_argument(
        "--prefix-cache-mib", type=float, default=None,
        help="KV of recent prompts kept for reuse, MiB (default: 5%% of memory, at most 512)",
    )  # fmt: skip
    export = commands.add_parser("export", help="write the model as a Hugging Face folder (for vLLM, transformers)")
    export.add_argument("folder", type=Path, help="an empty or new folder, or a previous export with --overwrite")
    export.add_argument(
        "--model", default=None, help="packaged model name, .gguf file or model folder (default SmolLM2)"
    )
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="the weights' dtype on disk (default: float32)")  # fmt: skip
    export.add_argument("--overwrite", action="store_true", help="replace a previous export in FOLDER")
    return parser


def _load(model: str | None) -> Any:
    from rich.console import Console

    from constrain.models.loading import load_model

    with Console(stderr=True).status("loading the model (the first load converts it, later ones are quick)..."):
        return load_model(model)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "export":
        return _export(args)
    from constrain.errors import ConstraintError
    from constrain.generation import generate, stream
    from constrain.models.loading import ModelNotFoundError
    from constrain.results import GenerationResult

    sampling = {
        key: value
        for key, value in {
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty, "seed": args.seed,
        }.items()
        if value is not None
    }  # fmt: skip
    grammar = args.grammar
    if grammar is not None and Path(grammar).is_file():
        grammar = Path(grammar).read_text()
    try:
        schema = _schema_file(args.schema) if args.schema else None
        handle = _load(args.model)
        prompt: Any = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
        result = None
        options: dict[str, Any] = dict(schema=schema, regex=args.regex, grammar=grammar, choices=args.choices,
                                       max_tokens=args.max_tokens, stop=args.stop, **sampling)  # fmt: skip
        if args.reasoning is not None:
            options["reasoning"] = {"max_tokens": args.reasoning} if args.reasoning else True
        if args.num_beams != 1:
            result = generate(handle, prompt, num_beams=args.num_beams, **options)
            for beam in result.beams or []:
                print(f"-- beam score={beam.score:.4f} logprob={beam.logprob:.4f}: {beam.text}", file=sys.stderr)
            args.no_stream = True
        else:
            for event in stream(handle, prompt, **options):
                if isinstance(event, GenerationResult):
                    result = event
                elif event.part == "reasoning":
                    print(event.delta, end="", file=sys.stderr, flush=True)
                elif not args.no_stream:
                    print(event.delta, end="", flush=True)
            if result is not None and result.reasoning is not None:
                print(file=sys.stderr)
    except (ConstraintError, ValueError, ModelNotFoundError, OSError) as err:
        print(f"constrain: error: {err}", file=sys.stderr)
        return 2
    assert result is not None
    if args.no_stream:
        print(result.text, end="")
    print()
    print(f"-- finish_reason={result.finish_reason}, {result.usage.completion_tokens} tokens", file=sys.stderr)
    if result.violations:
        print("-- violations: " + "; ".join(result.violations), file=sys.stderr)
        return 1
    if schema is not None:
        print(json.dumps(result.value, ensure_ascii=False, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from constrain.models.loading import ModelNotFoundError
    from constrain.serving.server import serve

    try:
        handle = _load(args.model)
    except (ModelNotFoundError, OSError) as err:
        print(f"constrain: error: {err}", file=sys.stderr)
        return 2
    limit = None if args.prefix_cache_mib is None else int(args.prefix_cache_mib * (1 << 20))
    serve(handle, host=args.host, port=args.port, max_batch=args.max_batch, prefix_cache_bytes=limit)
    return 0


def _export(args: argparse.Namespace) -> int:
    from rich.console import Console

    from constrain.models.export import export_model
    from constrain.models.loading import ModelNotFoundError

    try:
        with Console(stderr=True).status("exporting the model..."):
            folder = export_model(args.model, args.folder, dtype=args.dtype, overwrite=args.overwrite)
    except (ValueError, ModelNotFoundError, OSError) as err:
        print(f"constrain: error: {err}", file=sys.stderr)
        return 2
    print(folder)
    for path in sorted(folder.iterdir()):
        print(f"  {path.name:<24} {path.stat().st_size:>13,} bytes")
    return 0


def _schema_file(path: Path) -> Any:
    """The JSON Schema in the file at ``path``; a ``SchemaError`` naming the file where it is not JSON text."""
    from constrain.errors import SchemaError

    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SchemaError(f"{path} is not JSON text: {err.msg} (line {err.lineno}, column {err.colno})") from err


if __name__ == "__main__":
    sys.exit(main())
