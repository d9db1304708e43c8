"""Beam search under a grammar: the most likely complete, valid answers, with their scores.

Each beam has its own grammar state, forked from its parent's; only complete, valid outputs finish.
Two beams can hold the same text in different tokens (``"no"`` as one token, or as ``n`` + ``o``).
``length_penalty`` sets how scores weigh length: ``logprob / tokens ** length_penalty``.
"""

from __future__ import annotations

import constrain

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Spain", "Italy"]}},
    "required": ["city", "country"],
}


def main() -> None:
    model = constrain.load_model()
    question = [{"role": "user", "content": "Is Madrid the capital of Spain? Answer yes, no or maybe."}]
    r = constrain.generate(model, question, choices=["yes", "no", "maybe"], num_beams=3, length_penalty=0.0)
    print(f"answer: {r.value}")
    for beam in r.beams or []:
        print(f"  {beam.score:8.3f}  {beam.text!r}  ({len(beam.token_ids)} tokens)")
    extract = [{"role": "user", "content": "Extract the place: we landed in Madrid yesterday."}]
    r = constrain.generate(model, extract, schema=CITY, num_beams=3, max_tokens=40)
    print(f"value: {r.value}")
    for beam in r.beams or []:
        print(f"  {beam.score:8.3f}  {beam.text}  ({len(beam.token_ids)} tokens)")


if __name__ == "__main__":
    main()
