"""One batch, four constraints: a JSON schema, a regex, a shipped grammar and choices.

Every request keeps its own constraint and sampling parameters; the loop runs one forward pass per
step for all of them, one batched mask fill and one sampler call, and drops each row when it ends.
"""

from __future__ import annotations

import constrain


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def main() -> None:
    model = constrain.load_model()
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30}}, "required": ["city", "country"]}  # fmt: skip
    results = constrain.generate(
        model,
        [
            constrain.Request(
                ask("Where is the Eiffel Tower? Answer as JSON."), schema=city, sampling={"temperature": 0}
            ),
            constrain.Request(ask("Write a US phone number."), regex=r"\(\d{3}\) \d{3}-\d{4}", sampling={"seed": 1}),
            constrain.Request(
                ask("Write an arithmetic expression."), grammar="arithmetic", max_tokens=20, sampling={"seed": 2}
            ),
            constrain.Request(ask("Is water wet?"), choices=["yes", "no", "it depends"], sampling={"temperature": 0}),
        ],
    )
    for result in results:
        print(f"{result.finish_reason:>6} | {result.text!r} | valid={result.valid}")


if __name__ == "__main__":
    main()
