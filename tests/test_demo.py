"""The bundled demo task: its committed prompt file and its noisy demonstrations."""
import random

from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.demo import task
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
