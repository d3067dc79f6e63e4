"""A plain per-group Python implementation of the advantage conventions, for tests only.

Written independently of gdpo_megatron.advantages (lists, loops and the statistics module)
so that agreement between the two means something.
"""
import statistics


def _normalize(values, eps, divide=True):
    if len(values) < 2 or max(values) == min(values):
        return [0.0] * len(values)
    m = statistics.fmean(values)
    s = statistics.stdev(values)
    return [(v - m) / (s + eps) if divide else v - m for v in values]


def _leave_one_out(values, eps, divide=True):
    """Each value against the mean and std of the others; undivided where the others are equal."""
    if len(values) < 2:
        return [0.0] * len(values)
    out = []
    for j, v in enumerate(values):
        others = values[:j] + values[j + 1 :]
        m = statistics.fmean(others)
        if divide and len(others) >= 2 and max(others) != min(others):
            out.append((v - m) / (statistics.stdev(others) + eps))
        else:
            out.append(v - m)
    return out


def reference_advantages(rewards, groups, mask, weights, mode, batch_norm, eps=1e-4, conditions=(),
                         leave_one_out=False, normalize_rewards=True):
    """rewards: list of N lists of K floats; groups: N ids; mask: N bools; weights: K floats.

    conditions: (target, on, threshold) triples; the target reward becomes 0 where the raw
    reward `on` is below the threshold.
    """
    n, k = len(rewards), len(weights)
    r = [list(map(float, row)) for row in rewards]
    for target, on, threshold in conditions:
        for i in range(n):
            if rewards[i][on] < threshold:
                r[i][target] = 0.0
    divide = normalize_rewards and mode != "grpo_no_std"
    center = _leave_one_out if leave_one_out else _normalize
    adv = [0.0] * n
    for g in sorted(set(groups)):
        members = [i for i in range(n) if groups[i] == g and mask[i]]
        if mode == "gdpo":
            for j in range(k):
                z = center([r[i][j] for i in members], eps, divide)
                for i, zi in zip(members, z):
                    adv[i] += weights[j] * zi
        else:
            totals = [sum(weights[j] * r[i][j] for j in range(k)) for i in members]
            for i, zi in zip(members, center(totals, eps, divide)):
                adv[i] = zi
    if batch_norm:
        valid = [i for i in range(n) if mask[i]]
        for i, zi in zip(valid, _normalize([adv[i] for i in valid], eps)):
            adv[i] = zi
    return adv
