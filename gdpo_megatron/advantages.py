"""Advantage estimators for multi-reward RL: GDPO, GRPO and GRPO without std.

The single source of truth for the math. Everything is vectorized over rollouts, groups and
rewards (segment sums via ``index_add``/``scatter_reduce``; no Python loop over prompts).
Every statistic that crosses rollouts goes through a :class:`Reduction`, so the same code
computes the exact result when the rollouts are split over data-parallel ranks
(:class:`gdpo_megatron.distributed.advantages.AllReduce`); this module never imports
``torch.distributed``.

A mode is a :class:`GroupNormalizer` registered under its name in :data:`GROUP_NORMALIZERS`
(the names a config may give are :data:`~gdpo_megatron.config.advantage.AdvantageMode`). A
group filter (:data:`GROUP_FILTERS`, ``advantage.filter``) drops whole prompt groups: the
advantages are computed again without them.

Conventions (shared by every mode):

* rollouts with ``mask == False`` are left out of every statistic and get advantage 0;
* a group's spread uses the unbiased std (n - 1); ``eps`` is added to the std;
* a group of one valid rollout, or whose values are all equal, contributes 0;
* GDPO normalizes each reward inside its group, then sums with the weights, then
  (by default) normalizes the sum over all valid rollouts of the batch;
* GRPO sums the weighted rewards first and normalizes the sum inside the group;
  GRPO without std only subtracts the group mean. Neither batch-normalizes unless asked;
* ``informative_groups`` (dynamic sampling) keeps the groups in which some reward varies.

Leave-one-out (``leave_one_out=True``, NeMo-RL's ``use_leave_one_out_baseline``): a rollout's
baseline is the mean of the *other* valid rollouts of its group and its scale the unbiased
std of those others, per rollout. Where the others are all equal (always in a group of 2)
the centered value is kept undivided, as NeMo-RL does; a group of one valid rollout still
contributes 0. ``normalize_rewards=False`` centers without dividing in either case.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from gdpo_megatron.config.advantage import AdvantageConfig, AdvantageMode, ConditionConfig, GroupFilter

DISTINCT_DECIMALS = 6  # advantages are compared after rounding to 1e-6


@dataclass(frozen=True)
class Condition:
    """Reward column ``reward`` counts only where column ``gate`` is >= ``threshold``; else it is ``fill``.

    Example: the length reward (column 2) counts only for correct answers (column 0),
    ``Condition(reward=2, gate=0, threshold=1.0)``. Conditions read the raw (ungated)
    rewards, so their order never matters.
    """

    reward: int
    gate: int
    threshold: float = 1.0
    fill: float = 0.0


def conditions_by_column(conditions: Sequence[ConditionConfig], reward_names: Sequence[str]) -> list[Condition]:
    """Configured conditions (rewards by name) as :class:`Condition` objects on the columns of
    a reward tensor ordered as ``reward_names``."""
    column = {name: k for k, name in enumerate(reward_names)}
    return [Condition(column[c.reward], column[c.gate], c.threshold, c.fill) for c in conditions]


class Reduction(Protocol):
    """How statistics are combined across the holders of the rollouts.

    The local implementation is the identity; the distributed one all-reduces over a
    process group. Every method returns a new tensor and leaves its input unchanged.
    """

    def index_groups(self, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Map group ids to dense row indices: returns (index [N], ids of the rows [S])."""

    def sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def max(self, t: torch.Tensor) -> torch.Tensor: ...

    def concat(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of ``t`` from every holder, concatenated (used by one diagnostic only)."""


class LocalReduction:
    """All rollouts are in this process."""

    def index_groups(self, group_ids):
        ids, index = torch.unique(group_ids, sorted=True, return_inverse=True)
        return index, ids

    def sum(self, t):
        return t.clone()

    def max(self, t):
        return t.clone()

    def concat(self, t):
        return t


@dataclass
class OneOutSums:
    """Per-segment sums from which every row's leave-one-out statistics follow, ``[S, C]`` each.

    Removing one row from a segment is a cheap update of the segment's sums except where the
    row is the segment's only maximum or only minimum: there the others' spread can be far
    smaller than the segment's, and a downdate would cancel. For those two rows the squared
    deviations of the others are summed directly, about the others' own mean, which is taken
    from their sum relative to the extreme on their side (never relative to the outlier).
    """

    hi: torch.Tensor  # segment max (0 for an empty segment); also the shift of ``shifted_sum``
    lo: torch.Tensor  # segment min (0 for an empty segment)
    shifted_sum: torch.Tensor  # sum of (value - hi)
    count_hi: torch.Tensor  # rows equal to hi
    count_lo: torch.Tensor  # rows equal to lo
    m2: torch.Tensor  # squared deviations from the segment mean
    m2_without_hi: torch.Tensor  # of the rows != hi, about their mean (used where count_hi == 1)
    m2_without_lo: torch.Tensor  # of the rows != lo, about their mean (used where count_lo == 1)


@dataclass
class SegmentStats:
    """Per-segment statistics of the columns of a ``[N, C]`` tensor."""

    count: torch.Tensor  # [S] valid rows in each segment
    mean: torch.Tensor  # [S, C]
    std: torch.Tensor  # [S, C] unbiased; 0 where count < 2
    zero_spread: torch.Tensor  # [S, C] bool: count < 2 or all values equal
    shift: torch.Tensor  # [S, C] segment max (0 for an empty segment)
    shifted_mean: torch.Tensor  # [S, C] mean - shift, without the rounding of mean at shift's magnitude
    one_out: OneOutSums | None = None  # only when asked for (leave-one-out baselines)

    def deviations(self, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``values - mean`` of each row's segment, as (value - shift) - (mean - shift)."""
        return (values - self.shift[index]) - self.shifted_mean[index]


@dataclass
class AdvantageResult:
    """Advantages plus the statistics behind them (all on the caller's device)."""

    advantages: torch.Tensor  # [N]; 0 for invalid rollouts
    mask: torch.Tensor  # [N] rollouts that entered the statistics
    rewards: torch.Tensor  # [N, K] after conditions (what was normalized)
    group_ids: torch.Tensor  # [S] id of each row of the group statistics
    group_count: torch.Tensor  # [S]
    group_mean: torch.Tensor  # [S, K] per reward
    group_std: torch.Tensor  # [S, K] per reward
    group_zero_spread: torch.Tensor  # [S, K] per reward
    batch_mean: float  # of the summed advantage before batch normalization
    batch_std: float
    num_nonfinite: int  # valid rollouts dropped for NaN/inf rewards (nonfinite="mask")
    zero_spread_fraction: torch.Tensor  # [K] share of non-empty groups with no spread
    variance_share: torch.Tensor  # [K] share of the summed advantage's variance; sums to 1
    distinct_per_group: float  # distinct advantages per non-empty group, averaged
    mean: float  # of the final advantages over all valid rollouts (every holder's)
    abs_mean: float
    kept_group_fraction: float | None = None  # with a group filter: share of non-empty groups it kept

    def metrics(self, reward_names: Sequence[str]) -> dict[str, float]:
        """Flat scalar metrics for logging, per reward under ``reward/<name>/``."""
        if len(reward_names) != self.zero_spread_fraction.numel():
            raise ValueError(
                f"reward_names has {len(reward_names)} names for "
                f"{self.zero_spread_fraction.numel()} rewards"
            )
        out = {
            "advantage/distinct_per_group": self.distinct_per_group,
            "advantage/batch_mean": self.batch_mean,
            "advantage/batch_std": self.batch_std,
            "advantage/nonfinite_rollouts": float(self.num_nonfinite),
            "advantage/mean": self.mean,
            "advantage/abs_mean": self.abs_mean,
        }
        if self.kept_group_fraction is not None:
            out["advantage/kept_group_frac"] = self.kept_group_fraction
        for k, name in enumerate(reward_names):
            out[f"reward/{name}/zero_spread_frac"] = self.zero_spread_fraction[k].item()
            out[f"reward/{name}/advantage_var_share"] = self.variance_share[k].item()
        return out


class GroupNormalizer(Protocol):
    """What a mode normalizes inside each prompt group, and how the parts become an advantage.

    :func:`compute_advantages` takes the group statistics of every column of :meth:`columns`
    in one pass, centers each value on its group's mean (or its leave-one-out baseline) and
    scales it by ``1 / (std + eps)`` (by 1 when not ``divide_by_std`` or when
    ``normalize_rewards`` is off; 0 for a group of one); :meth:`combine` adds the parts up.
    The batch step after it is the mode's ``batch_norm`` unless the config sets one.
    """

    divide_by_std: bool
    batch_norm: bool  # the default of ``AdvantageConfig.batch_norm`` under this mode

    def columns(self, rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[N, C]`` values normalized inside the groups; the first ``K`` are the rewards
        (every mode reports their group statistics)."""

    def combine(self, deviation: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From each column's centered values and scales ``[N, C]``: each reward's weighted part
        ``[N, K]`` and the summed advantage ``[N]``, both 0 where ``mask`` is False."""


@dataclass(frozen=True)
class EachRewardNormalizer:
    """GDPO: every reward normalized inside its group, then summed with the weights."""

    divide_by_std: bool = True
    batch_norm: bool = True

    def columns(self, rewards, weights):
        return rewards

    def combine(self, deviation, scale, weights, mask):
        contributions = torch.where(mask.unsqueeze(1), deviation * weights * scale, 0.0)
        return contributions, contributions.sum(dim=1)


@dataclass(frozen=True)
class SummedRewardNormalizer:
    """GRPO: the weighted sum of the rewards normalized inside its group. It is centered on its
    own column (exact where its baseline is); the per-reward parts, which add up to it, only
    feed the variance-share diagnostic."""

    divide_by_std: bool = True
    batch_norm: bool = False

    def columns(self, rewards, weights):
        return torch.cat([rewards, (rewards @ weights).unsqueeze(1)], dim=1)

    def combine(self, deviation, scale, weights, mask):
        K = weights.numel()
        contributions = torch.where(mask.unsqueeze(1), deviation[:, :K] * weights * scale[:, K:], 0.0)
        return contributions, torch.where(mask, deviation[:, K] * scale[:, K], 0.0)


GROUP_NORMALIZERS: dict[AdvantageMode, GroupNormalizer] = {
    "gdpo": EachRewardNormalizer(),
    "grpo": SummedRewardNormalizer(),
    "grpo_no_std": SummedRewardNormalizer(divide_by_std=False),
}


def informative_groups(result: AdvantageResult) -> torch.Tensor:
    """``[S]`` the non-empty groups in which ANY reward varies. Under GDPO each reward is
    normalized on its own, so a group whose summed reward is flat can still teach."""
    return ~result.group_zero_spread.all(dim=1) & (result.group_count > 0)


# advantage.filter -> the groups it keeps, from the advantages computed over all of them.
GROUP_FILTERS: dict[GroupFilter, Callable[[AdvantageResult], torch.Tensor]] = {
    "informative_groups": informative_groups,
}


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    config: AdvantageConfig = AdvantageConfig(),
    weights: torch.Tensor | Sequence[float] | None = None,
    conditions: Sequence[Condition] = (),
    reduction: Reduction | None = None,
    count_distinct: bool = True,
) -> AdvantageResult:
    """Advantages for ``N`` rollouts with ``K`` rewards each.

    Args:
        rewards: ``[N, K]`` float rewards.
        group_ids: ``[N]`` integer prompt id of each rollout (groups may be interleaved and
            of any size, including 1).
        mask: ``[N]`` bool, rollouts that count; default all.
        config: the mode, the group ``filter`` (a filter computes the advantages twice: over
            all groups, then over the ones it keeps; ``kept_group_fraction`` says how many),
            ``batch_norm``, ``eps``, ``leave_one_out``, ``normalize_rewards`` and
            ``nonfinite`` (``"raise"`` on a NaN/inf reward of a valid rollout, or ``"mask"`` to
            drop such rollouts and count them in ``num_nonfinite``); its named conditions are
            the caller's to turn into ``conditions`` (:func:`conditions_by_column`).
        weights: ``[K]`` reward weights, applied after per-reward normalization; default 1.
        conditions: reward gates on the columns of ``rewards``.
        reduction: how statistics combine across processes; default all rollouts are local.
        count_distinct: compute ``distinct_per_group`` (NaN when off). Across processes it is
            the one statistic whose communication grows with the number of rollouts.
    """
    reduction = reduction or LocalReduction()
    rewards, group_ids, mask, weights = _validate(rewards, group_ids, mask, weights, conditions)
    # float64 inside: rewards like 1e6 + noise must keep their small differences.
    raw = rewards.to(torch.float64)
    w = weights.to(device=raw.device, dtype=torch.float64)

    nonfinite_rows = mask & ~torch.isfinite(raw).all(dim=1)
    num_nonfinite = int(reduction.sum(nonfinite_rows.sum().reshape(1)).item())
    if num_nonfinite and config.nonfinite == "raise":
        _raise_nonfinite(raw, nonfinite_rows)
    index, ids = reduction.index_groups(group_ids)
    group_filter = GROUP_FILTERS.get(config.filter)

    def estimate(valid: torch.Tensor, count_distinct: bool) -> AdvantageResult:
        return _estimate(raw, w, index, ids, valid, config=config, conditions=conditions, reduction=reduction,
                         count_distinct=count_distinct, num_nonfinite=num_nonfinite, out_dtype=rewards.dtype)

    result = estimate(mask & ~nonfinite_rows, count_distinct and group_filter is None)
    if group_filter is None:
        return result
    keep, present = group_filter(result), result.group_count > 0
    kept_fraction = (keep & present).sum().item() / max(present.sum().item(), 1)
    result = estimate(result.mask & keep[index], count_distinct)
    result.kept_group_fraction = kept_fraction
    return result


def _estimate(raw, w, index, ids, mask, *, config: AdvantageConfig, conditions, reduction: Reduction,
              count_distinct: bool, num_nonfinite: int, out_dtype: torch.dtype) -> AdvantageResult:
    """The advantages of the rollouts in ``mask`` (finite rewards) from the float64 rewards."""
    normalizer = GROUP_NORMALIZERS[config.mode]
    raw = torch.where(mask.unsqueeze(1), raw, torch.zeros((), dtype=raw.dtype, device=raw.device))
    r = apply_conditions(raw, conditions)
    K = r.shape[1]
    # One pass over the groups gives the per-reward statistics (every mode logs them) and those
    # of any other column the mode normalizes.
    columns = normalizer.columns(r, w)
    stats = segment_stats(columns, index, ids.numel(), mask, reduction, one_out=config.leave_one_out)
    contributions, summed = _group_advantages(columns, index, mask, w, stats, config, normalizer)

    single = torch.zeros_like(index)
    batch = segment_stats(summed.unsqueeze(1), single, 1, mask, reduction)
    advantages = summed
    batch_norm = normalizer.batch_norm if config.batch_norm is None else config.batch_norm
    if batch_norm:
        advantages = _normalized(
            summed.unsqueeze(1), batch.mean[single], batch.std[single], batch.zero_spread[single], config.eps
        ).squeeze(1)
    advantages = torch.where(mask, advantages, 0.0)
    totals = reduction.sum(torch.stack([advantages.sum(), advantages.abs().sum(), mask.sum().to(advantages.dtype)]))
    valid = max(totals[2].item(), 1.0)

    return AdvantageResult(
        advantages=advantages.to(out_dtype),
        mask=mask,
        rewards=r.to(out_dtype),
        group_ids=ids,
        group_count=stats.count,
        group_mean=stats.mean[:, :K].to(out_dtype),
        group_std=stats.std[:, :K].to(out_dtype),
        group_zero_spread=stats.zero_spread[:, :K],
        batch_mean=batch.mean[0, 0].item(),
        batch_std=batch.std[0, 0].item(),
        num_nonfinite=num_nonfinite,
        zero_spread_fraction=_zero_spread_fraction(stats, K),
        variance_share=_variance_share(contributions, summed, batch.mean[0, 0], mask, reduction),
        distinct_per_group=(
            _distinct_per_group(advantages, index, mask, ids.numel(), reduction) if count_distinct else math.nan
        ),
        mean=totals[0].item() / valid,
        abs_mean=totals[1].item() / valid,
    )


def _group_advantages(columns, index, mask, w, stats: SegmentStats, config: AdvantageConfig,
                      normalizer: GroupNormalizer):
    """Each rollout's summed advantage before the batch step, and each reward's weighted part of it."""
    if config.leave_one_out:
        deviation, spread, flat = leave_one_out_stats(columns, index, stats)
    else:
        deviation, spread, flat = stats.deviations(columns, index), stats.std[index], stats.zero_spread[index]
    # What multiplies each centered value: 1 / (std + eps), or 1 without normalization; where
    # the values the baseline comes from are all equal, 0 for the group mean (the centered
    # value is 0 anyway) and 1 for leave-one-out (NeMo-RL keeps it undivided); 0 when alone.
    divide = normalizer.divide_by_std and config.normalize_rewards
    scale = 1.0 / (spread + config.eps) if divide else torch.ones_like(spread)
    scale = torch.where(flat, float(config.leave_one_out), scale)
    scale = torch.where((stats.count[index] < 2).unsqueeze(1), 0.0, scale)
    return normalizer.combine(deviation, scale, w, mask)


def apply_conditions(rewards: torch.Tensor, conditions: Sequence[Condition]) -> torch.Tensor:
    """Gate rewards by others; every condition reads the raw rewards."""
    if not conditions:
        return rewards
    out = rewards.clone()
    for c in conditions:  # loop over the few configured conditions, never over rollouts
        out[:, c.reward] = torch.where(rewards[:, c.gate] >= c.threshold, rewards[:, c.reward], c.fill)
    return out


def segment_stats(
    values: torch.Tensor,
    index: torch.Tensor,
    num_segments: int,
    mask: torch.Tensor,
    reduction: Reduction,
    one_out: bool = False,
) -> SegmentStats:
    """Count, mean, unbiased std and zero-spread flag of each column inside each segment.

    Three reductions: max/min (the spread flag, and a shift that keeps the sums small),
    then count and sum of shifted values, then squared deviations from the mean. Exact for
    any split of the rows, and robust to a large common offset such as 1e8 + noise: every
    deviation is formed from shifted values, never from a mean rounded at the offset.
    ``one_out`` adds :class:`OneOutSums` to the same three reductions (they get wider, not
    more numerous).
    """
    N, C = values.shape
    dtype, device = values.dtype, values.device
    valid = mask.unsqueeze(1)

    # Spread is decided on the values themselves (max == min), not on a rounded m2.
    signed = torch.cat([torch.where(valid, values, -math.inf), torch.where(valid, -values, -math.inf)], dim=1)
    extremes = torch.full((num_segments, 2 * C), -math.inf, dtype=dtype, device=device)
    extremes.scatter_reduce_(0, index.unsqueeze(1).expand(N, 2 * C), signed, "amax")
    extremes = reduction.max(extremes)
    hi, lo = extremes[:, :C], -extremes[:, C:]
    shift = torch.where(torch.isfinite(hi), hi, 0.0)

    m = mask.to(dtype).unsqueeze(1)
    floor = torch.where(torch.isfinite(lo), lo, 0.0)
    parts = [m, (values - shift[index]) * m]
    if one_out:
        not_hi, not_lo = valid & (values != shift[index]), valid & (values != floor[index])
        parts += [(valid & (values == shift[index])).to(dtype), (valid & (values == floor[index])).to(dtype),
                  torch.where(not_hi, values - floor[index], 0.0), torch.where(not_lo, values - shift[index], 0.0)]
    sums = torch.zeros(num_segments, 1 + len(parts[1:]) * C, dtype=dtype, device=device)
    sums.index_add_(0, index, torch.cat(parts, dim=1))
    sums = reduction.sum(sums)
    count, shifted_sum = sums[:, 0], sums[:, 1 : C + 1]
    shifted_mean = shifted_sum / count.clamp(min=1).unsqueeze(1)

    squares = [((values - shift[index]) - shifted_mean[index]).square() * m]
    if one_out:
        others = (count - 1).clamp(min=1).unsqueeze(1)
        # The rows other than the one maximum, about their mean taken relative to the minimum,
        # and the rows other than the one minimum, relative to the maximum: sums of values
        # near the extreme on their own side, so a far outlier costs no precision.
        above_lo, below_hi = sums[:, 3 * C + 1 : 4 * C + 1], sums[:, 4 * C + 1 :]
        for keep, base, rel_sum in ((not_hi, floor, above_lo), (not_lo, shift, below_hi)):
            deviation = (values - base[index]) - (rel_sum / others)[index]
            squares.append(torch.where(keep, deviation, 0.0).square())
    m2 = torch.zeros(num_segments, len(squares) * C, dtype=dtype, device=device)
    m2.index_add_(0, index, torch.cat(squares, dim=1))
    m2 = reduction.sum(m2)
    zero_spread = (hi <= lo) | (count < 2).unsqueeze(1)
    std = torch.where(zero_spread, 0.0, (m2[:, :C] / (count - 1).clamp(min=1).unsqueeze(1)).sqrt())
    stats = SegmentStats(count=count, mean=shift + shifted_mean, std=std, zero_spread=zero_spread, shift=shift,
                         shifted_mean=shifted_mean)
    if one_out:
        stats.one_out = OneOutSums(
            hi=shift, lo=floor, shifted_sum=shifted_sum, count_hi=sums[:, C + 1 : 2 * C + 1],
            count_lo=sums[:, 2 * C + 1 : 3 * C + 1], m2=m2[:, :C], m2_without_hi=m2[:, C : 2 * C],
            m2_without_lo=m2[:, 2 * C :],
        )
    return stats


def leave_one_out_stats(
    values: torch.Tensor, index: torch.Tensor, stats: SegmentStats
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``[N, C]``: its value minus the mean of the *other* valid rows of its segment,
    their unbiased std, and whether those others are all equal (then the std is 0 and the
    difference is exact).

    Computed from :class:`OneOutSums`, so it is exact for any split of the rows. Whether the
    others are equal is decided on the values (count of the max and of the min), never on a
    rounded sum: with two distinct values, the one holder of a value sees only the other.
    """
    s = stats.one_out
    if s is None:
        raise ValueError("leave_one_out_stats: segment_stats was called without one_out=True")
    n = stats.count[index].unsqueeze(1)
    hi, lo, count_hi, count_lo = s.hi[index], s.lo[index], s.count_hi[index], s.count_lo[index]
    only_hi = (values == hi) & (count_hi == 1)
    only_lo = (values == lo) & (count_lo == 1)
    constant = hi <= lo
    others_equal = constant | (n <= 2) | ((count_hi + count_lo == n) & (only_hi | only_lo))

    others = (n - 1).clamp(min=1)
    from_hi = values - hi  # exact when the value is near hi, e.g. under a large offset
    deviation = from_hi - (s.shifted_sum[index] - from_hi) / others
    deviation = torch.where(others_equal, torch.where(only_hi & ~constant, values - lo, from_hi), deviation)
    # Away from a lone extreme the others keep at least 1 / (2 n) of the segment's squared
    # deviations, so the downdate loses at most a few bits.
    downdate = (s.m2[index] - n / others * stats.deviations(values, index).square()).clamp(min=0)
    m2 = torch.where(only_hi, s.m2_without_hi[index], torch.where(only_lo, s.m2_without_lo[index], downdate))
    std = torch.where(others_equal, 0.0, (m2 / (n - 2).clamp(min=1)).sqrt())
    return deviation, std, others_equal


def _normalized(x, mean, std, zero_spread, eps):
    return torch.where(zero_spread, 0.0, (x - mean) / (std + eps))


def _zero_spread_fraction(stats: SegmentStats, K: int) -> torch.Tensor:
    present = stats.count > 0
    if not present.any():
        return torch.zeros(K, dtype=torch.float64)
    return stats.zero_spread[present, :K].to(torch.float64).mean(dim=0)


def _variance_share(contributions, summed, batch_mean, mask, reduction) -> torch.Tensor:
    """Cov(contribution_k, sum) / Var(sum) over valid rollouts: the shares add up to 1."""
    centered = (summed - batch_mean) * mask
    sums = torch.cat([(contributions * centered.unsqueeze(1)).sum(dim=0), centered.square().sum().reshape(1)])
    sums = reduction.sum(sums)
    var = sums[-1]
    if var <= 0:
        return torch.zeros_like(sums[:-1])
    return sums[:-1] / var


def _distinct_per_group(advantages, index, mask, num_groups, reduction) -> float:
    """Distinct advantage values (rounded to 1e-6) per non-empty group, averaged.

    The one statistic that needs the values themselves: each holder sends its distinct
    (group, value) pairs, at most one per valid rollout.
    """
    scaled = torch.round(advantages[mask] * 10**DISTINCT_DECIMALS).to(torch.int64)
    pairs = _unique_pairs(index[mask], scaled)
    pairs = _unique_pairs(*reduction.concat(torch.stack(pairs, dim=1)).unbind(dim=1))
    if pairs[0].numel() == 0:
        return 0.0
    per_group = torch.bincount(pairs[0], minlength=num_groups)
    return per_group[per_group > 0].to(torch.float64).mean().item()


def _unique_pairs(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (first, second) integer pairs, by two stable sorts (faster than unique(dim=0))."""
    order = torch.argsort(second, stable=True)
    order = order[torch.argsort(first[order], stable=True)]
    a, b = first[order], second[order]
    new = torch.ones_like(a, dtype=torch.bool)
    new[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    return a[new], b[new]


def _raise_nonfinite(rewards: torch.Tensor, rows: torch.Tensor) -> None:
    where = rows.nonzero().flatten()
    if where.numel() == 0:
        raise ValueError(
            "rewards: NaN/inf reward on another rank; pass nonfinite='mask' to drop such rollouts"
        )
    first = where[:5].tolist()
    cols = (~torch.isfinite(rewards[first])).nonzero()[:, 1].unique().tolist()
    raise ValueError(
        f"rewards: {where.numel()} valid rollout(s) have NaN/inf rewards (rows {first}"
        f"{'...' if where.numel() > 5 else ''}, reward columns {cols}); fix the reward "
        "function or pass nonfinite='mask' to drop such rollouts"
    )


def _validate(rewards, group_ids, mask, weights, conditions):
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected shape [N, K], got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    N, K = rewards.shape
    if K == 0:
        raise ValueError("rewards: expected at least one reward column (K >= 1), got K = 0")
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if group_ids.shape != (N,):
        raise ValueError(f"group_ids: expected shape [{N}] (one id per rollout), got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids: expected an integer tensor, got {group_ids.dtype}")
    group_ids = group_ids.to(torch.int64)
    if mask is None:
        mask = torch.ones(N, dtype=torch.bool, device=rewards.device)
    mask = torch.as_tensor(mask, device=rewards.device)
    if mask.shape != (N,) or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a bool tensor of shape [{N}], got {mask.dtype} {tuple(mask.shape)}")
    weights = torch.ones(K) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if weights.shape != (K,):
        raise ValueError(f"weights: expected {K} values (one per reward), got shape {tuple(weights.shape)}")
    if not torch.isfinite(weights).all():
        raise ValueError(f"weights: must be finite, got {weights.tolist()}")
    for c in conditions:
        for name in ("reward", "gate"):
            if not 0 <= getattr(c, name) < K:
                raise ValueError(f"conditions: {name}={getattr(c, name)} is not a reward column in [0, {K})")
        if c.reward == c.gate:
            raise ValueError(f"conditions: reward {c.reward} cannot be gated by itself")
    return rewards, group_ids, mask, weights
