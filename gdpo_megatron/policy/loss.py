"""The GDPO policy loss: clipped policy gradient with optional truncated importance sampling
of the rollout/training mismatch and an optional k3 KL penalty.

GDPO advantages are one value per rollout, broadcast to that rollout's completion tokens.
Per valid token t of sequence i, with ratio r = exp(logp - old_logp):

    loss_it = w_it * max(-A_i * r, -A_i * clip(r, 1 - ratio_clip_low, 1 + ratio_clip_high))
              + kl_coef * (exp(ref_logp - logp) - (ref_logp - logp) - 1)

where ``w_it = min(exp(old_logp - rollout_logp), tis_cap)`` (detached) with ``loss.tis_cap``
set, else 1: the old logprobs are the training engine's, the rollout logprobs the sampling
engine's, and ``w`` corrects for sampling from the engine's slightly different distribution
(truncated importance sampling, as verl's token-level ``rollout_is`` and NeMo-RL's ``tis``).

``token_mean`` averages over all valid tokens of the batch; ``seq_mean_token_mean``
averages each sequence's tokens, then over sequences. The loss is returned as a *sum* and a
*count* (:class:`LossTerms`) so that micro-batches and data-parallel ranks combine into the
exact global mean: total sum / total count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gdpo_megatron.config.policy import LossConfig

# Token-averaged diagnostics, carried as sums over valid tokens.
# logprob_gap: mean |current - old| logprob.
# rollout_gap: mean |current - rollout| logprob; in a batch's first optimizer pass, the
# rollout-vs-policy mismatch (0 without rollout logprobs).
# tis_weight: mean truncated importance weight w (1 without tis_cap); tis_truncated: the share
# of tokens whose weight the cap truncated.
TOKEN_METRICS = ("clip_fraction", "approx_kl", "entropy", "ratio_mean", "kl_ref", "logprob_gap", "rollout_gap",
                 "tis_weight", "tis_truncated")


@dataclass
class LossTerms:
    """A batch's loss as ``loss_sum / count``, plus diagnostic sums.

    ``count`` is the number of valid tokens (``token_mean``) or of sequences with at least one
    valid token (``seq_mean_token_mean``). ``metric_sums`` are sums over valid tokens of
    :data:`TOKEN_METRICS`; ``ratio_min`` / ``ratio_max`` are over valid tokens (+inf / -inf
    when there are none).
    """

    loss_sum: torch.Tensor
    count: torch.Tensor
    num_tokens: torch.Tensor
    metric_sums: dict[str, torch.Tensor]
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    rollout_logprobs: Optional[torch.Tensor] = None,
) -> LossTerms:
    """Clipped policy-gradient loss terms of one batch.

    Args:
        logprobs: ``[B, T]`` current policy log-probabilities of the sampled tokens.
        old_logprobs: ``[B, T]`` the PPO ratio's old-policy log-probabilities.
        advantages: ``[B]`` one advantage per sequence.
        mask: ``[B, T]`` True where a token counts (completion tokens).
        config: clipping, aggregation, truncated importance sampling and KL settings.
        ref_logprobs: ``[B, T]`` reference-model log-probabilities; required when
            ``config.kl_coef > 0``.
        entropy: ``[B, T]`` optional per-token entropy, reported as a metric.
        rollout_logprobs: ``[B, T]`` the rollout engine's log-probabilities of the sampled
            tokens; required when ``config.tis_cap`` is set.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs: expected [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs),
                    ("entropy", entropy), ("rollout_logprobs", rollout_logprobs)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name}: expected shape {tuple(logprobs.shape)}, got {tuple(t.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages: expected shape ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs: required when loss.kl_coef > 0")
    if config.tis_cap is not None and rollout_logprobs is None:
        raise ValueError("rollout_logprobs: required when loss.tis_cap is set")

    mask = mask.bool()
    weight = mask.to(logprobs.dtype)
    # Padding positions may hold anything; keep them out of exp().
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = log_ratio.exp()
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.ratio_clip_low, 1.0 + config.ratio_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    tis_weight, tis_truncated = torch.ones_like(weight), torch.zeros_like(mask)
    if config.tis_cap is not None:
        importance = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).exp().detach()
        tis_weight, tis_truncated = importance.clamp(max=config.tis_cap), importance > config.tis_cap
        per_token = per_token * tis_weight

    metric_sums = {
        "clip_fraction": ((clipped > unclipped) & mask).sum().to(logprobs.dtype),
        "approx_kl": (((ratio - 1.0) - log_ratio) * weight).sum().detach(),
        "entropy": (entropy * weight).sum().detach() if entropy is not None else logprobs.new_zeros(()),
        "ratio_mean": (ratio * weight).sum().detach(),
        "kl_ref": logprobs.new_zeros(()),
        "logprob_gap": (log_ratio.abs() * weight).sum().detach(),
        "rollout_gap": (torch.where(mask, logprobs - rollout_logprobs, 0.0).abs() * weight).sum().detach()
        if rollout_logprobs is not None else logprobs.new_zeros(()),
        "tis_weight": (tis_weight * weight).sum(),
        "tis_truncated": (tis_truncated & mask).sum().to(logprobs.dtype),
    }
    if config.kl_coef > 0:
        ref_log_ratio = torch.where(mask, ref_logprobs - logprobs, 0.0)
        kl = ref_log_ratio.exp() - ref_log_ratio - 1.0
        per_token = per_token + config.kl_coef * kl
        metric_sums["kl_ref"] = (kl * weight).sum().detach()

    tokens_per_seq = weight.sum(dim=-1)
    if config.loss_agg_mode == "token_mean":
        loss_sum = (per_token * weight).sum()
        count = tokens_per_seq.sum()
    else:  # seq_mean_token_mean
        loss_sum = ((per_token * weight).sum(dim=-1) / tokens_per_seq.clamp(min=1)).sum()
        count = (tokens_per_seq > 0).sum()
    detached_ratio = ratio.detach()
    return LossTerms(
        loss_sum=loss_sum,
        count=count.to(torch.int),
        num_tokens=mask.sum().to(torch.int),
        metric_sums=metric_sums,
        ratio_min=torch.where(mask, detached_ratio, float("inf")).min(),
        ratio_max=torch.where(mask, detached_ratio, float("-inf")).max(),
    )
