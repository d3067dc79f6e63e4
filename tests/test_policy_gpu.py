"""The GPU path: Transformer Engine layer spec in bf16, and an FP8 train step (needs CUDA + TE)."""
import pytest
import torch

from gdpo_megatron.distributed.local_world import LocalWorld
from gdpo_megatron.policy.batch import PolicyBatch
from gdpo_megatron.policy.config import (
    ModelConfig,
    OptimConfig,
    PolicyConfig,
    PrecisionConfig,
    transformer_engine_available,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine"),
]

B, T = 4, 32  # FP8 GEMMs need token counts and widths in multiples of 16


def make_batch() -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 8:] = True
    return PolicyBatch(ids, mask, torch.randn(B, generator=g))


def te_step(fp8, recipe):
    """Parameter names, logprobs (policy vs plain log_softmax of its logits) and step metrics."""
    from gdpo_megatron.policy.worker import PolicyWorker

    config = PolicyConfig(model=ModelConfig.preset("tiny"), optim=OptimConfig(lr=1e-5), micro_batch_size=2,
                          precision=PrecisionConfig(dtype="bf16", fp8=fp8, fp8_recipe=recipe))
    with PolicyWorker(config) as worker:
        names = [name for name, _ in worker.gpt_model.named_parameters()]
        batch = make_batch()
        logprobs = worker.compute_logprobs(batch).cpu()
        ids = batch.input_ids.cuda()
        with torch.no_grad():
            logits = worker.gpt_model(ids, torch.arange(T, device="cuda").expand(B, T), None)
        plain = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
        metrics = worker.train_step(batch)
    return names, logprobs, plain, metrics


@pytest.fixture(scope="module")
def gpu_world():
    with LocalWorld(1, backend="nccl") as world:
        yield world


def test_transformer_engine_spec_bf16_step(gpu_world):
    names, logprobs, plain, metrics = gpu_world.run(te_step, None, "delayed")[0]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n for n in names)
    torch.testing.assert_close(logprobs, plain, rtol=0, atol=1e-4)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0


@pytest.mark.parametrize("fp8", ["e4m3", "hybrid"])
def test_fp8_step_tracks_bf16(gpu_world, fp8):
    _, bf16_logprobs, _, bf16_metrics = gpu_world.run(te_step, None, "delayed")[0]
    _, fp8_logprobs, _, fp8_metrics = gpu_world.run(te_step, fp8, "delayed")[0]
    assert torch.isfinite(fp8_logprobs).all()
    assert (fp8_logprobs - bf16_logprobs).abs().mean() < 0.05
    assert fp8_metrics["loss"] == pytest.approx(bf16_metrics["loss"], abs=0.05)
    assert fp8_metrics["grad_norm"] > 0 and fp8_metrics["update_skipped"] == 0.0


def test_fp8_recipe_beyond_this_gpu_is_a_config_error():
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (10, 0):
        pytest.skip("this GPU runs every FP8 recipe")
    with pytest.raises(ValueError, match="precision.fp8_recipe='mxfp8'"):
        PrecisionConfig(dtype="bf16", fp8="e4m3", fp8_recipe="mxfp8").check_runtime()
