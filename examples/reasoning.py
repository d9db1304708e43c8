"""Think first, then answer in structure: ``reasoning=`` leaves the thinking free and constrains the answer.

1. load the default model (SmolLM2-135M-Instruct; it has no thinking tags of its own, so it is asked
   to think inside ``<think></think>``, constrain's default tags);
2. stream with ``reasoning={"max_tokens": 30}``: the thinking arrives as "reasoning" events; when its
   budget runs out, the end tag is forced; then the answer follows the schema;
3. read ``result.reasoning`` and the validated ``result.value``.
"""

from __future__ import annotations

from pydantic import BaseModel

import constrain


class Answer(BaseModel):
    apples: int


def main() -> None:
    model = constrain.load_model()
    messages = [
        {"role": "system", "content": "Think step by step inside <think></think> tags, then give the answer as JSON."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"},
    ]
    parts: dict[str, str] = {"reasoning": "", "answer": ""}
    result = None
    for item in constrain.stream(model, messages, schema=Answer, reasoning={"max_tokens": 30}, max_tokens=20,
                                 temperature=0):  # fmt: skip
        if isinstance(item, constrain.StreamEvent):
            parts[item.part] += item.delta
        else:
            result = item
    assert result is not None and parts["reasoning"] == result.reasoning and parts["answer"] == result.text
    print("thinking:", result.reasoning.strip())
    print("answer:  ", result.text, "->", repr(result.value))
    print(result.usage)


if __name__ == "__main__":
    main()
