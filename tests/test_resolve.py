"""The resolve phase: layout, the model's split, precision, micro-batch budgets and the engine's KV
cache decided once from a config, a machine, a world size and a model."""
import ast
import math
from pathlib import Path

import pytest

from gdpo_megatron.config import ConfigError, ModelConfig, TrainConfig, load_config
from gdpo_megatron.device import CPU, CUDA
from gdpo_megatron.resolve import resolve

PACKAGE = Path(__file__).resolve().parents[1] / "gdpo_megatron"
REQUIRED = ["run_dir=run", "base_model=model", "data.train_path=prompts.jsonl", "data.family=math",
            "rewards.rewards=[{name: math_correctness}]"]


def config(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*REQUIRED, *overrides])


def test_the_layout_splits_the_step_over_the_data_parallel_replicas():
    """8 ranks of TP 2 x PP 2 leave 2 replicas; 6 prompts of 4 rollouts make 12 per replica."""
    run = config("policy.parallel.tensor_model_parallel_size=2", "policy.parallel.pipeline_model_parallel_size=2",
                 "data.prompts_per_step=6", "rollout.group_size=4")
    layout = resolve(run, CUDA, 8, runs_here=False).layout
    assert (layout.world_size, layout.data_parallel_size, layout.rollouts_per_replica) == (8, 2, 12)


def test_machine_dependent_settings_are_decided_for_the_machine():
    on_cpu, on_cuda = resolve(config(), CPU, 1), resolve(config(), CUDA, 1, runs_here=False)
    cpu, cuda = on_cpu.policy, on_cuda.policy
    assert (cpu.config.precision.dtype, cpu.config.precision.transformer_engine,
            cpu.config.optim.use_distributed_optimizer, cpu.config.old_logprobs) == ("fp32", False, False, "rollout")
    assert (cuda.config.precision.dtype, cuda.config.optim.use_distributed_optimizer, cuda.config.old_logprobs) == (
        "bf16", True, "policy")
    assert (on_cpu.machine, on_cuda.machine) == (CPU, CUDA)


def test_the_model_trained_is_the_one_given_else_policy_model():
    base = ModelConfig.preset("tiny", num_layers=4)
    assert resolve(config(), CPU, 1, base).policy.config.model == base
    assert resolve(config(), CPU, 1).policy.config.model == ModelConfig.preset("tiny")


@pytest.mark.parametrize("tokens, rows, budgets, fewest_rows", [
    ("auto", 3, {10: 30, 7: 21}, 3),  # micro_batch_size rows as wide as the step
    ("100", 3, {10: 100, 7: 100}, 1),  # a fixed budget; a longer row goes alone
    ("null", 3, {10: None, 7: None}, 3),  # consecutive slices of rows
])
def test_micro_batch_tokens_are_decoded_once(tokens, rows, budgets, fewest_rows):
    micro = resolve(config(f"policy.micro_batch_tokens={tokens}", f"policy.micro_batch_size={rows}",
                           "rollout.group_size=3"), CPU, 1).policy.micro_batches
    assert {width: micro.budget(width) for width in budgets} == budgets
    assert micro.fewest_rows == fewest_rows and micro.rows == rows


def test_the_cpu_kv_cache_holds_one_step_of_rollouts():
    """tiny: 2 layers x 2 KV heads x head_dim 64, keys and values in fp32: 2048 bytes a token.
    8 prompts x 4 rollouts on 2 replicas: 16 sequences of 50 + 30 tokens, 3 blocks of 32 each;
    with vLLM's placeholder block, 49 blocks."""
    run = config("data.prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=30",
                 "rollout.max_model_len=600", "data.max_prompt_tokens=60")
    per_token = 2 * 2 * 2 * 64 * 4
    assert resolve(run, CPU, 2, longest_prompt=50).kv_cache_gib == (16 * 3 + 1) * 32 * per_token / 2**30
    # without the data's longest prompt, max_prompt_tokens bounds it: 90 tokens, still 3 blocks
    assert resolve(run, CPU, 2).kv_cache_gib == (16 * 3 + 1) * 32 * per_token / 2**30
    # one sequence of max_model_len must fit: 600 tokens are 19 blocks
    one = config("data.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=30",
                 "rollout.max_model_len=600", "data.max_prompt_tokens=60")
    assert resolve(one, CPU, 1, longest_prompt=50).kv_cache_gib == (math.ceil(600 / 32) + 1) * 32 * per_token / 2**30
    assert resolve(run, CUDA, 2, runs_here=False).kv_cache_gib is None  # vLLM sizes it
    assert resolve(config("rollout.kv_cache_gib=0.5"), CPU, 1).kv_cache_gib == 0.5


@pytest.mark.parametrize("overrides, world, machine, model, message", [
    (["policy.parallel.tensor_model_parallel_size=2"], 3, CPU, None,
     "policy.parallel: world size 3 is not divisible by tensor x pipeline x context parallel size 2"),
    (["policy.parallel.tensor_model_parallel_size=4"], 4, CPU, None,
     "policy.model.num_attention_heads: expected a multiple of parallel.tensor_model_parallel_size=4, got 2"),
    (["policy.parallel.tensor_model_parallel_size=2"], 2, CPU, ModelConfig.preset("tiny", num_attention_heads=1,
                                                                                   hidden_size=64),
     "policy.parallel (base_model's shape): model.num_attention_heads: expected a multiple of "
     "parallel.tensor_model_parallel_size=2, got 1"),
    (["policy.parallel.pipeline_model_parallel_size=2", "policy.model={preset: tiny, num_layers: 3}"], 2, CPU, None,
     "policy.model.num_layers: expected a multiple of parallel.pipeline_model_parallel_size=2, got 3"),
    (["rollout.tensor_parallel_size=2"], 1, CPU, None, "rollout.tensor_parallel_size: 2 must divide"),
    (["data.prompts_per_step=3"], 2, CPU, None, "data.prompts_per_step: 3 is not divisible by the data-parallel size 2"),
    (["policy.micro_batch_tokens=null", "policy.micro_batch_size=3"], 1, CPU, None,
     "policy.micro_batch_size: 3 does not divide the 64 rollouts of a data-parallel replica"),
    (["rollout.quantization=fp8"], 1, CPU, None, "rollout.quantization: 'fp8' rollouts need a CUDA GPU"),
    (["rollout.max_num_batched_tokens=100"], 1, CPU, None,
     "rollout.max_num_batched_tokens: expected >= rollout.max_model_len=2048 on this machine, got 100"),
    (["policy.offload_grads_and_optimizer=true", "policy.optim.use_distributed_optimizer=false"], 1, CPU, None,
     "policy.offload_grads_and_optimizer: with fp32 parameters and the plain optimizer"),
])
def test_what_cannot_run_is_named(overrides, world, machine, model, message):
    with pytest.raises(ConfigError) as refused:
        resolve(config(*overrides), machine, world, model, runs_here=False)
    assert str(refused.value).startswith(message)


def test_a_gpu_runs_what_the_cpu_refuses():
    run = config("rollout.quantization=fp8", "rollout.max_num_batched_tokens=100")
    assert resolve(run, CUDA, 1, runs_here=False).layout.rollouts_per_replica == 64


def calls(name: str) -> list[str]:
    """The package's modules that call a function or method called ``name``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if callee == name:
                    found.append(str(path.relative_to(PACKAGE)))
                    break
    return found


@pytest.mark.parametrize("helper", ["check_precision", "param_dtype", "transformer_engine", "distributed_optimizer",
                                    "check_model_split", "data_parallel_size", "kv_cache_gib", "resolve_policy",
                                    "precision_for"])
def test_resolve_is_the_only_caller_of_the_resolution_helpers(helper):
    allowed = {"resolve.py"} | ({"preflight/validation.py"} if helper in ("check_model_split", "data_parallel_size")
                                else set()) | ({"preflight/doctor.py"} if helper == "precision_for" else set())
    assert set(calls(helper)) <= allowed
