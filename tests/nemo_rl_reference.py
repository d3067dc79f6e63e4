"""NeMo-RL's GDPO advantages evaluated in exact arithmetic, for tests only.

Transcribed from NeMo-RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (not this
project's code): ``calculate_baseline_and_std_per_prompt`` in ``nemo_rl/algorithms/utils.py``
and ``GDPOAdvantageEstimator.compute_advantage`` in
``nemo_rl/algorithms/advantage_estimator.py``. NeMo-RL evaluates them in float32; here every
sum is a ``Fraction``, so the result is what NeMo-RL's formulas mean, free of its rounding
(its one-pass ``E[x^2] - E[x]^2`` can leave a positive std for a constant group).

Per prompt with ``n`` rollouts (NeMo-RL's GDPO passes an all-ones valid mask):

* ``n <= 1``: baseline = the reward itself, std = 0;
* else ``num_valid = n - leave_one_out``; baseline = sum over the pool / num_valid, where the
  pool is the other rollouts (leave-one-out) or all of them; std =
  ``sqrt((mean of squares - baseline^2) * num_valid / (num_valid - 1))``, NaN (``0 * inf``
  when ``num_valid == 1``) and negative variances read as 0;
* ``adv_k = r_k - baseline``, divided by ``std + 1e-6`` only where ``std > 0`` and
  ``normalize_rewards``; ``A = sum_k w_k adv_k``; then ``(A - mean) / std`` over the batch
  (unbiased std, no eps), or ``A - mean`` where that std is 0.
"""
from fractions import Fraction
import math

NEMO_RL_EPS = 1e-6


def baseline_and_variance(groups, values, leave_one_out):
    """Per rollout: NeMo-RL's baseline (exact) and the variance whose sqrt is its std (exact)."""
    n = len(values)
    baseline, variance = [None] * n, [Fraction(0)] * n
    for g in set(groups):
        members = [i for i in range(n) if groups[i] == g]
        if len(members) <= 1:
            for i in members:
                baseline[i] = Fraction(values[i])
            continue
        num_valid = len(members) - int(leave_one_out)
        for i in members:
            pool = [Fraction(values[j]) for j in members if not (leave_one_out and j == i)]
            mean = sum(pool) / num_valid
            baseline[i] = mean
            if num_valid > 1:  # num_valid == 1: 0 * inf = NaN, which NeMo-RL maps to 0
                var = (sum(p * p for p in pool) / num_valid - mean * mean) * Fraction(num_valid, num_valid - 1)
                variance[i] = max(var, Fraction(0))
    return baseline, variance


def nemo_rl_gdpo(groups, columns, weights, leave_one_out=True, normalize_rewards=True, eps=NEMO_RL_EPS,
                 batch_eps=0.0, batch_norm=True):
    """GDPO advantages of rollouts ``0..B-1``: ``groups`` B hashable prompt keys, ``columns`` K
    lists of B rewards (in NeMo-RL's sorted name order), ``weights`` K floats.

    ``batch_eps`` is added to the batch std (NeMo-RL adds none; this project's estimator adds
    its ``eps``); ``batch_norm=False`` returns the weighted sum before the batch step.
    """
    B = len(groups)
    summed = [0.0] * B
    for w, values in zip(weights, columns):
        baseline, variance = baseline_and_variance(groups, values, leave_one_out)
        for i in range(B):
            d = Fraction(values[i]) - baseline[i]
            if normalize_rewards and variance[i] > 0:
                summed[i] += w * (float(d) / (math.sqrt(variance[i]) + eps))
            else:
                summed[i] += w * float(d)
    if not batch_norm:
        return summed
    exact = [Fraction(s) for s in summed]
    mean = sum(exact) / B
    centered = [float(s - mean) for s in exact]
    if B < 2:  # torch's std of one value is NaN, which fails "> 0"
        return centered
    std = math.sqrt(sum((s - mean) ** 2 for s in exact) / (B - 1))
    return [c / (std + batch_eps) for c in centered] if std > 0 else centered
