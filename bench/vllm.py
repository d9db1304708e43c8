"""constrain inside vLLM against vLLM's own structured outputs, on the same engine and the same requests.

Runs in vLLM's environment (``make test-vllm`` builds ``.venv-vllm``): ``.venv-vllm/bin/python bench/vllm.py``.
The packaged SmolLM2 is exported (``constrain.export_model``, float32) and served by ``vllm.LLM``, one
engine per vLLM backend (``structured_outputs_config={"backend": ...}``: xgrammar, then guidance); on each
engine one batch of requests, greedy, runs once per configuration:

- *constrain*: constrain's logits processor (its entry point), ``extra_args={"constrain": {"json_schema": ...}}``;
- *vLLM <backend>*: ``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))``.

The requests: ``--schemas`` MaskBench dev schemas (a seeded sample), each prompted "write a JSON
instance of this schema"; a schema the backend refuses (vLLM then fails the whole batch) is left out
of both runs on that engine. Prints output tokens/s (wall clock of ``LLM.generate`` for the batch, after
one-token requests that compile every schema) and how many outputs are valid JSON instances of their
schema (``jsonschema``, formats asserted) or were ended by ``max_tokens``, with constrain's tokens/s as a
share of the backend's.

Usage: ``.venv-vllm/bin/python bench/vllm.py [--schemas 16] [--max-tokens 128]``
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.machine import machine_line  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "maskbench" / "dev.jsonl.gz"
ENGINE = {"gpu_memory_utilization": 0.15, "max_model_len": 4096, "enforce_eager": True, "dtype": "float32"}
BACKENDS = ("xgrammar", "guidance")


def schemas(count: int) -> list[dict[str, Any]]:
    """``count`` MaskBench dev schemas, a seeded sample of those under 2,000 characters (the prompt holds one)."""
    if not DATA.is_file():
        sys.exit(f"MaskBench data not found at {DATA} (../shared beside the checkout)")
    with gzip.open(DATA, "rt") as f:
        entries = [json.loads(line) for line in f]
    small = [e["schema"] for e in entries if len(json.dumps(e["schema"])) < 2000]
    return random.Random(0).sample(small, count)


def valid(schema: dict[str, Any], text: str) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        return bool(cls(schema, format_checker=jsonschema.FormatChecker()).is_valid(value))
    except Exception:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemas", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    import constrain
    from constrain.integrations.vllm import EXTRA_ARGS_KEY

    print(machine_line())
    chosen = schemas(args.schemas)
    folder = constrain.export_model("smollm2-135m-instruct", Path(tempfile.mkdtemp()), dtype="float32")
    print(f"vLLM {__import__('vllm').__version__}, SmolLM2-135M float32, {len(chosen)} MaskBench schemas in one "
          f"batch, greedy, max_tokens={args.max_tokens}\n")  # fmt: skip
    print("| engine's backend | run | output tokens | s | tokens/s | valid outputs | ended by max_tokens "
          "| constrain's tokens/s vs the backend's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for backend in BACKENDS:
        llm = LLM(model=str(folder), seed=0, structured_outputs_config={"backend": backend}, **ENGINE)
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Write a JSON instance of this schema: {json.dumps(s)}"}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for s in chosen
        ]
        runs = {
            "constrain": [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                         extra_args={EXTRA_ARGS_KEY: {"json_schema": s}}) for s in chosen],
            f"vLLM {backend}": [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                               structured_outputs=StructuredOutputsParams(json=s)) for s in chosen],
        }  # fmt: skip
        # the schemas this backend takes (it refuses a batch holding one it does not support); a request of
        # one token each also compiles every schema before the timed runs
        taken = []
        for i, prompt in enumerate(prompts):
            try:
                for params in runs.values():
                    one = params[i].clone()
                    one.max_tokens = 1
                    llm.generate([prompt], one, use_tqdm=False)
                taken.append(i)
            except Exception as err:
                print(f"| {backend} | schema {i} refused | {type(err).__name__}: {str(err)[:100]} | | | | |")
        rates = {}
        for name, params in runs.items():
            start = time.perf_counter()
            outs = llm.generate([prompts[i] for i in taken], [params[i] for i in taken], use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            ok = sum(valid(chosen[i], o.outputs[0].text) for i, o in zip(taken, outs, strict=True))
            cut = sum(o.outputs[0].finish_reason == "length" for o in outs)
            rates[name] = tokens / seconds
            share = f"{rates['constrain'] / rates[name]:.0%}" if name != "constrain" else ""
            print(f"| {backend} | {name} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} | {ok} of {len(taken)} "
                  f"| {cut} | {share} |", flush=True)  # fmt: skip
        del llm


if __name__ == "__main__":
    main()
