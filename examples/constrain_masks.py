"""What a compiled constraint does, token by token, with the real SmolLM2 tokenizer.

1. compile a Pydantic model's schema (cached) and read its coverage report;
2. walk a JSON text through the matcher: fill the mask, check the token, accept it;
3. see the forced text (what jump-forward decoding will append without sampling);
4. validate finished text, including what the grammar cannot enforce.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

import constrain
from constrain.testing import token_ids


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    tags: list[str] = Field(max_length=3)


def main() -> None:
    tokenizer = constrain.load_tokenizer()  # SmolLM2-135M-Instruct's, converted once and cached
    compiled = constrain.compile(constrain.json_schema(Person), tokenizer)
    checked = [f"{e.pointer or '/'} {e.keyword}" for e in compiled.coverage if e.status == "checked"]
    print(f"enforced by the mask: {compiled.fully_enforced}; value checks: {compiled.value_checks is not None}")
    print(f"checked afterwards only: {checked}")

    matcher = compiled.matcher()
    bitmask = constrain.allocate_token_bitmask(1, compiled.vocab_size)
    print(f"forced at the start: {matcher.forced_text()!r}")
    text = '{"name": "Ada", "age": 36, "tags": ["math"]}'  # generation mode: json.dumps, in the schema's order
    for token in token_ids(tokenizer, text):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
        assert allowed and matcher.accept_token(token)
    print(f"{text} accepted token by token; the grammar can end: {matcher.is_completed()}")
    bad = '{"name": "Ada", "age": 200, "tags": []}'
    print(f"validate({text}) -> {compiled.validate(text)}")
    print(f"validate({bad}) -> {compiled.validate(bad)}")


if __name__ == "__main__":
    main()
