"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds a contiguous slice of the vocabulary. The log-softmax is
assembled with three all-reduces over the TP group (max, sum of exponentials, target logit)
instead of gathering the full logits, and the gradient is the local slice of
``one_hot(target) - softmax``. Vocabulary rows at or beyond ``vocab_size`` (padding added so
the embedding splits evenly) are excluded from the softmax.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobs(torch.autograd.Function):
    """log p(target) and entropy from a vocabulary shard; only the logprobs have a gradient."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        local_vocab = logits.shape[-1]
        global_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)

        local_index = targets - vocab_start
        is_local = (local_index >= 0) & (local_index < local_vocab)
        local_index = local_index.clamp(0, local_vocab - 1)
        target_logit = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(torch.where(is_local, target_logit, 0.0), dist.ReduceOp.SUM, group)

        log_sum_exp = sum_exp.log()
        softmax = exp / sum_exp.unsqueeze(-1)
        # Entropy: log Z - sum_v p_v * shifted_v (padding rows have p_v = 0).
        p_shifted = torch.where(softmax > 0, softmax * shifted, 0.0).sum(dim=-1)
        entropy = log_sum_exp - _all_reduce(p_shifted, dist.ReduceOp.SUM, group)

        ctx.save_for_backward(softmax, local_index, is_local)
        ctx.mark_non_differentiable(entropy)
        return target_logit - log_sum_exp, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        softmax, local_index, is_local = ctx.saved_tensors
        grad = -softmax
        grad.scatter_add_(-1, local_index.unsqueeze(-1), is_local.to(grad.dtype).unsqueeze(-1))
        return grad * grad_logprobs.unsqueeze(-1), None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` and the entropy of the next-token distribution.

    Args:
        logits: ``[..., V_local]``, this rank's contiguous vocabulary slice (rank r of the
            ``group`` holds rows ``r * V_local`` to ``(r + 1) * V_local``).
        targets: ``[...]`` global token ids in ``[0, vocab_size)``.
        vocab_size: real vocabulary size; logits of padding rows beyond it are ignored.
        group: the tensor-parallel group; ``None`` when ``logits`` hold the whole vocabulary.
        temperature: logits are divided by it (match the sampling temperature).

    Returns:
        ``(logprobs, entropy)``, both ``[...]`` in fp32; only ``logprobs`` carries a gradient.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    rank = dist.get_rank(group) if group is not None else 0
    local_vocab = logits.shape[-1]
    vocab_start = rank * local_vocab
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    padding = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device) >= vocab_size
    if padding.any():
        logits = logits.masked_fill(padding, float("-inf"))
    return _VocabParallelLogprobs.apply(logits, targets, vocab_start, group)
