"""Vocab-parallel logprobs and entropy equal log_softmax of the full logits (TP=1 and TP=2)."""
import pytest
import torch
import torch.distributed as dist

from gdpo_megatron.policy.logprobs import vocab_parallel_logprobs

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
