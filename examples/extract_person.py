"""Pydantic extraction: the result's value is a validated ``Person``.

1. load the default model (SmolLM2-135M-Instruct, cached after the first run);
2. generate with ``schema=Person``: the grammar forces the keys, the sampler picks the values;
3. read ``result.value`` (a ``Person``) or ``result.violations``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

import constrain


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    city: str = Field(max_length=40)


def main() -> None:
    model = constrain.load_model()
    text = "Yesterday I met Kenji Tanaka. He is 35 years old and lives in Osaka."
    prompt = [{"role": "user", "content": f"Extract the person from this text as JSON: {text}"}]
    result = constrain.generate(model, prompt, schema=Person, temperature=0, max_tokens=80)
    print(result.text)
    print(repr(result.value), result.finish_reason, result.usage)


if __name__ == "__main__":
    main()
