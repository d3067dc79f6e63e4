"""The city-desk base model: the demo model, warmed up on noisy two-turn trajectories.

``configs/multi_turn_cpu.yaml`` asks two-turn city questions through
``examples/environments/city_desk.py``. The demo model (:mod:`gdpo_megatron.demo.warmup`) has
seen only single requests answered by one call, never a tool's reply or a second user turn:
after its first turn it writes hardly a call that parses, and almost no trajectory leaves
CityDesk in the reference's state, so reinforcement learning has nothing to reinforce. This
warm-up continues it on generated two-turn questions (:func:`make_questions`: none of them is
one of the training rows' questions, though a single request of one, "What is the weather in
Oslo?", may be a turn of a generated question), each answered by a demonstration encoded as a rollout encodes it: a call, CityDesk's
reply as a ``tool`` message, a plain answer that reads the reply (``"fog in Oslo."``), the next
user turn, and so on; the loss is on the model's messages only. The demonstrations are noisy,
so the warmed-up model gets a turn right only part of the time:

* a call names the other tool in ``WRONG_TOOL`` of them, and comes after the demo task's long
  thought in ``LONG_THOUGHT`` (too long for the config's ``rollout.max_new_tokens``: the cut
  call does not parse);
* after the reply, in ``CALL_AGAIN`` of the turns it calls again instead of answering: one
  lookup more than the question asked, so that turn's state is wrong.

The city is always the one asked for: copying it is the skill the tiny model takes longest to
pick up, and the warm-up's default 200 steps are about what it needs.

``python -m gdpo_megatron.demo.city_desk_base runs/city_desk_base`` (``make
runs/city_desk_base``) writes it from ``runs/demo_base``, which it writes first, as ``make
demo`` does, when it is missing.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.demo import task
from gdpo_megatron.environments.calls import CallRefused
from gdpo_megatron.environments.environment import ERROR_PREFIX
from gdpo_megatron.environments.registry import environment_reference, make_environment
from gdpo_megatron.environments.trajectory import Message
from gdpo_megatron.trajectories import continuation_tokens

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENVIRONMENT = environment_reference("CityDesk", str(EXAMPLES / "environments/city_desk.py"))
TRAINING_ROWS = EXAMPLES / "data/city_desk.jsonl"  # configs/multi_turn_cpu.yaml's questions
TOOLS = ("get_time", "get_weather")  # what the city-desk questions ask for
WEATHER = ["sunny", "rain", "fog", "snow"]
CALL_AGAIN = 0.3  # share of turns whose demonstration calls again after the reply
WRONG_TOOL, LONG_THOUGHT = 0.1, 0.4  # shares of demonstrated calls with the wrong tool, a long thought


def make_questions(count: int, seed: int) -> list[dict]:
    """``count`` two-turn questions in the rows' layout (``messages``, ``multi_turn``), each turn
    one request of the demo task for ``TOOLS`` (``requests``, the demo task's records); none of
    them one of the training questions (:func:`training_questions`)."""
    rng = random.Random(seed)
    held_out = training_questions()
    out: list[dict] = []
    draw = 0
    while len(out) < count:
        requests = task.make_examples(2 * count, seed + 7919 * draw, TOOLS)
        draw += 1
        for first, second in zip(requests[::2], requests[1::2]):
            if len(out) == count or (first["messages"][-1]["content"], second["messages"][-1]["content"]) in held_out:
                continue
            cities = [r["tool_calls"][0]["arguments"]["city"] for r in (first, second)]
            out.append({
                "messages": first["messages"],
                "multi_turn": {"environment_config": {"weather": {c: rng.choice(WEATHER) for c in cities}},
                               "reference_calls": [[_call_text(r["tool_calls"][0])] for r in (first, second)],
                               "later_turns": [second["messages"][1:]]},
                "requests": [first, second],
            })
    return out


def training_questions() -> set[tuple[str, ...]]:
    """The user turns of each question of :data:`TRAINING_ROWS`."""
    questions = set()
    for line in TRAINING_ROWS.read_text().splitlines():
        row = json.loads(line)
        turns = [row["messages"], *row["multi_turn"]["later_turns"]]
        questions.add(tuple(messages[-1]["content"] for messages in turns))
    return questions


def _call_text(call: dict) -> str:
    return f"{call['name']}({', '.join(f'{k}={v!r}' for k, v in call['arguments'].items())})"


def noisy_call(request: dict, rng: random.Random) -> str:
    """The call ``request`` asks for, the other tool in ``WRONG_TOOL`` of them; after the demo
    task's long thought in ``LONG_THOUGHT`` of them (which ``max_new_tokens: 48`` cuts)."""
    call = {"name": request["tool_calls"][0]["name"], "arguments": dict(request["tool_calls"][0]["arguments"])}
    if rng.random() < WRONG_TOOL:
        call["name"] = next(t for t in TOOLS if t != call["name"])
    long = rng.random() < LONG_THOUGHT
    return task.render_completion([call], task.LONG_THOUGHT.format(tool=call["name"]) if long
                                  else task.SHORT_THOUGHT[call["name"]])


def plain_answer(observation: str) -> str:
    """A short answer that reads a CityDesk reply: ``"fog in Oslo."``."""
    try:
        reply = json.loads(observation)
    except ValueError:
        return "Sorry, that failed."
    return f"{reply.get('weather', reply.get('time'))} in {reply['city']}."


def demonstration_row(tokenizer, question: dict, rng: random.Random, max_steps_per_turn: int = 2
                      ) -> tuple[list[int], list[int]]:
    """One noisy demonstration of ``question`` as (token ids, loss mask over the model's tokens),
    the messages after each model message encoded as the rollout encodes them
    (:func:`gdpo_megatron.trajectories.continuation_tokens`)."""
    environment = make_environment(ENVIRONMENT)
    environment.reset(question["multi_turn"]["environment_config"])
    later = question["multi_turn"]["later_turns"]
    chat = [dict(m) for m in question["messages"]]
    ids = encode_prompt(tokenizer, chat)
    mask = [0] * len(ids)
    for turn, request in enumerate(question["requests"]):
        steps = 0
        while True:
            text = noisy_call(request, rng) if steps == 0 or rng.random() < CALL_AGAIN else None
            calls = Message(text).calls() if text is not None else None
            new = []
            if calls is not None:
                observation = (f"{ERROR_PREFIX}{calls}" if isinstance(calls, CallRefused)
                               else environment.step(calls).observation)
                new.append({"role": "tool", "content": observation})
            else:
                text = plain_answer(chat[-1]["content"])
            steps += 1
            ends_turn = calls is None or steps >= max_steps_per_turn
            if ends_turn and turn < len(later):
                new += later[turn]
            sampled = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids += sampled
            mask += [1] * len(sampled)
            if new:
                reply, following = continuation_tokens(tokenizer, chat, sampled, "stop", new)
                chat += [{"role": "assistant", "content": reply}, *new]
                ids += following
                mask += [0] * len(following)
            if ends_turn:
                break
    return ids, mask


def make_city_desk_base_model(base_model: str | Path, out_dir: str | Path, steps: int = 200, batch_size: int = 16,
                              lr: float = 3e-3, seed: int = 0) -> Path:
    """Fine-tune ``base_model`` (a demo model) ``steps`` steps on noisy two-turn demonstrations;
    save it with its tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from gdpo_megatron.demo.warmup import fine_tune, padded_batches, save_model

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = LlamaForCausalLM.from_pretrained(base_model)
    rng = random.Random(seed)
    questions = make_questions(max(steps, 1) * batch_size // 2, seed + 1)  # each seen about twice
    rows = [demonstration_row(tokenizer, q, rng) for q in questions]
    fine_tune(model, padded_batches(rows, batch_size, tokenizer.pad_token_id, rng), steps, lr)
    return save_model(model, tokenizer, Path(out_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdpo_megatron.demo.city_desk_base",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default="runs/city_desk_base")
    parser.add_argument("--base", default="runs/demo_base", help="the demo model (written first when missing)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if Path(args.out_dir).exists():
        parser.error(f"{args.out_dir} exists; remove it to write the base model again")
    import torch

    from gdpo_megatron.demo.warmup import make_base_model

    torch.set_num_threads(1)
    if not Path(args.base, "config.json").is_file():
        print(f"writing the demo model to {args.base}")
        make_base_model(args.base)
    make_city_desk_base_model(args.base, args.out_dir, args.steps)
    print(f"wrote {args.out_dir}: {args.base} after {args.steps} steps on two-turn city-desk demonstrations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
