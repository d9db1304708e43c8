"""Typed partial objects while streaming: show each field of a ``Person`` as soon as it is final.

1. load the default model (SmolLM2-135M-Instruct, cached after the first run);
2. stream with ``schema=Person``: each event carries ``completed`` (the JSON pointers of the values
   that became final on that step) and ``value`` (a ``Person`` whose complete fields are validated,
   the others None);
3. read a completed field with ``constrain.decode.partial.resolve(event.value, pointer)``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

import constrain
from constrain.decode.partial import resolve


class Address(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    address: Address
    languages: list[str] = Field(max_length=4)


def main() -> None:
    model = constrain.load_model()
    text = "Kenji Tanaka is 35, lives in Osaka, Japan, and speaks Japanese and English."
    prompt = [{"role": "user", "content": f"Extract the person from this text as JSON: {text}"}]
    for event in constrain.stream(model, prompt, schema=Person, temperature=0, max_tokens=120):
        if isinstance(event, constrain.GenerationResult):
            print(f"done ({event.finish_reason}):", repr(event.value))
            break
        for pointer in event.completed:  # innermost first: "/address/city" before "/address"
            print(f"{pointer or '(the whole value)'!s:>20} = {resolve(event.value, pointer)!r}")
        if "/address/city" in event.completed:  # the partial value: complete fields set, the rest None
            print(f"{'so far':>20} : {event.value!r}")


if __name__ == "__main__":
    main()
