"""gdpo-eval on the CPU: greedy vLLM completions of a real checkpoint, scored by the rewards."""
import json

import pytest

from gdpo_megatron.data.bfcl import bfcl_accuracy, load_bfcl
from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.commands.eval import main
from gdpo_megatron.evaluate import evaluate
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.device import this_machine
from gdpo_megatron.rewards.tool_call import tool_correctness, tool_format

pytestmark = pytest.mark.slow


def test_reward_means_match_the_reward_functions(demo_base_model):
    samples = load_samples("examples/data/tool_demo.jsonl", "tool", "")[:6]
    rewards = [RewardSpec("tool_format"), RewardSpec("tool_correctness")]
    metrics, texts = evaluate(demo_base_model, samples, rewards, machine=this_machine(), max_new_tokens=80,
                              max_model_len=1024)
    assert len(texts) == 6 and metrics["eval/prompts"] == 6 and metrics["eval/skipped_too_long"] == 0
    truths = [s.ground_truth for s in samples]
    assert metrics["eval/tool_format/mean"] == pytest.approx(
        sum(tool_format(t, 0, g) for t, g in zip(texts, truths)) / 6, abs=1e-6)
    assert metrics["eval/tool_correctness/mean"] == pytest.approx(
        sum(tool_correctness(t, 0, g) for t, g in zip(texts, truths)) / 6, abs=1e-6)
    assert metrics["eval/tool_format/failures"] == 0


def test_bfcl_skips_prompts_that_do_not_fit_and_scores_the_rest(demo_base_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_base_model)
    samples = load_bfcl(limit=3)
    fits = [s for s in samples if len(encode_prompt(tokenizer, s.messages)) + 32 <= 1024]
    assert 0 < len(fits) < len(samples)
    out = tmp_path / "bfcl.json"
    # the context defaults to the model's 1024 positions
    assert main(["--model", demo_base_model, "--bfcl", "--limit", "3", "--max-new-tokens", "32",
                 "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert metrics["eval/prompts"] == len(fits)
    assert metrics["eval/skipped_too_long"] == len(samples) - len(fits)
    # the tiny demo model does not know BFCL's functions: every category present scores 0, of
    # the prompts that fit; a category none of whose prompts fit is not scored
    expected = bfcl_accuracy(fits, [""] * len(fits))
    assert {k: v for k, v in metrics.items() if k.startswith("eval/bfcl/")} == expected
    assert all(v == 0.0 for k, v in expected.items() if k.endswith("/accuracy"))
    assert sum(v for k, v in expected.items() if k.endswith("/prompts") and "overall" not in k) == len(fits)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdpo-eval:")]
    assert len(lines) == 1 and lines[0].startswith(
        f"gdpo-eval: {len(samples) - len(fits)} of {len(samples)} prompts are longer than --max-model-len 1024 "
        "minus --max-new-tokens 32 and are left out")


def test_toolrl_family_from_a_verl_parquet(demo_base_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(i, question, answer):  # ToolRL's rlla parquet layout, with prompts short enough for the tiny model
        return {"data_source": "rlla", "ability": "math",
                "prompt": [{"role": "system", "content": "Answer with <think> and <tool_call> or <response>."},
                           {"role": "user", "content": question}],
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"index": i, "split": "test"}}

    call = '<think> t </think>\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>'
    rows = [row(0, "Weather in Paris?", call), row(1, "Hello!", "<think> t </think>\n<response>Hi.</response>"),
            row(2, "Weather in Rome?", call.replace("Paris", "Rome"))]
    data = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "toolrl.json"
    # no --rewards: the family's own, ToolRL's format and correctness
    assert main(["--model", demo_base_model, "--data", str(data), "--family", "toolrl", "--limit", "2",
                 "--max-new-tokens", "32", "--max-model-len", "1024", "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert metrics["eval/prompts"] == 2 and metrics["eval/skipped_too_long"] == 0
    assert metrics["eval/toolrl_format/failures"] == metrics["eval/toolrl_correctness/failures"] == 0
    assert 0.0 <= metrics["eval/toolrl_format/mean"] <= 1.0
    assert -3.0 <= metrics["eval/toolrl_correctness/mean"] <= 3.0
