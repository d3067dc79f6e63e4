"""The GDPO-vs-GRPO task: city-only tool-calling prompts with rewards of the paper's shape.

Requests for the weather or the time in a city (``examples/data/tool_exact.jsonl``); three
binary rewards, as in the paper's settings, one hard and two easy:

* ``tool_exact`` (hard): the call is exactly right (tool and city); rare at the start.
* ``tool_format`` (easy): think block, then the tool_call block, nothing else; about half
  the time at the start. Its breakages keep the call readable, so a correct call can be
  badly formatted and a wrong one well formatted.
* ``length`` (gated on ``tool_exact``): a short completion, counted only when correct.

With one correct rollout in a group, GRPO's summed reward cannot tell "correct, badly
formatted" from "wrong, well formatted" (both total 1); GDPO normalizes each reward in the
group, so the rare correct call gets its own large advantage. The base model is the demo's
tiny Llama, fine-tuned on demonstrations with one of the :data:`VARIANTS` of noise.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from gdpo_megatron.demo.task import CITIES, LONG_THOUGHT, SHORT_THOUGHT, render_completion

REWARDS = ("tool_format", "tool_exact", "length")
TOOLS = ("get_time", "get_weather")  # requests name a city: the call is right when it copies it
_TRAILERS = ["\nDone.", "\nI called the tool.", " ok"]


@dataclass(frozen=True)
class Noise:
    """How the warm-up demonstrations go wrong."""

    wrong: float  # share with a wrong call
    default_city: str | None  # a wrong call names this city; None: a random other city or tool
    broken_if_right: float  # share of right calls with a broken but readable format
    broken_if_wrong: float  # share of wrong calls with a broken but readable format
    short: float  # share with a short thought


VARIANTS = {
    # A wrong call names another city of the list (or, one time in four, the other tool).
    "random_city": Noise(wrong=0.5, default_city=None, broken_if_right=0.5, broken_if_wrong=0.5, short=0.5),
    # A wrong call always names one city that no request asks for: the base model copies the
    # requested city or falls back on the default, one decision that RL can shift.
    "default_city": Noise(wrong=0.6, default_city="London", broken_if_right=0.5, broken_if_wrong=0.5, short=0.3),
    # As default_city, but a right call is usually badly formatted and a wrong one usually well
    # formatted: the two kinds of answer GRPO's summed reward cannot tell apart.
    "tradeoff": Noise(wrong=0.6, default_city="London", broken_if_right=0.8, broken_if_wrong=0.2, short=0.3),
}
DEFAULT_VARIANT = "tradeoff"


def demonstration(example: dict, rng: random.Random, noise: Noise = VARIANTS[DEFAULT_VARIANT]) -> str:
    """A noisy answer to ``example``: rarely the right call, often badly formatted or long."""
    call = json.loads(json.dumps(example["tool_calls"][0]))
    wrong = rng.random() < noise.wrong
    if wrong:
        if noise.default_city is not None:
            call["arguments"]["city"] = noise.default_city
        elif rng.random() < 0.25:
            call["name"] = next(t for t in TOOLS if t != call["name"])
        else:
            call["arguments"]["city"] = rng.choice([c for c in CITIES if c != call["arguments"]["city"]])
    thought = SHORT_THOUGHT[call["name"]] if rng.random() < noise.short else LONG_THOUGHT.format(tool=call["name"])
    text = render_completion([call], thought)
    if rng.random() < (noise.broken_if_wrong if wrong else noise.broken_if_right):
        if rng.random() < 0.5:  # no think block
            text = text[text.index("<tool_call>"):]
        else:  # text after the call
            text += rng.choice(_TRAILERS)
    return text


def make_exact_base_model(out_dir, variant: str = DEFAULT_VARIANT, steps: int = 300):
    """The task's base model: the demo's tiny Llama warmed up on ``variant``'s demonstrations."""
    from gdpo_megatron.demo.warmup import make_base_model

    noise = VARIANTS[variant]
    return make_base_model(out_dir, steps=steps, demonstration=lambda ex, rng: demonstration(ex, rng, noise),
                           tools=TOOLS)
