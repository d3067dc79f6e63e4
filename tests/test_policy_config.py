"""Policy configuration: presets, vocabulary padding, and clear errors for bad settings."""
import pytest
import torch

from gdpo_megatron.config import ConfigError, from_dict
from gdpo_megatron.config.policy import (
    FP8_RECIPES,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PolicyConfig,
    PrecisionConfig,
)
from gdpo_megatron.device import CPU, CUDA
from gdpo_megatron.policy.batch import PolicyBatch
from gdpo_megatron.resolve import check_model_split, data_parallel_size, resolve_policy, resolve_precision


def test_presets_have_the_published_shapes():
    tiny = ModelConfig.preset("tiny")
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.head_dim, tiny.num_layers, tiny.vocab_size) == (
        128, 2, 64, 2, 512)
    qwen = ModelConfig.preset("qwen2-7b")
    assert (qwen.num_query_groups, qwen.head_dim, qwen.add_qkv_bias, qwen.rotary_base) == (4, 128, True, 1e6)
    llama = ModelConfig.preset("llama3-70b")
    assert (llama.num_layers, llama.num_query_groups, llama.head_dim) == (80, 8, 128)
    assert ModelConfig.preset("tiny", num_layers=4).num_layers == 4
    assert ModelConfig.preset("tiny", hidden_size=256).head_dim == 128
    with pytest.raises(ConfigError, match="model.preset: expected one of"):
        ModelConfig.preset("gpt-5")


@pytest.mark.parametrize("vocab,divisor,tp,expected", [
    (512, 128, 1, 512), (512, 128, 2, 512), (500, 128, 2, 512), (32000, 128, 8, 32000), (151936, 1, 3, 151938)])
def test_padded_vocab_splits_evenly_over_tensor_parallel_ranks(vocab, divisor, tp, expected):
    model = ModelConfig.preset("tiny", vocab_size=vocab, make_vocab_size_divisible_by=divisor)
    padded = model.padded_vocab_size(tp)
    assert padded == expected and padded % tp == 0 and padded >= vocab


def test_padded_vocab_is_the_same_at_every_tp_size_dividing_the_multiple():
    model = ModelConfig.preset("tiny", vocab_size=151_646, make_vocab_size_divisible_by=128)
    assert {model.padded_vocab_size(tp) for tp in (1, 2, 4, 8)} == {151_680}


@pytest.mark.parametrize("model_overrides,parallel,field", [
    (dict(num_attention_heads=2), ParallelConfig(tensor_model_parallel_size=4), "model.num_attention_heads"),
    (dict(num_attention_heads=4, num_query_groups=2), ParallelConfig(tensor_model_parallel_size=4),
     "model.num_query_groups"),
    (dict(num_layers=3), ParallelConfig(pipeline_model_parallel_size=2), "model.num_layers"),
])
def test_model_that_does_not_split_is_rejected(model_overrides, parallel, field):
    model = ModelConfig.preset("tiny", **model_overrides)
    with pytest.raises(ConfigError, match=field):
        check_model_split(model, parallel)


def test_parallel_settings_are_checked():
    with pytest.raises(ConfigError, match="context_parallel_size: expected 1 .context parallelism is not supported"):
        ParallelConfig(context_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="world size 3"):
        data_parallel_size(ParallelConfig(tensor_model_parallel_size=2), 3)
    assert data_parallel_size(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 8) == 2


def test_auto_settings_stay_in_the_config_and_resolve_per_machine():
    config = PolicyConfig()
    assert (config.precision.dtype, config.precision.transformer_engine, config.optim.use_distributed_optimizer,
            config.old_logprobs) == ("auto", None, None, None)
    cpu = resolved(config, CPU)
    assert (cpu.precision.dtype, cpu.precision.transformer_engine, cpu.optim.use_distributed_optimizer) == (
        "fp32", False, False)
    cuda = resolved(config, CUDA)
    assert (cuda.precision.dtype, cuda.optim.use_distributed_optimizer, cuda.old_logprobs) == ("bf16", True, "policy")
    explicit = PolicyConfig(precision=PrecisionConfig(dtype="fp32"), optim=OptimConfig(use_distributed_optimizer=False))
    assert (resolved(explicit, CUDA).precision.dtype, resolved(explicit, CUDA).optim.use_distributed_optimizer) == (
        "fp32", False)


def resolved(policy: PolicyConfig, machine) -> PolicyConfig:
    """``policy`` resolved for one rank of ``machine`` (this machine's stack not asked)."""
    return resolve_policy(policy, machine, 1, runs_here=False).config


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")
def test_fp8_and_transformer_engine_on_cpu_are_clear_errors():
    with pytest.raises(ConfigError, match="policy.precision.fp8='e4m3': FP8 needs a CUDA GPU"):
        resolve_precision(PrecisionConfig(fp8="e4m3"), CPU)
    with pytest.raises(ConfigError, match="policy.precision.transformer_engine: the Transformer Engine spec needs CUDA"):
        resolve_precision(PrecisionConfig(transformer_engine=True), CPU)
    resolve_precision(PrecisionConfig(), CPU)  # the defaults run here


def test_old_logprobs_come_from_the_rollout_only_where_numerics_are_the_same():
    assert resolved(PolicyConfig(), CPU).old_logprobs == "rollout"  # fp32 on CPU: vLLM's equal the policy's to ~1e-7
    assert resolved(PolicyConfig(precision=PrecisionConfig(dtype="bf16")), CPU).old_logprobs == "policy"
    assert resolved(PolicyConfig(loss=LossConfig(tis_cap=2.0)), CPU).old_logprobs == "policy"  # TIS: policy vs rollout
    assert resolved(PolicyConfig(old_logprobs="policy"), CPU).old_logprobs == "policy"
    assert resolved(PolicyConfig(), CUDA).old_logprobs == "policy"  # bf16 kernels differ


@pytest.mark.parametrize("tp,sp,fp8,recipe,multiple", [
    (1, False, None, "delayed", 1),
    (4, True, None, "delayed", 4),
    # 8 tokens per rank's slice, and the weight-gradient GEMM's count (every rank's) a multiple of 16
    (1, False, "e4m3", "delayed", 16),  # 8 failed on Hopper at an odd number of rows
    (2, True, "e4m3", "delayed", 16),
    (4, True, "e4m3", "delayed", 32),
    (2, False, "hybrid", "tensorwise", 16),
    # 32 for MXFP8 tensors, 128 where a blockwise-quantized input is all-gathered (SP)
    (2, True, "e4m3", "mxfp8", 64),
    (2, True, "e4m3", "blockwise", 256),
    (2, False, "e4m3", "blockwise", 16),
])
def test_sequence_multiple_is_what_transformer_engine_checks(tp, sp, fp8, recipe, multiple):
    config = PolicyConfig(parallel=ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp),
                          precision=PrecisionConfig(dtype="bf16", fp8=fp8, fp8_recipe=recipe))
    assert config.sequence_multiple() == multiple


def fp8_shape_ok(recipe: str, tp: int, sp: bool, rows: int, width: int) -> bool:
    """Transformer Engine 2.11's shape rules for one micro-batch of ``rows x width`` tokens,
    written out per recipe (pytorch/utils.py, tensor/*_tensor.py, common/gemm/cublaslt_gemm.cu):
    L = the local slice each rank quantizes, N = the tokens of the weight-gradient GEMM."""
    tokens = rows * width
    local = tokens // tp if sp else tokens
    if recipe == "mxfp8":
        return local % 32 == 0
    ok = local % 8 == 0 and tokens % 16 == 0
    if recipe == "blockwise" and sp:
        ok = ok and local % 128 == 0
    return ok


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_padding_to_the_sequence_multiple_meets_every_fp8_shape_rule(recipe):
    for tp in (1, 2, 4, 8):
        for sp in (False, True) if tp > 1 else (False,):
            config = PolicyConfig(parallel=ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp),
                                  precision=PrecisionConfig(dtype="bf16", fp8="e4m3", fp8_recipe=recipe))
            multiple = config.sequence_multiple()
            for rows in range(1, 9):
                for k in (1, 2, 3, 5):
                    assert fp8_shape_ok(recipe, tp, sp, rows, k * multiple), (tp, sp, rows, k)
            assert not fp8_shape_ok(recipe, tp, sp, 1, multiple // 2)  # and it is the smallest


@pytest.mark.parametrize("build,field", [
    (lambda: ModelConfig.preset("tiny", hidden_size=129), "model.hidden_size"),
    (lambda: ModelConfig.preset("tiny", num_attention_heads=4, num_query_groups=3), "model.num_query_groups"),
    (lambda: ModelConfig.preset("tiny", vocab_size=0), "model.vocab_size"),
    (lambda: OptimConfig(lr=0.0), "optim.lr"),
    (lambda: OptimConfig(lr_warmup_steps=10, lr_decay_steps=5), "optim.lr_decay_steps"),
    (lambda: from_dict(PolicyConfig, {"optim": {"lr_decay_style": "linear"}}, "policy"),
     "policy.optim.lr_decay_style: expected one of"),
    (lambda: from_dict(PolicyConfig, {"loss": {"loss_agg_mode": "seq_mean"}}, "policy"),
     "policy.loss.loss_agg_mode: expected one of"),
    (lambda: from_dict(PolicyConfig, {"precision": {"fp8": "e5m2"}}, "policy"), "policy.precision.fp8"),
    (lambda: from_dict(PolicyConfig, {"precision": {"fp8": "hybrid", "fp8_recipe": "nvfp4"}}, "policy"),
     "policy.precision.fp8_recipe: expected one of"),
    (lambda: from_dict(PolicyConfig, {"precision": {"dtype": "fp16"}}, "policy"), "policy.precision.dtype"),
    (lambda: LossConfig(ratio_clip_low=-0.1), "loss.ratio_clip_low"),
    (lambda: LossConfig(kl_coef=-1.0), "loss.kl_coef"),
    (lambda: PolicyConfig(ppo_epochs=0), "ppo_epochs"),
    (lambda: from_dict(PolicyConfig, {"micro_batch_tokens": 0}, "policy"), "micro_batch_tokens: expected auto, null or >= 1"),
    (lambda: from_dict(PolicyConfig, {"micro_batch_tokens": "max"}, "policy"), "policy.micro_batch_tokens: 'max' matches none"),
    (lambda: LossConfig(tis_cap=0.0), "loss.tis_cap"),
    (lambda: from_dict(PolicyConfig, {"old_logprobs": "engine"}, "policy"), "policy.old_logprobs"),
    (lambda: PolicyConfig(old_logprobs="rollout", loss=LossConfig(tis_cap=2.0)),
     "policy.loss.tis_cap: .* old_logprobs: policy"),
    (lambda: resolved(PolicyConfig(offload_grads_and_optimizer=True, optim=OptimConfig(use_distributed_optimizer=False)),
                      CPU), "policy.offload_grads_and_optimizer: with fp32 parameters and the plain"),
    (lambda: PolicyConfig(precision=PrecisionConfig(dtype="fp32", fp8="e4m3")),
     "precision.fp8: expected null with dtype: fp32"),
    (lambda: from_dict(PolicyConfig, {"precision": {"fp8": "hybrid", "dtype": "fp32"}}, "policy"),
     "policy.precision.fp8: expected null with dtype: fp32 .FP8 training expects bf16 parameters., got 'hybrid'"),
])
def test_bad_fields_are_named(build, field):
    with pytest.raises(ConfigError, match=field):
        build()


def good_batch():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    mask = torch.tensor([[False, False, True, True], [False, True, True, False]])
    return PolicyBatch(ids, mask, torch.tensor([0.5, -0.5]), rollout_logprobs=torch.zeros(2, 3))


@pytest.mark.parametrize("change,field", [
    (dict(input_ids=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 512]])), r"input_ids: token ids must be in \[0, 512\)"),
    (dict(input_ids=torch.zeros(2, 4, dtype=torch.int32)), "input_ids"),
    (dict(loss_mask=torch.ones(2, 4, dtype=torch.bool)), "loss_mask: position 0"),
    (dict(loss_mask=torch.zeros(2, 3, dtype=torch.bool)), "loss_mask"),
    (dict(advantages=torch.tensor([0.5, float("nan")])), "advantages"),
    (dict(advantages=torch.zeros(3)), "advantages"),
    (dict(rollout_logprobs=torch.zeros(2, 4)), "rollout_logprobs"),
])
def test_bad_batches_are_named(change, field):
    good_batch().validate(vocab_size=512)
    batch = good_batch()
    for name, value in change.items():
        setattr(batch, name, value)
    with pytest.raises(ValueError, match=field):
        batch.validate(vocab_size=512)


def test_the_auto_token_budget_never_holds_more_tokens_than_micro_batch_size_rows():
    """Rows of 10, 9, 4, 3 and 2 tokens in a batch 10 wide: "auto" with 2 rows per micro-batch is
    a budget of 20 tokens, so the two longest rows go together and the three short ones too."""
    lengths = torch.tensor([4, 10, 2, 9, 3])
    ids = torch.where(torch.arange(10) < lengths.unsqueeze(1), 1, 0)
    batch = PolicyBatch(input_ids=ids, loss_mask=torch.zeros_like(ids, dtype=torch.bool),
                        advantages=torch.zeros(5), lengths=lengths)
    config = PolicyConfig(micro_batch_size=2)
    auto = resolve_policy(config, CPU, 1).micro_batches
    assert config.micro_batch_tokens == "auto" and auto.budget(batch.seq_length) == 20
    _, micro = batch.split_by_tokens(auto.budget(batch.seq_length))
    assert [tuple(m.input_ids.shape) for m in micro] == [(2, 10), (3, 4)]
    assert resolve_policy(PolicyConfig(micro_batch_tokens=None), CPU, 1).micro_batches.budget(10) is None  # rows
    assert resolve_policy(PolicyConfig(micro_batch_tokens=64), CPU, 1).micro_batches.budget(10) == 64


def test_micro_batches_must_divide_the_batch():
    batch = good_batch()
    assert [m.input_ids.tolist() for m in batch.micro_batches(1)] == [[[1, 2, 3, 4]], [[5, 6, 7, 0]]]
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        batch.micro_batches(3)
