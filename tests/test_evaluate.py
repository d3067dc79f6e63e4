"""gdpo-eval on the CPU: vLLM completions of a real checkpoint, scored by the rewards; a trained
export evaluated as it was trained; the engine's KV cache sized for the evaluation."""
import json
import math
from pathlib import Path

import pytest

from gdpo_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
from gdpo_megatron.data.bfcl import bfcl_accuracy, load_bfcl
from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.commands.eval import main
from gdpo_megatron.evaluate import evaluate
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.device import this_machine
from gdpo_megatron.rewards.tool_call import tool_correctness, tool_format
from gdpo_megatron.rollout.engine import SamplingConfig

pytestmark = pytest.mark.slow

DEMO_CONFIG = "configs/tiny_cpu.yaml"
DEMO_DATA = "examples/data/tool_demo.jsonl"


def test_reward_means_match_the_reward_functions(demo_base_model):
    samples = load_samples(DEMO_DATA, "tool", "")[:6]
    rewards = [RewardSpec("tool_format"), RewardSpec("tool_correctness")]
    metrics, texts = evaluate(demo_base_model, samples, rewards, machine=this_machine(),
                              model=model_config_from_hf(read_hf_config(demo_base_model)),
                              sampling=SamplingConfig(temperature=0.0, max_new_tokens=80), max_model_len=1024)
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
    assert len(lines) == 2 and lines[0].startswith(
        f"gdpo-eval: {len(samples) - len(fits)} of {len(samples)} prompts are longer than --max-model-len 1024 "
        "minus --max-new-tokens 32 and are left out")
    assert lines[1] == (f"gdpo-eval: BFCL's prompts; max_new_tokens 32 (given), greedy (default); {demo_base_model} "
                        "has no gdpo_training.json")


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


def _encoded(tokenizer, samples) -> list[list[int]]:
    """Each prompt as the trainer and the engine see it: the chat template's text, tokenized."""
    return [tokenizer(tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for s in samples]


def test_the_engine_gets_the_kv_cache_the_evaluation_needs(demo_base_model, monkeypatch):
    from transformers import AutoTokenizer

    from gdpo_megatron.rollout import factory
    from gdpo_megatron.rollout.vllm_engine import CPU_BLOCK_SIZE

    blocks = []  # the KV cache of each engine built, in blocks, as vLLM allocated it
    build = factory.build_engine

    def build_and_measure(*args, **kwargs):
        engine = build(*args, **kwargs)
        blocks.append(engine._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
        return engine

    monkeypatch.setattr(factory, "build_engine", build_and_measure)
    command = ["--model", demo_base_model, "--data", DEMO_DATA, "--family", "tool", "--system-prompt", "",
               "--limit", "8", "--max-new-tokens", "40", "--max-model-len", "256"]
    assert main(command) == 0
    assert main([*command, "--kv-cache-gib", "0.01"]) == 0

    hf = json.loads((Path(demo_base_model) / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    block_bytes = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4 * CPU_BLOCK_SIZE  # fp32 K, V
    longest = max(map(len, _encoded(AutoTokenizer.from_pretrained(demo_base_model),
                                     load_samples(DEMO_DATA, "tool", "")[:8])))
    per_prompt = math.ceil((longest + 40) / CPU_BLOCK_SIZE)
    assert 8 * per_prompt > 256 // CPU_BLOCK_SIZE  # the prompts, not one full context, size the cache
    # all 8 prompts at once, each up to the longest + 40 new tokens in whole blocks, one block vLLM keeps aside
    assert blocks == [8 * per_prompt + 1, int(0.01 * 2**30) // block_bytes]


def _train(overrides):
    from gdpo_megatron.config import TrainConfig, load_config
    from support.trainer import make_trainer

    trainer = make_trainer(load_config(TrainConfig, DEMO_CONFIG, overrides))
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_a_trained_export_scores_what_training_reported(demo_base_model, tmp_path, capsys):
    """The demo trains without the family's instructions (data.system_prompt: ""); its export,
    evaluated with no prompt or sampling flag, sees the prompts training saw, token for token,
    and scores what training reported, within the sampling noise of both (with the family's
    instructions this model scores 0 and -3, the lowest possible, far outside it)."""
    from transformers import AutoTokenizer

    from gdpo_megatron.checkpoint.trained_with import read_trained_with
    from gdpo_megatron.commands import convert
    from gdpo_megatron.commands.eval import parse, settings
    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.config.policy import ParallelConfig
    from gdpo_megatron.metrics import read_metrics
    from gdpo_megatron.preflight.validation import data_prompts, training_prompts
    from support.local_world import run_local

    run_dir = tmp_path / "run"
    overrides = [f"base_model={demo_base_model}", f"run_dir={run_dir}", "steps=3", "logging.progress_bar=false"]
    assert run_local(_train, 1, overrides) == ["done"]
    export = run_dir / "hf"
    command = ["--model", str(export), "--data", DEMO_DATA]  # all 512 rows: the noise of 512 completions

    # The prompts gdpo-eval builds are the training's for the same rows; the family's own
    # instructions (what gdpo-eval used to add) would not be.
    tokenizer = AutoTokenizer.from_pretrained(export)
    config = load_config(TrainConfig, DEMO_CONFIG, overrides)
    trained = _encoded(tokenizer, training_prompts(config))
    assert _encoded(tokenizer, data_prompts(settings(parse(command), read_trained_with(export)).data,
                                            "--data")) == trained
    assert _encoded(tokenizer, load_samples(DEMO_DATA, "tool")) != trained
    # gdpo-convert of the run's checkpoint carries the same record as the export
    plan = convert.check(convert.parse(["megatron-to-hf", str(run_dir / "checkpoints"), str(tmp_path / "hf")]),
                         ParallelConfig(), 1)
    assert plan.trained == read_trained_with(export)

    out = tmp_path / "eval.json"
    assert main([*command, "--out", str(out)]) == 0
    assert f"gdpo-eval: family tool (trained), system prompt none (trained); max_new_tokens 80 (trained), " \
        f"temperature 1 (trained), seed 0; trained: {export}/gdpo_training.json" in capsys.readouterr().err
    scores = json.loads(out.read_text())
    assert scores["eval/prompts"] == len(trained)
    records = read_metrics(run_dir)
    rollouts = len(records) * config.data.prompts_per_step * config.rollout.group_size
    for name in ("tool_format", "tool_correctness"):
        reported = sum(r[f"reward/{name}/mean"] for r in records) / len(records)
        std = max(r[f"reward/{name}/std"] for r in records)
        noise = std * math.sqrt(1 / len(trained) + 1 / rollouts)  # the standard error of the difference
        assert abs(scores[f"eval/{name}/mean"] - reported) < 4 * noise, (name, scores, reported, noise)
