"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds a contiguous slice of the vocabulary. The log-softmax is
assembled with three all-reduces over the TP group (max, sum of exponentials, target logit)
instead of gathering the full logits, and the gradient is the local slice of
``one_hot(target) - softmax``. Vocabulary rows at or beyond ``vocab_size`` (padding added so
the embedding splits evenly) are excluded from the softmax.

Memory: the logits are the largest tensors of an update (tokens x V / TP), so the step works
on one fp32 copy of them in place. Per logit element it holds, besides the logits themselves
in their own dtype, at most :data:`WORKING_BYTES_PER_LOGIT`: the shifted fp32 logits, their
softmax, and one more fp32 buffer (first a one-byte mask, then the products of the entropy's
dot product). Only the softmax outlives the forward pass, and the backward pass turns it into
the gradient in place. :func:`peak_bytes_per_logit` is what ``gdpo-plan`` counts, and a CPU
test measures it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# fp32 bytes per logit element at the forward pass's peak: shifted logits, softmax, the
# entropy's elementwise products (torch.linalg.vecdot multiplies, then sums).
WORKING_BYTES_PER_LOGIT = 3 * 4


def peak_bytes_per_logit(logits_bytes: int) -> int:
    """Peak bytes per logit element of :func:`vocab_parallel_logprobs`, the logits included
    (``logits_bytes`` per element: 2 for bf16). The backward pass holds less (the softmax
    turned gradient and the gradient in the logits' dtype)."""
    return logits_bytes + WORKING_BYTES_PER_LOGIT


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobs(torch.autograd.Function):
    """log p(target) and entropy from a vocabulary shard; only the logprobs have a gradient."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, vocab_start, temperature, group):
        local_vocab = logits.shape[-1]
        real = min(max(vocab_size - vocab_start, 0), local_vocab)  # columns of the real vocabulary
        # The one fp32 working copy; every step below writes into it or into the softmax.
        shifted = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if temperature != 1.0:
            shifted.div_(temperature)
        shifted[..., real:] = float("-inf")
        global_max = _all_reduce(shifted.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted.sub_(global_max.unsqueeze(-1))
        softmax = shifted.exp()
        sum_exp = _all_reduce(softmax.sum(dim=-1), dist.ReduceOp.SUM, group)

        local_index = targets - vocab_start
        is_local = (local_index >= 0) & (local_index < local_vocab)
        local_index = local_index.clamp(0, local_vocab - 1)
        target_logit = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(torch.where(is_local, target_logit, 0.0), dist.ReduceOp.SUM, group)

        log_sum_exp = sum_exp.log()
        softmax.div_(sum_exp.unsqueeze(-1))
        # Entropy: log Z - sum_v p_v * shifted_v, a term being 0 where p_v = 0 (padding rows,
        # whose shifted_v is -inf, and underflow).
        shifted.masked_fill_(softmax == 0, 0.0)
        p_shifted = torch.linalg.vecdot(softmax, shifted)
        del shifted
        entropy = log_sum_exp - _all_reduce(p_shifted, dist.ReduceOp.SUM, group)

        ctx.save_for_backward(softmax, local_index, is_local)
        ctx.logits_dtype, ctx.real, ctx.temperature = logits.dtype, real, temperature
        ctx.mark_non_differentiable(entropy)
        return target_logit - log_sum_exp, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        softmax, local_index, is_local = ctx.saved_tensors
        grad = softmax.neg_()  # the saved softmax becomes the gradient buffer
        grad.scatter_add_(-1, local_index.unsqueeze(-1), is_local.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_logprobs.unsqueeze(-1))
        grad[..., ctx.real:] = 0.0
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


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
            ``group`` holds rows ``r * V_local`` to ``(r + 1) * V_local``), in any float dtype.
        targets: ``[...]`` global token ids in ``[0, vocab_size)``.
        vocab_size: real vocabulary size; logits of padding rows beyond it are ignored.
        group: the tensor-parallel group; ``None`` when ``logits`` hold the whole vocabulary.
        temperature: logits are divided by it (match the sampling temperature).

    Returns:
        ``(logprobs, entropy)``, both ``[...]`` in fp32; only ``logprobs`` carries a gradient
        (one backward pass: it consumes the saved softmax).
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    rank = dist.get_rank(group) if group is not None else 0
    vocab_start = rank * logits.shape[-1]
    return _VocabParallelLogprobs.apply(logits, targets, vocab_size, vocab_start, float(temperature), group)
