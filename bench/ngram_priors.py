"""Prompt lookup's priors, measured: how often its first draft is right, and how far a right one goes on.

Generates on the default model, speculation off, 24 prompts that no other benchmark uses (summaries,
rewrites, extractions, code, SQL, YAML, poems, explanations), greedy and sampled (temperature 0.7,
seed 1), ``--tokens`` each. Then, at every output position, asks :func:`ngram_match` where the history so
far was found earlier and compares what followed there with what the model wrote. Prints, per place
(the drafts continue the prompt or the output) and match length (5: 5 or more), the proposals, the share
whose first draft was right, the drafts kept on average once it was (up to 16), and the ``run`` that mean
gives a geometric run (``1 - 1 / mean``); beside them, the table ``NGRAM_PRIORS`` holds.

Usage: ``python bench/ngram_priors.py [--tokens 96]``
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections import defaultdict
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import constrain  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from constrain.decode import loop  # noqa: E402
from constrain.decode.drafts import MAX_DRAFT  # noqa: E402
from constrain.decode.speculative import NGRAM_PRIORS, ngram_match  # noqa: E402

gen = importlib.import_module("constrain.generation")

PROMPTS = (
    "Summarize in two sentences: The city council voted on Tuesday to extend the night bus network to the northern "
    "suburbs, after residents of Harlow Park and Eastfield collected four thousand signatures.",
    "Rewrite this sentence in the past tense: Every morning the baker opens the shop at six, lights the ovens and "
    "sets out the bread.",
    "Write a Python function that returns the nth Fibonacci number.",
    "What are three tips for learning a new language?",
    "Extract the dates mentioned: The contract was signed on 3 March 2021, amended on 14 July 2022 and expires on "
    "31 December 2025.",
    "Copy this address exactly, then say which country it is in: 221B Baker Street, London NW1 6XE.",
    "Translate to French: The library opens at nine and closes at five on weekdays.",
    "Write a short poem about the sea.",
    "List the ingredients in this recipe: Mix two cups of flour, one egg, a pinch of salt and half a cup of milk, "
    "then bake for twenty minutes.",
    "Explain what a hash table is.",
    "Fix the grammar: Me and him goes to the market every days for buying vegetable.",
    "Give the title of this article as JSON: 'Local Farmers Turn to Solar Pumps as Diesel Prices Climb' by Anna "
    "Reyes, published in the Valley Times.",
    "Quote the first line of this poem and explain it: 'The fog comes on little cat feet. It sits looking over "
    "harbor and city on silent haunches and then moves on.'",
    "Convert to a bulleted list: apples, pears, three kinds of plums, walnuts and a jar of honey from the village "
    "market.",
    "Write an email to a colleague asking to move our meeting from Thursday to Friday afternoon.",
    "Repeat the following serial number and tell me its format: XK-4471-BQ-0093.",
    "Describe how photosynthesis works in simple terms.",
    "Correct the spelling: The recieved package was definately damaged during transportaion.",
    "Write a SQL query that counts orders per customer in a table named orders with columns id, customer_id and total.",
    "Extract the names of the people: At the meeting, Priya Nair presented the budget, Tom Becker asked about "
    "hiring, and Lena Okafor closed the session.",
    "Tell me a joke about computers.",
    "Paraphrase: The committee postponed its decision until further evidence about the bridge's safety becomes "
    "available.",
    "Return this configuration as YAML: host is db.internal, port is 5432, user is reporter, timeout is 30 seconds.",
    "What happened in the story of the tortoise and the hare?",
)
LONGEST = 5
"""Matches of this many tokens or more are counted together (the tables' last row)."""


def tally(prompt: list[int], output: list[int], counts: dict[tuple[str, int], list[int]]) -> None:
    """Add each output position's proposal to ``counts[place, length]``: [proposals, first right, drafts kept]
    (mutated)."""
    history = list(prompt)
    for position, token in enumerate(output):
        match = ngram_match(history)
        if match is not None:
            at, length = match
            kept = 0
            for draft, written in zip(history[at : at + MAX_DRAFT], output[position:], strict=False):
                if draft != written:
                    break
                kept += 1
            row = counts["prompt" if at < len(prompt) else "output", min(length, LONGEST)]
            row[0], row[1], row[2] = row[0] + 1, row[1] + (kept > 0), row[2] + kept
        history.append(token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=96, help="tokens generated per prompt and decoding")
    args = parser.parse_args()
    print(machine_line())
    handle = constrain.load_model()
    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0])
    for sampling in ({"temperature": 0}, {"temperature": 0.7, "seed": 1}):
        for text in PROMPTS:
            spec = constrain.Request([{"role": "user", "content": text}], max_tokens=args.tokens, sampling=sampling)
            requests = list(gen.admit(handle, spec))
            loop.run(handle, requests, {}, speculative=False)
            tally(list(requests[0].prompt_ids), list(requests[0].output_ids), counts)
    print(f"{sum(row[0] for row in counts.values())} proposals over {2 * len(PROMPTS)} generations\n")
    print("| place | match | proposals | first right | kept once right | run | NGRAM_PRIORS (prior, run) |")
    print("|---|---|---|---|---|---|---|")
    for (place, length), (proposals, right, kept) in sorted(counts.items()):
        mean = kept / right if right else 0.0
        held = [row for row in NGRAM_PRIORS[place] if length >= row[0]][-1]
        print(f"| {place} | {length}{'+' if length == LONGEST else ''} | {proposals} | {right / proposals:.0%} "
              f"| {mean:.2f} | {1 - 1 / mean if mean else 0.0:.2f} | {held[1]}, {held[2]} |")  # fmt: skip


if __name__ == "__main__":
    main()
