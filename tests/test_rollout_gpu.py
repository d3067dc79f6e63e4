"""GPU-only behaviour of the vLLM engine: sleep-mode memory release, TP=2, FP8 rollouts.

vLLM's sleep mode allows one engine per process (its CuMem allocator asserts that it holds no
memory when an engine loads its weights), so every test builds its engines in processes of its
own and compares their results here with the transformers models on the CPU.
"""
import pytest
import torch

from support.local_world import LocalWorld
from gdpo_megatron.device import CUDA
from gdpo_megatron.rollout import SamplingConfig

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 99, 3], [250, 251, 252]]
SEEDED = SamplingConfig(max_new_tokens=8, seed=9)


@pytest.fixture(scope="module")
def models(tiny_llamas):
    return tiny_llamas


def sampled_logprobs(model, prompt, tokens):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = model(ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def mean_logprob_gap(model, groups) -> float:
    """Mean |engine - model| logprob over the sampled tokens of ``groups`` (one per prompt)."""
    return torch.cat([
        (torch.tensor(logprobs, dtype=torch.float64) - sampled_logprobs(model, prompt, tokens)).abs()
        for prompt, group in zip(PROMPTS, groups) for tokens, logprobs in group
    ]).mean().item()


def _state_dict(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def _engine(model_path: str, **kwargs):
    from gdpo_megatron.rollout import VLLMEngine, VLLMEngineConfig

    torch.cuda.set_device(torch.distributed.get_rank())  # before NCCL's first collective
    return VLLMEngine(VLLMEngineConfig(model_path, max_model_len=256, gpu_memory_utilization=0.3, **kwargs), CUDA)


def _generate(engine, n: int, sampling: SamplingConfig):
    return [[(c.token_ids, c.logprobs) for c in group] for group in engine.generate(PROMPTS, n, sampling)]


def sleep_update_wake(base_path: str, other_path: str) -> dict:
    """Bytes held, bytes freed by sleep, and samples after an update while asleep."""
    free_before = torch.cuda.mem_get_info()[0]
    engine = _engine(base_path, dtype="float32")
    try:
        held = free_before - torch.cuda.mem_get_info()[0]
        engine.sleep()
        released = torch.cuda.mem_get_info()[0] - (free_before - held)
        engine.update_weights(_state_dict(other_path).items())  # wakes the weights only
        engine.wake_up()  # then the KV cache
        return dict(sleep_mode=engine.sleep_mode, held=held, released=released,
                    groups=_generate(engine, 1, SEEDED))
    finally:
        engine.close()


def fp8_samples(base_path: str, other_path: str):
    engine = _engine(base_path, dtype="bfloat16", quantization="fp8")
    try:
        engine.update_weights(_state_dict(other_path).items())
        return _generate(engine, 4, SamplingConfig(max_new_tokens=16, seed=0))
    finally:
        engine.close()


def tp2_update_and_generate(base_path: str, other_path: str):
    engine = _engine(base_path, dtype="float32", tensor_parallel_size=2)
    try:
        engine.update_weights(_state_dict(other_path).items())
        return _generate(engine, 1, SEEDED)
    finally:
        engine.close()


def test_sleep_releases_device_memory_and_update_then_wake_restores_generation(models):
    with LocalWorld(1, backend="nccl") as world:
        result = world.run(sleep_update_wake, models["paths"]["base"], models["paths"]["other"])[0]
    assert result["sleep_mode"]
    assert result["released"] > 0.8 * result["held"], f"sleep released {result['released']} of {result['held']} bytes"
    # the samples come from the new weights: their logprobs are the other model's (fp32 on both sides)
    assert mean_logprob_gap(models["other"], result["groups"]) < 1e-3


def test_fp8_rollouts_stay_close_to_the_full_precision_policy(models):
    with LocalWorld(1, backend="nccl") as world:
        groups = world.run(fp8_samples, models["paths"]["base"], models["paths"]["other"])[0]
    mismatch = mean_logprob_gap(models["other"], groups)
    # garbage or stale weights would be off by nats, not tenths
    assert 0 < mismatch < 0.5, f"mean |fp8 engine - fp32 policy| logprob = {mismatch:.4f}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus_updates_in_place(models):
    with LocalWorld(2, backend="nccl") as world:
        rank0, rank1 = world.run(tp2_update_and_generate, models["paths"]["base"], models["paths"]["other"])
    assert rank0 == rank1
    assert mean_logprob_gap(models["other"], rank0) < 1e-3
