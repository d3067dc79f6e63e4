"""gdpo-plan: per-GPU memory against numbers worked out by hand for a small config."""
import re

import pytest
import yaml

from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.commands.plan import main
from gdpo_megatron.preflight.plan import Cluster, plan_memory, total_params
from gdpo_megatron.config.policy import ModelConfig

MIB = 2**20
GIB = 2**30

# 4 layers, hidden 64, ffn 96, 4 heads of 16 with 2 KV groups, QKV bias, vocab 1000;
# TP 2 x PP 2 on 8 GPUs -> DP 2. The base model does not exist: the planner must not read it.
SMALL = {
    "run_dir": "runs/plan-test",
    "base_model": "/nonexistent/hf-model",
    "data": {"train_path": "/nonexistent/prompts.jsonl", "family": "tool", "prompts_per_step": 8,
             "max_prompt_tokens": 96},
    "rewards": {"rewards": [{"name": "tool_format"}]},
    "rollout": {"group_size": 4, "max_new_tokens": 32, "max_model_len": 128, "tensor_parallel_size": 1,
                "gpu_memory_utilization": 0.25},
    "policy": {
        "model": {"vocab_size": 1000, "hidden_size": 64, "ffn_hidden_size": 96, "num_layers": 4,
                  "num_attention_heads": 4, "num_query_groups": 2, "add_qkv_bias": True},
        "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        "precision": {"dtype": "bf16"},
        "optim": {"use_distributed_optimizer": True},
        "loss": {"kl_coef": 0.1},
        "micro_batch_size": 2,
    },
}
# A 4 MiB GPU with a 0.75 MiB allowance and 64 KiB for vLLM's runtime: the distributed optimizer
# fits, the plain one does not.
GPU_GIB, OVERHEAD, RUNTIME = 4 * MIB / GIB, 0.75 * MIB, 64 * 1024
CLUSTER = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=GPU_GIB, overhead_gib=OVERHEAD / GIB,
                  vllm_runtime_gib=RUNTIME / GIB)
CLI = ["--gpus-per-node", "8", "--gpu-memory", str(GPU_GIB), "--overhead", str(OVERHEAD / GIB),
       "--vllm-runtime", str(RUNTIME / GIB)]

# ---- worked by hand -----------------------------------------------------------------------
# One layer, unsharded: QKV 64 x (64 + 2 * 32) = 8192 + bias 128, projection 64 x 64 = 4096,
# fc1 64 x 2 * 96 = 12288, fc2 96 x 64 = 6144 -> 30848; norms 2 x 64 = 128 (replicated).
LAYER_TP2 = 30848 // 2 + 128  # 15552
VOCAB_SHARD = 512  # 1000 padded to a multiple of lcm(128, TP 2) = 128 -> 1024, half per rank
STAGE0 = 2 * LAYER_TP2 + VOCAB_SHARD * 64  # 2 layers + embedding = 63872
STAGE1 = 2 * LAYER_TP2 + 64 + VOCAB_SHARD * 64  # 2 layers + final norm + output layer = 63936
# Stage 1 peaks (logits): bf16 weights 2 B, fp32 grads 4 B, Adam 12 B (/ DP 2), reference 2 B.
WEIGHTS1, GRADS1, ADAM1_PLAIN, REF1 = 2 * STAGE1, 4 * STAGE1, 12 * STAGE1, 2 * STAGE1
ADAM1_DIST = ADAM1_PLAIN // 2
# Activations per token and layer: 4 x 64 (norm and linear inputs, not split without sequence
# parallelism) + (q 64 + k, v 2 x 32 + attention output 64 + fc1 out 192 + fc2 in 96) / TP 2
# = 256 + 240 = 496 elements, bf16; 128 tokens (96 + 32) x micro-batch 2; stage 1 of 1F1B
# keeps 1 micro-batch of its 2 layers in flight.
TOKENS = (96 + 32) * 2
ACTIVATIONS1 = 1 * 2 * 496 * 2 * TOKENS  # 507904
LOGITS1 = TOKENS * VOCAB_SHARD * (2 + 3 * 4)  # bf16 logits, three fp32 working buffers: 1835008
# vLLM at TP 1, bf16: 4 layers x 30976 + final norm 64 + 2 x 1000 x 64 embeddings = 251968 params.
VLLM_WEIGHTS = 2 * 251968
VLLM_TOTAL = GPU_GIB * GIB // 4  # gpu_memory_utilization 0.25 of 4 MiB: weights, KV cache, runtime
KV_PER_TOKEN = 2 * 4 * 2 * 16 * 2  # K and V, 4 layers, 2 KV heads of 16, bf16


def write(tmp_path, config):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_small_config_against_hand_computed_bytes(tmp_path):
    plan = plan_memory(load_config(TrainConfig, write(tmp_path, SMALL)), CLUSTER)
    assert plan.data_parallel_size == 2 and plan.sequence_length == 128
    assert plan.micro_batches_per_step == 8  # 8 prompts / DP 2 x group 4 / micro-batch 2
    s = plan.stage
    assert s.stage == 1 and s.params == STAGE1
    assert (s.weights, s.gradients, s.optimizer_distributed, s.optimizer_plain, s.reference) == (
        WEIGHTS1, GRADS1, ADAM1_DIST, ADAM1_PLAIN, REF1)
    assert (s.activations, s.logits) == (ACTIVATIONS1, LOGITS1)
    assert (plan.vllm_weights, plan.vllm_total) == (VLLM_WEIGHTS, VLLM_TOTAL)
    assert plan.kv_cache_tokens == (VLLM_TOTAL - VLLM_WEIGHTS - RUNTIME) // KV_PER_TOKEN == 935

    static_dist = WEIGHTS1 + GRADS1 + ADAM1_DIST + REF1
    static_plain = WEIGHTS1 + GRADS1 + ADAM1_PLAIN + REF1
    assert plan.peak_generating(True) == OVERHEAD + static_dist + VLLM_TOTAL
    # vLLM sleeps while the policy trains, its runtime allowance stays
    assert plan.peak_training(True) == OVERHEAD + static_dist + ACTIVATIONS1 + LOGITS1 + RUNTIME == 4089984
    assert plan.peak_training(False) == OVERHEAD + static_plain + ACTIVATIONS1 + LOGITS1 + RUNTIME == 4473600
    assert plan.fits(True) and not plan.fits(False)  # 4 MiB = 4194304


def test_offloading_grads_and_adam_during_generation(tmp_path, capsys):
    """A vLLM share at which the generating peak fits only with the training state offloaded."""
    path = write(tmp_path, SMALL)
    share = ["rollout.gpu_memory_utilization=0.7"]
    vllm_total = int(0.7 * GPU_GIB * GIB)
    for offload in (False, True):
        plan = plan_memory(load_config(TrainConfig, path, [*share, f"policy.offload_grads_and_optimizer={offload}"]),
                           CLUSTER)
        assert plan.offload == offload
        resident = WEIGHTS1 + GRADS1 + ADAM1_DIST + REF1
        assert plan.peak_generating(True, offload=False) == OVERHEAD + resident + vllm_total
        assert plan.peak_generating(True, offload=True) == OVERHEAD + WEIGHTS1 + REF1 + vllm_total == 3978188
        assert plan.peak_generating(True) == plan.peak_generating(True, offload)  # as configured
        assert plan.peak_training(True) == OVERHEAD + resident + ACTIVATIONS1 + LOGITS1 + RUNTIME
        assert plan.fits(True) == offload  # 4617548 > 4 MiB = 4194304 without offloading
    assert main(["--config", path, *CLI, *share]) == 1
    assert main(["--config", path, *CLI, *share, "policy.offload_grads_and_optimizer=true"]) == 0
    out = capsys.readouterr().out
    assert "policy.offload_grads_and_optimizer=true" in out
    assert re.search(r"^peak while generating, grads \+ Adam offloaded \*\s", out, re.MULTILINE)


def test_first_stage_holds_one_micro_batch_per_stage(tmp_path):
    """With small logits and a small vLLM share, stage 0 (2 micro-batches in flight) is the fullest."""
    config = load_config(TrainConfig, write(tmp_path, SMALL),
                         ["policy.model.vocab_size=100", "rollout.gpu_memory_utilization=0.1"])
    s = plan_memory(config, CLUSTER).stage
    stage0 = 2 * LAYER_TP2 + 64 * 64  # vocab 100 -> 128 rows, 64 per rank
    assert s.stage == 0 and s.params == stage0
    assert s.activations == 2 * 2 * 496 * 2 * TOKENS and s.logits == 0


def test_rollout_variants(tmp_path):
    path = write(tmp_path, SMALL)
    fp8 = plan_memory(load_config(TrainConfig, path, ["rollout.quantization=fp8"]), CLUSTER)
    assert fp8.vllm_weights == 2 * (251968 - 4 * 30976) + 4 * 30976  # layers in 1 byte
    tp2 = plan_memory(load_config(TrainConfig, path, ["rollout.tensor_parallel_size=2"]), CLUSTER)
    assert tp2.vllm_weights == VLLM_WEIGHTS // 2 and tp2.kv_cache_per_token == KV_PER_TOKEN // 2
    fixed = plan_memory(load_config(TrainConfig, path, [f"rollout.kv_cache_gib={1 / 1024}"]), CLUSTER)
    assert fixed.vllm_total == VLLM_WEIGHTS + MIB + RUNTIME and fixed.kv_cache == MIB


def test_a_token_budget_sizes_the_micro_batch(tmp_path):
    """policy.micro_batch_tokens replaces micro_batch_size: a micro-batch holds up to the budget,
    or one row alone when the row is longer; every row may be a micro-batch of its own."""
    path = write(tmp_path, SMALL)
    per_token = 2 * 496 * 2  # stage 1's 2 layers, 496 bf16 elements each
    budget = plan_memory(load_config(TrainConfig, path, [f"policy.micro_batch_tokens={16 * 128}"]), CLUSTER)
    assert (budget.micro_batch_tokens, budget.micro_batches_per_step) == (2048, 16)
    assert budget.stage.activations == per_token * 2048 == 8 * ACTIVATIONS1  # 8 x the 2-row micro-batch
    assert budget.stage.logits == 2048 * VOCAB_SHARD * 14 == 8 * LOGITS1
    short = plan_memory(load_config(TrainConfig, path, ["policy.micro_batch_tokens=100"]), CLUSTER)
    assert short.micro_batch_tokens == 128 and short.stage.activations == per_token * 128  # one row of 128


def test_rows_are_planned_at_their_padded_width(tmp_path):
    """With FP8 a row is padded to 16 tokens: 96 + 33 = 129 -> 144."""
    config = load_config(TrainConfig, write(tmp_path, SMALL), [
        "rollout.max_new_tokens=33", "rollout.max_model_len=256", "policy.precision.fp8=e4m3"])
    plan = plan_memory(config, CLUSTER)
    assert plan.sequence_length == 144 and plan.micro_batch_tokens == 2 * 144
    assert plan.stage.activations == 2 * 496 * 2 * 288


def test_a_fixed_kv_cache_gives_vllm_the_share_it_holds(tmp_path, capsys):
    """vLLM starts only with gpu_memory_utilization x the GPU free: at 0.75 the policy leaves too
    little; with a fixed KV cache the engine passes what weights + KV cache + runtime hold,
    which fits, and the plan prints it."""
    path = write(tmp_path, SMALL)
    share = plan_memory(load_config(TrainConfig, path, ["rollout.gpu_memory_utilization=0.75"]), CLUSTER)
    assert share.gpu_memory_utilization == 0.75 and not share.fits(True)
    kv = 256 * 1024
    fixed = plan_memory(load_config(TrainConfig, path, ["rollout.gpu_memory_utilization=0.5",
                                                        f"rollout.kv_cache_gib={kv / GIB}"]), CLUSTER)
    assert fixed.vllm_total == VLLM_WEIGHTS + kv + RUNTIME
    assert fixed.gpu_memory_utilization == pytest.approx(fixed.vllm_total / (GPU_GIB * GIB)) and fixed.fits(True)
    assert main(["--config", path, *CLI, "rollout.gpu_memory_utilization=0.5", f"rollout.kv_cache_gib={kv / GIB}"]) == 0
    assert "vLLM: gpu_memory_utilization 0.198 (derived from rollout.kv_cache_gib)" in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [[], ["rollout.quantization=fp8"], ["rollout.tensor_parallel_size=2"],
                                       ["policy.model.tie_word_embeddings=true"]])
def test_the_engine_counts_vllm_as_the_plan_does(tmp_path, overrides):
    """The engine sizes vLLM's start-up from the checkpoint's tensors: for a checkpoint of the
    planned shape it derives the plan's utilization, and refuses exactly where the plan's peak
    while generating passes the GPU."""
    from gdpo_megatron.checkpoint.layout import hf_shapes
    from gdpo_megatron.errors import InputError
    from gdpo_megatron.rollout.vllm_engine import (gpu_memory_utilization, layer_and_other_params, startup_margin,
                                                   vllm_weight_bytes)

    kv = 256 * 1024
    config = load_config(TrainConfig, write(tmp_path, SMALL), [*overrides, f"rollout.kv_cache_gib={kv / GIB}"])
    rollout = config.rollout
    total, verdicts = int(GPU_GIB * GIB), set()
    for gpu_memory in (total, int(total * 0.5)):
        cluster = Cluster(1, 8, gpu_memory / GIB, OVERHEAD / GIB, RUNTIME / GIB)
        plan = plan_memory(config, cluster)
        weights = vllm_weight_bytes(*layer_and_other_params(hf_shapes(config.policy.model)), 2,
                                    rollout.quantization, rollout.tensor_parallel_size)
        assert weights == plan.vllm_weights
        # next to the policy; the plan's fixed overhead holds what vLLM's communicators take
        free = gpu_memory - (plan.peak_generating(True) - plan.vllm_total) + startup_margin(rollout.tensor_parallel_size)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("gdpo_megatron.rollout.vllm_engine.VLLM_RUNTIME_GIB", RUNTIME / GIB)
            verdicts.add(plan.peak_generating(True) <= gpu_memory)
            if plan.peak_generating(True) <= gpu_memory:
                assert gpu_memory_utilization(weights, kv, 0.5, free, gpu_memory, rollout.tensor_parallel_size) == pytest.approx(
                    plan.gpu_memory_utilization)
            else:
                with pytest.raises(InputError, match="rollout.kv_cache_gib"):
                    gpu_memory_utilization(weights, kv, 0.5, free, gpu_memory, rollout.tensor_parallel_size)
    assert verdicts == {True, False}


def test_cli_exit_status_and_table(tmp_path, capsys):
    path = write(tmp_path, SMALL)
    assert main(["--config", path, *CLI]) == 0
    out = capsys.readouterr().out
    assert "layout: TP 2 x PP 2 x DP 2" in out
    verdict = next(line for line in out.splitlines() if line.startswith("in "))
    assert re.search(r"\sfits\s+does not fit$", verdict)  # distributed optimizer, plain optimizer
    assert main(["--config", path, *CLI, "policy.optim.use_distributed_optimizer=false"]) == 1
    # memory fits, but vLLM needs room for one max_model_len sequence (935 tokens of KV cache)
    assert main(["--config", path, *CLI, "rollout.max_model_len=2048"]) == 1


@pytest.mark.parametrize("args, message", [
    (["--gpus-per-node", "6"], "policy.parallel: world size 6 is not divisible"),
    (["policy.parallel.pipeline_model_parallel_size=1", "policy.parallel.tensor_model_parallel_size=8"],
     "policy.model.num_attention_heads: expected a multiple of parallel.tensor_model_parallel_size=8"),
    (["rollout.tensor_parallel_size=4"], "rollout.tensor_parallel_size: 4 must divide"),
    (["data.prompts_per_step=3"], "data.prompts_per_step: 3 is not divisible by the data-parallel size 2"),
    (["policy.micro_batch_size=3", "policy.micro_batch_tokens=null"],
     "policy.micro_batch_size: 3 does not divide the 16 rollouts"),
    (["policy.optim.lr=-1"], "policy.optim.lr: expected > 0"),
])
def test_bad_layouts_are_named(tmp_path, capsys, args, message):
    assert main(["--config", write(tmp_path, SMALL), *CLI, *args]) == 2  # a repeated option: the last wins
    assert message in capsys.readouterr().err


def test_machine_dependent_defaults_planned_as_on_a_gpu(tmp_path):
    config = {**SMALL, "policy": {k: v for k, v in SMALL["policy"].items() if k not in ("precision", "optim")}}
    loaded = load_config(TrainConfig, write(tmp_path, config))
    assert loaded.policy.precision.dtype == "auto" and loaded.policy.optim.use_distributed_optimizer is None
    plan = plan_memory(loaded, CLUSTER)
    assert plan.config.policy.precision.dtype == "bf16" and plan.distributed_optimizer
    assert plan.stage.weights == WEIGHTS1
    explicit = plan_memory(load_config(TrainConfig, write(tmp_path, SMALL), ["policy.precision.dtype=fp32"]), CLUSTER)
    assert explicit.config.policy.precision.dtype == "fp32"


def test_presets_match_published_parameter_counts():
    assert total_params(ModelConfig.preset("qwen2-0.5b")) == 494_032_768  # Qwen2.5-0.5B
    assert total_params(ModelConfig.preset("qwen2-1.5b")) == 1_543_714_304  # Qwen2.5-1.5B
    assert total_params(ModelConfig.preset("qwen2-7b")) == 7_615_616_512  # Qwen2.5-7B
    assert total_params(ModelConfig.preset("llama3-8b")) == 8_030_261_248
    assert total_params(ModelConfig.preset("llama2-7b")) == 6_738_415_616


def test_7b_config_fits_eight_80gb_gpus_and_tp1_does_not(capsys):
    config = load_config(TrainConfig, "configs/gdpo_7b.yaml")  # on a machine without CUDA
    assert config.policy.model.hidden_size == 3584 and config.policy.precision.fp8 is None
    cli = ["--config", "configs/gdpo_7b.yaml", "--gpus-per-node", "8", "--gpu-memory", "79.2"]  # an 80 GB H100
    assert main(cli) == 0
    assert main([*cli, "policy.parallel.tensor_model_parallel_size=1", "policy.parallel.sequence_parallel=false",
                 "rollout.tensor_parallel_size=1"]) == 1
    capsys.readouterr()
