"""The GPU path: Transformer Engine layer spec in bf16 (with TE's fused RoPE), FP8 train steps (with
sequence parallelism), TE's own FP8 recipe checks, and sequence parallelism without Transformer Engine."""
import pytest
import torch

from support.local_world import LocalWorld
from support.placement import this_rank
from gdpo_megatron.policy.batch import PolicyBatch
from gdpo_megatron.config.policy import (
    FP8_RECIPES,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PolicyConfig,
    PrecisionConfig,
)
from gdpo_megatron.device import CUDA, transformer_engine_available
from gdpo_megatron.resolve import resolve_precision

pytestmark = pytest.mark.gpu
needs_te = pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine")

B, T, MICRO = 4, 32, 2  # FP8 GEMMs need token counts in multiples of 8 and widths in multiples of 16


def make_batch(seq_length: int = T) -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (B, seq_length), generator=g)
    mask = torch.zeros(B, seq_length, dtype=torch.bool)
    mask[:, seq_length // 4:] = True
    return PolicyBatch(ids, mask, torch.randn(B, generator=g))


def te_step(fp8, recipe):
    """Parameter names, logprobs (policy vs plain log_softmax of its logits) and step metrics."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    config = PolicyConfig(model=ModelConfig.preset("tiny"), optim=OptimConfig(lr=1e-5), micro_batch_size=MICRO,
                          precision=PrecisionConfig(dtype="bf16", fp8=fp8, fp8_recipe=recipe))
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        names = [name for name, _ in worker.gpt_model.named_parameters()]
        batch = make_batch()
        logprobs = worker.compute_logprobs(batch).cpu()
        ids = batch.input_ids.cuda()
        positions = torch.arange(T, device="cuda").expand(MICRO, T)
        plain = []
        with torch.no_grad():  # micro-batch by micro-batch: bf16 GEMMs of other shapes round differently
            for start in range(0, B, MICRO):
                micro = ids[start:start + MICRO]
                logits = worker.gpt_model(micro, positions, None)
                plain.append(torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, micro[:, 1:, None]).squeeze(-1))
        metrics = worker.train_step(batch)
    return names, logprobs, torch.cat(plain).cpu(), metrics


@pytest.fixture(scope="module")
def gpu_world():
    with LocalWorld(1, backend="nccl") as world:
        yield world


def rotations(fused_too: bool):
    """RoPE on one bf16 query tensor through megatron's unfused path and, with the Transformer
    Engine spec's config, through TE's fused kernel."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from gdpo_megatron.policy.model import destroy_model_parallel, initialize_model_parallel, transformer_config

    model = ModelConfig.preset("tiny")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    initialize_model_parallel(ParallelConfig())
    try:
        configs = [transformer_config(model, ParallelConfig(), PrecisionConfig(dtype="bf16", transformer_engine=te))
                   for te in ((False, True) if fused_too else (False,))]
        freqs = RotaryEmbedding(kv_channels=model.head_dim, rotary_percent=1.0,
                                rotary_base=int(model.rotary_base))(T).to(device)
        t = torch.randn(T, MICRO, model.num_attention_heads, model.head_dim, generator=torch.Generator().manual_seed(0))
        t = t.to(device, torch.bfloat16)
        return [(config.apply_rope_fusion, apply_rotary_pos_emb(t, freqs, config).float().cpu()) for config in configs]
    finally:
        destroy_model_parallel()


@needs_te
def test_transformer_engine_spec_fuses_rope_as_megatron_rotates(gpu_world):
    """With Transformer Engine the config turns on TE's fused RoPE; it rotates as megatron's
    unfused torch path does, to bf16 rounding (the unfused path rounds cos, sin and both
    products to bf16: a few units in the last place of inputs up to about 4.5, 2 ulp = 1/16)."""
    (plain_flag, plain), (fused_flag, fused) = gpu_world.run(rotations, True)[0]
    assert fused_flag and not plain_flag
    torch.testing.assert_close(fused, plain, rtol=1.6e-2, atol=1 / 16)


@needs_te
def test_transformer_engine_spec_bf16_step(gpu_world):
    names, logprobs, plain, metrics = gpu_world.run(te_step, None, "delayed")[0]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n for n in names)
    # The same bf16 logits (same shapes, same kernels); only the fp32 log-softmax's summation
    # order differs between the vocab-parallel path and torch's.
    torch.testing.assert_close(logprobs, plain, rtol=0, atol=1e-3)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0


@needs_te
@pytest.mark.parametrize("fp8", ["e4m3", "hybrid"])
def test_fp8_step_tracks_bf16(gpu_world, fp8):
    _, bf16_logprobs, _, bf16_metrics = gpu_world.run(te_step, None, "delayed")[0]
    _, fp8_logprobs, _, fp8_metrics = gpu_world.run(te_step, fp8, "delayed")[0]
    assert torch.isfinite(fp8_logprobs).all()
    assert (fp8_logprobs - bf16_logprobs).abs().mean() < 0.05
    assert fp8_metrics["loss"] == pytest.approx(bf16_metrics["loss"], abs=0.05)
    assert fp8_metrics["grad_norm"] > 0 and fp8_metrics["update_skipped"] == 0.0


def one_row_fp8_step(recipe):
    """One train step on one row of exactly ``sequence_multiple()`` tokens at TP 1; its metrics."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    config = PolicyConfig(model=ModelConfig.preset("tiny"), optim=OptimConfig(lr=1e-5), micro_batch_size=1,
                          precision=PrecisionConfig(dtype="bf16", fp8="e4m3", fp8_recipe=recipe))
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        return config.sequence_multiple(), worker.train_step(make_batch(config.sequence_multiple()).slice(0, 1))


@needs_te
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_step_on_one_row_of_the_sequence_multiple(gpu_world, recipe):
    """The weight-gradient GEMM's token count is the row's width: cuBLASLt's FP8 GEMM on Hopper
    refuses one that is not a multiple of 16 ("Caller must pad")."""
    width, metrics = gpu_world.run(one_row_fp8_step, recipe)[0]
    assert width == 16
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["update_skipped"] == 0.0


def recipe_verdicts(recipe):
    """(our check passed, TE's own check of the recipe megatron-core builds passed, its reason)."""
    from megatron.core.fp8_utils import get_fp8_recipe
    from transformer_engine.pytorch.quantization import check_recipe_support

    from gdpo_megatron.policy.model import transformer_config

    precision = PrecisionConfig(dtype="bf16", fp8="hybrid", fp8_recipe=recipe)
    try:
        resolve_precision(precision, CUDA)
        ours = True
    except ValueError:
        ours = False
    try:
        config = transformer_config(ModelConfig.preset("tiny"), ParallelConfig(), precision, CUDA)
        check_recipe_support(get_fp8_recipe(config))
        return ours, True, ""
    except AssertionError as e:
        return ours, False, str(e)


@needs_te
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_recipe_check_agrees_with_transformer_engine(recipe):
    ours, te_says, reason = recipe_verdicts(recipe)
    assert ours == te_says, reason


def _use_the_gpu_of_this_rank() -> None:
    torch.cuda.set_device(torch.distributed.get_rank())


def sequence_parallel_step(tp: int, fp8, transformer_engine: bool, seq_length: int, micro_batch_size: int):
    """One train step at TP=``tp`` with sequence parallelism; the norm classes and the metrics."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    config = PolicyConfig(model=ModelConfig.preset("tiny", num_attention_heads=4, num_query_groups=4, head_dim=64,
                                                   hidden_size=256, ffn_hidden_size=512),
                          parallel=ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True),
                          precision=PrecisionConfig(dtype="bf16", fp8=fp8, transformer_engine=transformer_engine),
                          optim=OptimConfig(lr=1e-5), micro_batch_size=micro_batch_size)
    assert seq_length % config.sequence_multiple() == 0
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        norms = sorted({type(m).__name__ for name, m in worker.gpt_model.named_modules() if name.endswith("norm")})
        return norms, worker.train_step(make_batch(seq_length))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sequence_parallel_without_transformer_engine():
    with LocalWorld(2, backend="nccl") as world:
        world.run(_use_the_gpu_of_this_rank)
        for norms, metrics in world.run(sequence_parallel_step, 2, None, False, T, MICRO):
            assert norms == ["RMSNorm"]
            assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0


@needs_te
@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_with_sequence_parallelism_at_one_row_per_micro_batch(tp):
    """The shortest padded length: (T / TP) x 1 row = 8 tokens per rank, what TE's FP8 GEMMs accept."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    seq_length = PolicyConfig(parallel=ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True),
                              precision=PrecisionConfig(dtype="bf16", fp8="hybrid")).sequence_multiple()
    with LocalWorld(tp, backend="nccl") as world:
        world.run(_use_the_gpu_of_this_rank)
        for _, metrics in world.run(sequence_parallel_step, tp, "hybrid", True, seq_length, 1):
            assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["update_skipped"] == 0.0
