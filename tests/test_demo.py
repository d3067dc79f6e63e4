"""The bundled tasks (the demo's, and the GDPO-vs-GRPO one): prompt files, demonstrations, rewards."""
import random
from collections import Counter

import pytest

from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.demo import exact_task, task
from gdpo_megatron.rewards.registry import get_reward, load_reward_file
from gdpo_megatron.rewards.tool_call import tool_correctness, tool_format


def test_committed_prompt_file_is_what_the_generator_writes(tmp_path):
    task.write_jsonl(tmp_path / "tool_demo.jsonl", 512, 7)
    assert (tmp_path / "tool_demo.jsonl").read_text() == open("examples/data/tool_demo.jsonl").read()


def test_demonstrations_earn_each_reward_only_part_of_the_time():
    samples = load_samples("examples/data/tool_demo.jsonl", "tool", "")
    rng = random.Random(0)
    records = task.make_examples(400, 3)
    texts = [task.demonstration(r, rng) for r in records]
    formats = [tool_format(t, 0, {"tool_calls": r["tool_calls"]}) for t, r in zip(texts, records)]
    exact = [tool_correctness(t, 0, {"tool_calls": r["tool_calls"]}) == 3.0 for t, r in zip(texts, records)]
    assert 0.7 < sum(formats) / 400 < 0.95  # ~16% are broken on purpose
    assert 0.4 < sum(exact) / 400 < 0.75  # ~35% call the wrong tool or argument
    assert samples[0].messages[0] == {"role": "system", "content": task.SYSTEM_PROMPT}
    # the rendered right answer scores full marks
    right = task.render_completion(records[0]["tool_calls"], "x")
    assert tool_format(right, 0, records[0]) == 1.0 and tool_correctness(right, 0, records[0]) == 3.0


def _tool_exact():
    load_reward_file("gdpo_megatron/demo/exact_rewards.py")  # as configs/tiny_cpu_exact.yaml loads it
    return get_reward("tool_exact")


def test_exact_task_prompt_file_is_what_the_generator_writes(tmp_path):
    task.write_jsonl(tmp_path / "tool_exact.jsonl", 512, 11, exact_task.TOOLS)
    assert (tmp_path / "tool_exact.jsonl").read_text() == open("examples/data/tool_exact.jsonl").read()
    config = load_config(TrainConfig, "configs/tiny_cpu_exact.yaml")
    assert config.data.train_path == "examples/data/tool_exact.jsonl"
    assert config.rewards.names == list(exact_task.REWARDS)


@pytest.mark.parametrize("variant", sorted(exact_task.VARIANTS))
def test_exact_task_demonstrations_separate_format_from_correctness(variant):
    tool_exact, noise = _tool_exact(), exact_task.VARIANTS[variant]
    rng = random.Random(0)
    records = task.make_examples(4000, 5, exact_task.TOOLS)
    texts = [exact_task.demonstration(r, rng, noise) for r in records]
    exact = [tool_exact(t, 0, r) for t, r in zip(texts, records)]
    formats = [tool_format(t, 0, r) for t, r in zip(texts, records)]
    assert abs(1 - sum(exact) / 4000 - noise.wrong) < 0.03
    broken = noise.wrong * noise.broken_if_wrong + (1 - noise.wrong) * noise.broken_if_right
    assert abs(1 - sum(formats) / 4000 - broken) < 0.03
    pairs = Counter(zip(exact, formats))
    # every combination occurs: a correct call can be badly formatted and a wrong one well formatted
    for combo in [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (0.0, 0.0)]:
        assert pairs[combo] / 4000 > 0.04, pairs
    if noise.default_city:  # every wrong call names the default city, which no request asks for
        wrong = [t for t, e in zip(texts, exact) if not e]
        assert all(f'"city": "{noise.default_city}"' in t for t in wrong)
        assert all(noise.default_city not in m["content"] for r in records for m in r["messages"])


@pytest.mark.parametrize("completion, expected", [
    ('<think>x</think>\n<tool_call>\n[{"name": "get_time", "arguments": {"city": "Lima"}}]\n</tool_call>', 1.0),
    ('<tool_call>[{"name": "get_time", "arguments": {"city": "Lima"}}]</tool_call> trailing text', 1.0),
    ('<tool_call>{"name": "get_time", "arguments": {"city": "Lima"}}</tool_call>', 1.0),  # one object
    ('<tool_call>[{"name": "get_time", "arguments": {"city": "lima"}}]</tool_call>', 0.0),  # case
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Lima"}}]</tool_call>', 0.0),  # tool
    ('<tool_call>[{"name": "get_time", "arguments": {"city": "Lima", "unit": "c"}}]</tool_call>', 0.0),
    ('<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>', 0.0),
    ('<tool_call>[{"name": "get_time", "arguments": {"city": "Lima"}}, '
     '{"name": "get_time", "arguments": {"city": "Lima"}}]</tool_call>', 0.0),  # the call twice
    ('<tool_call>[{"name": "get_time", "arguments": {"city": "Lima"}}]</tool_call>'
     '<tool_call>[{"name": "get_time", "arguments": {"city": "Oslo"}}]</tool_call>', 0.0),  # hedging
    ('<tool_call>[{"name": "get_time", "arguments": {"city": ["Lima", "Oslo"]}}]</tool_call>', 0.0),
    ('<tool_call>[{"name": "get_time", "arguments": {"city": "Lima"}}]', 0.0),  # unclosed
    ('get_time Lima', 0.0),
    ('<tool_call>not json</tool_call>', 0.0),
])
def test_tool_exact_pays_only_for_exactly_the_expected_call(completion, expected):
    truth = {"tool_calls": [{"name": "get_time", "arguments": {"city": "Lima"}}]}
    assert _tool_exact()(completion, 10, truth) == expected
