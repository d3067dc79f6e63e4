"""GPU-only behaviour of the vLLM engine: sleep-mode memory release, TP=2, FP8 rollouts."""
import pytest
import torch

from gdpo_megatron.distributed.local_world import LocalWorld
from gdpo_megatron.rollout import SamplingConfig, VLLMEngine, VLLMEngineConfig

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 99, 3], [250, 251, 252]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def models(tiny_llamas):
    return tiny_llamas


def sampled_logprobs(model, prompt, tokens):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = model(ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def greedy(model, prompt, steps):
    tokens = []
    for _ in range(steps):
        with torch.no_grad():
            tokens.append(int(model(torch.tensor([list(prompt) + tokens])).logits[0, -1].argmax()))
    return tokens


def test_sleep_releases_device_memory_and_update_then_wake_restores_generation(models):
    free_before = torch.cuda.mem_get_info()[0]
    engine = VLLMEngine(VLLMEngineConfig(models["paths"]["base"], dtype="float32", max_model_len=256, gpu_memory_utilization=0.3))
    try:
        assert engine.sleep_mode
        held = free_before - torch.cuda.mem_get_info()[0]
        engine.sleep()
        released = torch.cuda.mem_get_info()[0] - (free_before - held)
        assert released > 0.8 * held, f"sleep released {released} of {held} bytes"
        engine.update_weights(models["other"].state_dict().items())  # wakes the weights only
        engine.wake_up()  # then the KV cache
        got = [g[0].token_ids for g in engine.generate(PROMPTS, 1, GREEDY)]
        assert got == [greedy(models["other"], p, 8) for p in PROMPTS]
    finally:
        engine.close()


def test_fp8_rollouts_stay_close_to_the_full_precision_policy(models):
    engine = VLLMEngine(
        VLLMEngineConfig(models["paths"]["base"], dtype="bfloat16", max_model_len=256, quantization="fp8", gpu_memory_utilization=0.3)
    )
    try:
        engine.update_weights(models["other"].state_dict().items())
        groups = engine.generate(PROMPTS, 4, SamplingConfig(max_new_tokens=16, seed=0))
        mismatch = torch.cat(
            [
                (torch.tensor(c.logprobs, dtype=torch.float64) - sampled_logprobs(models["other"], p, c.token_ids)).abs()
                for p, g in zip(PROMPTS, groups)
                for c in g
            ]
        ).mean()
        # garbage or stale weights would be off by nats, not tenths
        assert 0 < mismatch < 0.5, f"mean |fp8 engine - fp32 policy| logprob = {mismatch:.4f}"
    finally:
        engine.close()


_ENGINE = {}


def _start_tp2(model_path):
    torch.cuda.set_device(torch.distributed.get_rank())  # before NCCL's first collective
    _ENGINE["engine"] = VLLMEngine(
        VLLMEngineConfig(model_path, tensor_parallel_size=2, dtype="float32", max_model_len=256, gpu_memory_utilization=0.3)
    )


def _update_and_generate(model_path):
    from transformers import AutoModelForCausalLM

    _ENGINE["engine"].update_weights(AutoModelForCausalLM.from_pretrained(model_path).state_dict().items())
    return [g[0].token_ids for g in _ENGINE["engine"].generate(PROMPTS, 1, GREEDY)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_two_gpus_updates_in_place(models):
    with LocalWorld(2, backend="nccl") as world:
        world.run(_start_tp2, models["paths"]["base"])
        rank0, rank1 = world.run(_update_and_generate, models["paths"]["other"])
    assert rank0 == rank1 == [greedy(models["other"], p, 8) for p in PROMPTS]
