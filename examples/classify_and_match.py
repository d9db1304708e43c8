"""Classification with choices, a date with a regex, and one streamed answer, in one run."""

from __future__ import annotations

import constrain


def main() -> None:
    model = constrain.load_model()
    review = "The battery died after two days and support never answered."
    label = constrain.generate(
        model, [{"role": "user", "content": f"Sentiment of this review: {review}"}],
        choices=["positive", "negative", "neutral"], temperature=0,
    )  # fmt: skip
    print(f"sentiment: {label.value}")
    date = constrain.generate(
        model, [{"role": "user", "content": "When did the Apollo 11 landing happen? Give the date."}],
        regex=r"\d{4}-\d{2}-\d{2}", temperature=0,
    )  # fmt: skip
    print(f"date: {date.value}")
    print("streamed: ", end="")
    for event in constrain.stream(model, [{"role": "user", "content": "Name a prime number."}], regex=r"[1-9]\d{0,2}"):
        if isinstance(event, constrain.StreamEvent):
            print(event.delta, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
