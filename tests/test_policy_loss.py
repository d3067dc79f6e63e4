"""The clipped policy-gradient loss against a per-token loop written here."""
import math

import pytest
import torch

from gdpo_megatron.config.policy import LossConfig
from gdpo_megatron.policy.loss import LossTerms, policy_loss


def mean_loss(terms: LossTerms) -> torch.Tensor:
    """The mean loss of this batch alone (0 when nothing is valid)."""
    return terms.loss_sum / terms.count.clamp(min=1)


def token_metrics(terms: LossTerms) -> dict[str, float]:
    """Token means of the diagnostics of this batch alone, and the ratio's range."""
    tokens = terms.num_tokens.clamp(min=1)
    out = {name: (value / tokens).item() for name, value in terms.metric_sums.items()}
    out.update(ratio_min=terms.ratio_min.item(), ratio_max=terms.ratio_max.item())
    return out


def reference_loss(logprobs, old, adv, mask, low, high, agg, kl_coef=0.0, ref=None, rollout=None, tis_cap=None):
    """Per-token loop over python scalars (autograd flows through ``logprobs`` entries)."""
    token_losses, seq_losses = [], []
    for i in range(logprobs.shape[0]):
        losses = []
        for t in range(logprobs.shape[1]):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logprobs[i, t] - old[i, t])
            a = float(adv[i])
            clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
            loss = torch.maximum(-a * ratio, -a * clipped_ratio)
            if tis_cap is not None:  # a constant weight: no gradient through old or rollout
                loss = loss * min(math.exp(float(old[i, t] - rollout[i, t])), tis_cap)
            if kl_coef:
                d = ref[i, t] - logprobs[i, t]
                loss = loss + kl_coef * (torch.exp(d) - d - 1)
            losses.append(loss)
        token_losses += losses
        if losses:
            seq_losses.append(sum(losses) / len(losses))
    chosen = token_losses if agg == "token_mean" else seq_losses
    return sum(chosen) / len(chosen)


def make_batch(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -2.0 - torch.rand(B, T, generator=g, dtype=torch.float64)
    # every row sweeps ratios from ~0.55 to ~1.65: clipped on both sides for either sign
    sweep = torch.linspace(-0.6, 0.5, T, dtype=torch.float64)
    offsets = torch.stack([sweep.roll(-i) for i in range(B)])
    logprobs = old + offsets + 0.01 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.4
    adv = torch.tensor([1.5, -0.7, 0.3, -1.2, 0.9], dtype=torch.float64)[:B]
    lengths = torch.tensor([7, 3, 5, 1, 4])[:B]
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    mask[2, 0] = False  # a hole inside a sequence
    # masked positions hold values that would overflow exp() if they leaked in
    old = torch.where(mask, old, torch.full_like(old, -1e4))
    return logprobs, old, adv, mask, ref


def rollout_logprobs(old, mask):
    """An engine's logprobs off the old ones by -0.9..0.9 nats: importance weights 0.4-2.5."""
    gap = torch.linspace(-0.9, 0.9, old.shape[1], dtype=torch.float64).roll(2)
    return torch.where(mask, old + gap, torch.full_like(old, 1e4))


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.25])
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.1, 0.3)])
@pytest.mark.parametrize("tis_cap", [None, 1.5])
def test_loss_and_gradient_match_reference(agg, kl_coef, low, high, tis_cap):
    logprobs, old, adv, mask, ref = make_batch()
    rollout = rollout_logprobs(old, mask)
    config = LossConfig(ratio_clip_low=low, ratio_clip_high=high, loss_agg_mode=agg, kl_coef=kl_coef,
                        tis_cap=tis_cap)

    lp = logprobs.clone().requires_grad_(True)
    terms = policy_loss(lp, old, adv, mask, config, ref_logprobs=ref if kl_coef else None, rollout_logprobs=rollout)
    loss = mean_loss(terms)
    loss.backward()

    lp_ref = logprobs.clone().requires_grad_(True)
    expected = reference_loss(lp_ref, old, adv, mask, low, high, agg, kl_coef, ref, rollout, tis_cap)
    expected.backward()

    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-12, atol=1e-12)
    assert lp.grad[~mask].abs().max() == 0


def test_clipping_happens_on_both_sides_and_metrics_match_direct_counts():
    logprobs, old, adv, mask, ref = make_batch()
    config = LossConfig(ratio_clip_low=0.2, ratio_clip_high=0.2, kl_coef=0.1)
    terms = policy_loss(logprobs, old, adv, mask, config, ref_logprobs=ref, entropy=torch.ones_like(logprobs))
    metrics = token_metrics(terms)

    ratio = (logprobs - old).exp()[mask]
    a = adv.unsqueeze(1).expand_as(mask)[mask]
    clipped_high = (a > 0) & (ratio > 1.2)
    clipped_low = (a < 0) & (ratio < 0.8)
    assert clipped_high.any() and clipped_low.any()  # the batch exercises both sides
    n = mask.sum().item()
    assert metrics["clip_fraction"] == pytest.approx((clipped_high | clipped_low).sum().item() / n)
    assert metrics["ratio_mean"] == pytest.approx(ratio.mean().item())
    assert metrics["ratio_min"] == pytest.approx(ratio.min().item())
    assert metrics["ratio_max"] == pytest.approx(ratio.max().item())
    log_ratio = (logprobs - old)[mask]
    assert metrics["approx_kl"] == pytest.approx((ratio - 1 - log_ratio).mean().item())
    assert metrics["logprob_gap"] == pytest.approx(log_ratio.abs().mean().item())
    d = (ref - logprobs)[mask]
    assert metrics["kl_ref"] == pytest.approx((d.exp() - d - 1).mean().item())
    assert metrics["entropy"] == pytest.approx(1.0)
    assert terms.num_tokens.item() == n
    assert (metrics["tis_weight"], metrics["tis_truncated"], metrics["rollout_gap"]) == (1.0, 0.0, 0.0)


def test_truncated_importance_weights_and_the_rollout_gap_match_direct_counts():
    logprobs, old, adv, mask, _ = make_batch()
    rollout = rollout_logprobs(old, mask)
    metrics = token_metrics(policy_loss(logprobs, old, adv, mask, LossConfig(tis_cap=2.0), rollout_logprobs=rollout))
    weights = (old - rollout).exp()[mask]
    assert (weights > 2.0).any() and (weights < 1.0).any()
    assert metrics["tis_weight"] == pytest.approx(weights.clamp(max=2.0).mean().item())
    assert metrics["tis_truncated"] == pytest.approx((weights > 2.0).double().mean().item())
    assert metrics["rollout_gap"] == pytest.approx((logprobs - rollout)[mask].abs().mean().item())


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_terms_of_micro_batches_add_up_to_the_whole_batch(agg):
    logprobs, old, adv, mask, _ = make_batch()
    config = LossConfig(loss_agg_mode=agg)
    whole = policy_loss(logprobs, old, adv, mask, config)
    parts = [policy_loss(logprobs[s], old[s], adv[s], mask[s], config) for s in (slice(0, 2), slice(2, 5))]
    combined = sum(p.loss_sum for p in parts) / sum(p.count for p in parts)
    torch.testing.assert_close(combined, mean_loss(whole), rtol=1e-12, atol=1e-12)
    # The split is uneven, so averaging the parts' means would differ.
    assert not math.isclose(sum(mean_loss(p).item() for p in parts) / 2, mean_loss(whole).item(), rel_tol=1e-6)


def test_fully_masked_batch_has_zero_loss_and_gradient():
    logprobs, old, adv, mask, _ = make_batch()
    lp = logprobs.clone().requires_grad_(True)
    terms = policy_loss(lp, old, adv, torch.zeros_like(mask), LossConfig())
    mean_loss(terms).backward()
    assert mean_loss(terms).item() == 0.0 and terms.count.item() == 0
    assert lp.grad.abs().max() == 0


def test_bad_inputs_name_the_field():
    logprobs, old, adv, mask, _ = make_batch()
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(logprobs, old[:, :-1], adv, mask, LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, old, adv[:-1], mask, LossConfig())
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, adv, mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="rollout_logprobs: required when loss.tis_cap is set"):
        policy_loss(logprobs, old, adv, mask, LossConfig(tis_cap=2.0))
