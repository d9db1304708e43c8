"""Function calling: the model calls a Python function, the result goes back, the model answers.

1. describe the tools: a Python function (its schema comes from the type hints) and a Pydantic model;
2. ``constrain.chat(..., tool_choice="required")``: the prompt presents the tools in SmolLM2's
   format, the grammar makes the reply a call with valid arguments, the reply is parsed;
3. ``call.run()`` calls the function with the validated arguments;
4. the call and its result join the conversation, and ``tool_choice="none"`` asks for a text answer.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

import constrain


def get_weather(city: Annotated[str, Field(max_length=40)], unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Get the current weather in a city."""
    return f"18 degrees {unit}, light rain in {city}"


class Reminder(BaseModel):
    """Set a reminder."""

    text: str = Field(max_length=80)
    minutes: int = Field(ge=1, le=1440)


def main() -> None:
    model = constrain.load_model()
    messages = [{"role": "user", "content": "What is the weather like in Lisbon?"}]
    tools = [get_weather, Reminder]
    reply = constrain.chat(model, messages, tools=tools, tool_choice="required", temperature=0)
    print(reply.generation.text)
    messages.append({"role": "assistant", "content": None, "tool_calls": [c.openai() for c in reply.tool_calls]})
    for call in reply.tool_calls:
        result = call.run() if call.tool.function is not None else repr(call.arguments)
        print(f"{call.name}({call.arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = constrain.chat(model, messages, tools=tools, tool_choice="none", temperature=0, max_tokens=40)
    print(answer.content, answer.finish_reason)


if __name__ == "__main__":
    main()
