"""The bundled demo task: synthetic tool calling with three rewards.

A user asks for the weather or the time in a city, or a currency conversion; the right
answer is one tool call with the city (or amount and currencies) copied from the request:

    <think>weather</think>
    <tool_call>
    [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    </tool_call>

Rewards: ``tool_format`` (structure), ``tool_correctness`` (ToolRL score in [-3, 3]) and
``length`` (at most ``SHORT_TOKENS`` completion tokens), the last conditioned on an exactly
correct call. A tiny random model cannot find this format by sampling, so the demo first
fine-tunes it on *noisy* demonstrations (:func:`demonstration`): some are wrong, long-winded
or malformed, so the warmed-up model gets each reward only part of the time and RL has
something to learn.
"""
from __future__ import annotations

import json
import random

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Seoul", "Quito", "Accra", "Hanoi", "Bern"]
CURRENCIES = ["usd", "eur", "yen", "gbp", "inr"]
REWARDS = ("tool_format", "tool_correctness", "length")
SHORT_TOKENS = 50  # completions up to this many tokens earn the length reward
SYSTEM_PROMPT = "Answer with one tool call."
USER, ASSISTANT, EOS = "<|user|>", "<|assistant|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}\n"
    "{% else %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

_REQUESTS = {
    "get_weather": ["What is the weather in {city}?", "Weather for {city} please.", "Is it raining in {city}?"],
    "get_time": ["What time is it in {city}?", "Tell me the local time in {city}.", "Current time in {city}?"],
    "convert_currency": ["Convert {amount} {src} to {dst}.", "How much is {amount} {src} in {dst}?"],
}
TOOLS = tuple(sorted(_REQUESTS))  # every tool the prompts ask for
SHORT_THOUGHT = {"get_weather": "weather", "get_time": "time", "convert_currency": "convert"}
LONG_THOUGHT = "the user asks me something, so I look at the request and pick the {tool} tool for it"


def make_examples(count: int, seed: int, tools: tuple[str, ...] = TOOLS) -> list[dict]:
    """``count`` records in the tool-family JSONL format (``messages``, ``tool_calls``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        tool = rng.choice(tools)
        if tool == "convert_currency":
            src, dst = rng.sample(CURRENCIES, 2)
            args = {"amount": rng.randint(2, 99), "from": src, "to": dst}
            text = rng.choice(_REQUESTS[tool]).format(amount=args["amount"], src=src, dst=dst)
        else:
            args = {"city": rng.choice(CITIES)}
            text = rng.choice(_REQUESTS[tool]).format(city=args["city"])
        out.append({
            "id": f"tool-demo-{seed}-{len(out)}",
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
            "tool_calls": [{"name": tool, "arguments": args}],
        })
    return out


def render_completion(calls: list[dict], thought: str) -> str:
    return f"<think>{thought}</think>\n<tool_call>\n{json.dumps(calls)}\n</tool_call>"


def demonstration(example: dict, rng: random.Random) -> str:
    """A noisy answer to ``example``: right about half the time, often long, sometimes broken."""
    call = json.loads(json.dumps(example["tool_calls"][0]))
    roll = rng.random()
    if roll < 0.25:  # wrong argument value
        if "city" in call["arguments"]:
            call["arguments"]["city"] = rng.choice(CITIES)
        else:
            call["arguments"]["amount"] = rng.randint(2, 99)
    elif roll < 0.35:  # wrong tool
        call["name"] = rng.choice([t for t in _REQUESTS if t != call["name"]])
    thought = SHORT_THOUGHT[call["name"]] if rng.random() < 0.4 else LONG_THOUGHT.format(tool=call["name"])
    text = render_completion([call], thought)
    breakage = rng.random()
    if breakage < 0.08:
        text = text.replace("</think>", "")
    elif breakage < 0.16:
        text = text.replace("\n</tool_call>", "")
    return text


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Text the demo tokenizer is trained on: prompts and answers of every kind."""
    rng = random.Random(seed)
    examples = make_examples(400, seed)
    corpus = [m["content"] for e in examples for m in e["messages"]]
    corpus += [demonstration(e, rng) for e in examples]
    corpus += [render_completion(e["tool_calls"], SHORT_THOUGHT[e["tool_calls"][0]["name"]]) for e in examples]
    return corpus


def write_jsonl(path, count: int, seed: int, tools: tuple[str, ...] = TOOLS) -> None:
    """The demo's prompt file (``examples/data/tool_demo.jsonl`` is ``write_jsonl(path, 512, 7)``)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in make_examples(count, seed, tools):
            f.write(json.dumps(record) + "\n")
