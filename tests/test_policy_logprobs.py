"""Vocab-parallel logprobs and entropy equal log_softmax of the full logits (TP=1 and TP=2),
bit for bit the plain out-of-place computation, within the memory gdpo-plan counts for them."""
import pytest
import torch
import torch.distributed as dist

from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.policy.logprobs import vocab_parallel_logprobs
from gdpo_megatron.preflight.plan import Cluster, plan_memory
from support.memory import logprob_step_bytes_per_logit

VOCAB, PADDED = 61, 64  # the last 3 rows are padding (as when the embedding is padded for TP)


def make_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, PADDED, generator=g) * 3
    logits[..., VOCAB:] = 50.0  # padding rows would dominate the softmax if they leaked in
    targets = torch.randint(0, VOCAB, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g)
    return logits, targets, weights


def reference(logits, targets, weights, temperature):
    logits = logits[..., :VOCAB].detach().clone().requires_grad_(True)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    (logprobs * weights).sum().backward()
    grad = torch.cat([logits.grad, torch.zeros(*logits.shape[:-1], PADDED - VOCAB)], dim=-1)
    return logprobs.detach(), entropy.detach(), grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_whole_vocabulary_matches_log_softmax(temperature):
    logits, targets, weights = make_inputs()
    leaf = logits.clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs(leaf, targets, VOCAB, temperature=temperature)
    (logprobs * weights).sum().backward()
    exp_logprobs, exp_entropy, exp_grad = reference(logits, targets, weights, temperature)
    torch.testing.assert_close(logprobs, exp_logprobs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, exp_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad, exp_grad, rtol=1e-6, atol=1e-6)
    assert not entropy.requires_grad


def _sharded(temperature):
    """On each rank: logprobs, entropy and the gradient of this rank's vocabulary slice."""
    logits, targets, weights = make_inputs()
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs(shard, targets, VOCAB, group=dist.group.WORLD,
                                                temperature=temperature)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), entropy, shard.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_two_vocabulary_shards_match_log_softmax(gloo_world_2, temperature):
    results = gloo_world_2.run(_sharded, temperature)
    exp_logprobs, exp_entropy, exp_grad = reference(*make_inputs(), temperature)
    for logprobs, entropy, _ in results:
        torch.testing.assert_close(logprobs, exp_logprobs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(entropy, exp_entropy, rtol=1e-5, atol=1e-5)
    grad = torch.cat([r[2] for r in results], dim=-1)
    torch.testing.assert_close(grad, exp_grad, rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_named():
    logits, targets, _ = make_inputs()
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_logprobs(logits, targets[:, :-1], VOCAB)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, targets, VOCAB, temperature=0.0)


def plain_out_of_place(logits, targets, vocab_size, temperature, weights):
    """The same arithmetic as one out-of-place expression per step: cast, divide, mask the
    padding, shift by the max, exp, normalize, entropy over p > 0; and the gradient of
    ``sum(weights * logprobs)``, ``(one_hot(target) - p) * weight`` through the division and the cast."""
    x = logits.float() / temperature
    padding = torch.arange(x.shape[-1]) >= vocab_size
    x = x.masked_fill(padding, float("-inf"))
    shifted = x - x.max(dim=-1).values.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    softmax = exp / sum_exp.unsqueeze(-1)
    log_z = sum_exp.log()
    logprobs = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    entropy = log_z - torch.where(softmax > 0, softmax * shifted, 0.0).sum(dim=-1)
    one_hot = torch.nn.functional.one_hot(targets, x.shape[-1]).float()
    grad = ((one_hot - softmax) * weights.unsqueeze(-1)).masked_fill(padding, 0.0) / temperature
    return logprobs, entropy, grad.to(logits.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_in_place_steps_change_no_bit(dtype, temperature):
    """Logprobs, entropy and the logits' gradient equal the out-of-place computation exactly,
    with padding rows, a logit whose probability underflows to 0, and a sliced input (as the
    worker passes ``logits[:, :-1]``)."""
    logits, targets, weights = make_inputs(seed=1)
    logits = torch.cat([logits, logits[:, -1:]], dim=1).to(dtype)
    logits[0, 0, 7] = -300.0
    leaf = logits.clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs(leaf[:, :-1], targets, VOCAB, temperature=temperature)
    (logprobs * weights).sum().backward()
    exp_logprobs, exp_entropy, exp_grad = plain_out_of_place(logits[:, :-1], targets, VOCAB, temperature, weights)
    assert exp_entropy[0, 0].isfinite()  # the underflow's term is 0, not nan
    assert torch.equal(logprobs, exp_logprobs) and torch.equal(entropy, exp_entropy)
    assert leaf.grad.dtype == dtype and torch.equal(leaf.grad[:, :-1], exp_grad)
    assert not leaf.grad[:, -1].any()


def test_measured_peak_per_logit_is_what_the_plan_counts():
    """One update's log-prob step on bf16 logits made by an output-layer matmul: forward,
    backward, the worker's slice. Its peak of live bytes per logit element is within 10% of
    the bytes per element gdpo-plan counts for the last stage's logits."""
    plan = plan_memory(load_config(TrainConfig, "configs/tiny_cpu.yaml"), Cluster(1, 8, 80.0))
    model = plan.config.policy.model
    assert plan.config.policy.precision.dtype == "bf16"  # planned as on a GPU
    planned = plan.stage.logits / (plan.micro_batch_tokens * model.padded_vocab_size(1))
    measured = logprob_step_bytes_per_logit(positions=130, hidden_size=32, vocab_rows=50_048, vocab_size=50_000)
    assert abs(measured - planned) <= 0.1 * planned, (measured, planned)
