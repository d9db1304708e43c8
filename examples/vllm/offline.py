"""constrain inside vLLM, offline: export the packaged model, then ask vLLM for a validated Person.

Run in vLLM's environment (``make test-vllm`` builds ``.venv-vllm``; on CPU, ``VLLM_CPU_KVCACHE_SPACE=1``):
``.venv-vllm/bin/python examples/vllm/offline.py [FOLDER]``. The engine gets the processor explicitly
(``logits_processors=[ConstrainLogitsProcessor]``: constrain registers no entry point); a request opts in
with ``extra_args={"constrain": ...}``.
"""

import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel


class Person(BaseModel):
    name: str
    age: int


def main() -> None:
    from vllm import LLM, SamplingParams

    import constrain
    from constrain.integrations.vllm import ConstrainLogitsProcessor

    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "smollm2"
    if not (folder / "config.json").is_file():
        constrain.export_model("smollm2-135m-instruct", folder, dtype="float32")
    llm = LLM(
        str(folder), logits_processors=[ConstrainLogitsProcessor],
        gpu_memory_utilization=0.15, max_model_len=2048, enforce_eager=True, dtype="float32",
    )  # fmt: skip
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Extract the person: Maria Lopez, 42, lives in Madrid."}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    person_args = {"json_schema": Person.model_json_schema()}
    requests = [
        SamplingParams(temperature=0, max_tokens=60, extra_args={"constrain": person_args}),
        SamplingParams(temperature=0, max_tokens=8, extra_args={"constrain": {"regex": r"[A-Z][a-z]+"}}),
    ]
    person, city = (out.outputs[0].text for out in llm.generate([prompt, prompt], requests))
    print("person:", Person.model_validate_json(person))
    print("a capitalised word:", city)


if __name__ == "__main__":  # vLLM may spawn processes that import this file
    main()
