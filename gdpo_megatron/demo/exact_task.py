"""The GDPO-vs-GRPO task: the demo's tool-calling prompts with rewards of the paper's shape.

Three binary rewards, as in the paper's settings: a hard one and two easy ones.

* ``tool_exact`` (hard): the call is exactly right (tool and every argument value); the base
  model gets it about one time in ten.
* ``tool_format`` (easy): think block, then the tool_call block, nothing else; the base
  model gets it about half the time. Its breakages keep the call readable, so a correct
  call can be badly formatted and a wrong one well formatted.
* ``length`` (easy, gated on ``tool_exact``): a short completion, counted only when correct.

With one correct rollout in a group, GRPO's summed reward cannot tell "correct, badly
formatted" from "wrong, well formatted" (both total 1); GDPO normalizes each reward in the
group, so the rare correct call gets its own large advantage. The base model is the demo's
tiny Llama, fine-tuned on demonstrations with this noise (:func:`demonstration`).
"""
from __future__ import annotations

import json
import random

from gdpo_megatron.demo.task import CITIES, SHORT_TOKENS, _LONG_THOUGHT, _SHORT_THOUGHT, render_completion

REWARDS = ("tool_format", "tool_exact", "length")
TOOLS = ("get_time", "get_weather")  # requests name a city: the call is right when it copies it
WRONG = 0.5  # share of demonstrations with a wrong call
BROKEN = 0.5  # share of demonstrations with a broken (but readable) format
SHORT = 0.5  # share of demonstrations with a short thought
_TRAILERS = ["\nDone.", "\nI called the tool.", " ok"]


def demonstration(example: dict, rng: random.Random) -> str:
    """A noisy answer to ``example``: rarely the right call, often badly formatted or long."""
    call = json.loads(json.dumps(example["tool_calls"][0]))
    if rng.random() < WRONG:
        if rng.random() < 0.25:
            call["name"] = next(t for t in TOOLS if t != call["name"])
        else:
            call["arguments"]["city"] = rng.choice([c for c in CITIES if c != call["arguments"]["city"]])
    thought = _SHORT_THOUGHT[call["name"]] if rng.random() < SHORT else _LONG_THOUGHT.format(tool=call["name"])
    text = render_completion([call], thought)
    if rng.random() < BROKEN:
        if rng.random() < 0.5:  # no think block
            text = text[text.index("<tool_call>"):]
        else:  # text after the call
            text += rng.choice(_TRAILERS)
    return text


def make_exact_base_model(out_dir, steps: int = 300):
    """The task's base model: the demo's tiny Llama warmed up on these demonstrations."""
    from gdpo_megatron.demo.warmup import make_base_model

    return make_base_model(out_dir, steps=steps, demonstration=demonstration, tools=TOOLS)
