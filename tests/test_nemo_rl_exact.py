"""The NeMo-RL estimator and the core leave-one-out statistics against NeMo-RL's GDPO formulas
evaluated exactly (tests/nemo_rl_reference.py), on the inputs where float arithmetic goes
wrong: constant non-dyadic groups, groups of 2 and of 1, two-valued groups, a lone outlier
over a tiny spread, a large common offset, masked and NaN rollouts.

The estimator adds its eps to the batch std (NeMo-RL adds none); the reference is asked for
the same (``batch_eps``), so the two must agree to float32 rounding.
"""
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdpo_megatron.advantages import compute_advantages
from gdpo_megatron.config import AdvantageConfig
from gdpo_megatron.integrations.nemo_rl import GDPOMegatronEstimator
from nemo_rl_reference import NEMO_RL_EPS, nemo_rl_gdpo

OPTIONS = [(True, True), (True, False), (False, True), (False, False)]  # (leave_one_out, normalize_rewards)
NAMES = ["b_format", "a_correct", "c_length"]  # NeMo-RL orders the columns by sorted name


def plugin(groups, columns, weights, leave_one_out, normalize_rewards, sample_mask=None, dtype=torch.float32,
           **config):
    """The estimator called as NeMo-RL's grpo_train calls it: prompt token rows [B, S] (a prompt
    per group key, of different lengths, right-padded), each group's rollouts in a row, padded
    to G = the largest group with rollouts of sample_mask 0, mask = token_mask * sample_mask
    [B, T], one reward/<name> column per reward. Returns the advantages of the given rows."""
    keys = sorted(set(groups), key=str)
    G = max(groups.count(g) for g in keys)
    layout = []  # the given row of each batch row, None for padding
    for g in keys:
        rows = [i for i, h in enumerate(groups) if h == g]
        layout += rows + [None] * (G - len(rows))
    B = len(layout)
    prompts = {g: [7] * (j + 1) for j, g in enumerate(keys)}  # each a prefix of the next, then padding
    S = max(map(len, prompts.values()))
    prompt_ids = torch.zeros(B, S, dtype=torch.int64)
    token_mask = torch.zeros(B, S + 3)
    sample = torch.zeros(B)
    for b, i in enumerate(layout):
        g = keys[b // G]
        prompt_ids[b, : len(prompts[g])] = torch.tensor(prompts[g])
        token_mask[b, len(prompts[g]) : len(prompts[g]) + 1 + b % 3] = 1.0
        sample[b] = 0.0 if i is None else 1.0 if sample_mask is None else float(sample_mask[i])
    names = sorted(NAMES[: len(columns)])
    batch = {f"reward/{n}": torch.tensor([0.0 if i is None else c[i] for i in layout], dtype=dtype)
             for n, c in reversed(list(zip(names, columns)))}
    batch["total_reward"] = sum(batch.values())
    est = GDPOMegatronEstimator({"name": "gdpo", "implementation": "gdpo_megatron", "reward_weights": list(weights),
                                 "use_leave_one_out_baseline": leave_one_out,
                                 "normalize_rewards": normalize_rewards, **config}, group_size=G)
    out = est.compute_advantage(prompt_ids=prompt_ids, rewards=batch["total_reward"],
                                mask=token_mask * sample.unsqueeze(-1), repeated_batch=batch,
                                logprobs_policy=None, logprobs_reference=None)
    assert out.shape == token_mask.shape and bool((out == out[:, :1]).all())
    assert all(out[b].abs().sum() == 0 for b, i in enumerate(layout) if i is None)
    return out[[layout.index(i) for i in range(len(groups))], 0].double()


def assert_close(got, want, tol=2e-6):
    want = torch.tensor(want, dtype=torch.float64)
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= tol * scale, f"\n got  {got.tolist()}\n want {want.tolist()}"


def _noise(seed, n, sigma, offset=0.0):
    rng = random.Random(seed)
    return [offset + rng.gauss(0.0, sigma) for _ in range(n)]


# (groups, reward columns in sorted-name order, float dtype of the columns)
CASES = {
    # constant groups of non-dyadic values: NeMo-RL's float32 std of the 8 x 0.3 group is ~9e-5, not 0
    "constant non-dyadic groups": ([0] * 8 + [1] * 3 + [2] * 4,
                                   [[0.3] * 8 + [0.1] * 3 + [0.0, 1.0, 0.5, 0.25],
                                    [0.7] * 8 + [0.2, 0.9, 0.2] + [0.1] * 4], torch.float32),
    "groups of 2": ([0, 0, 1, 1, 2, 2, 3, 3],
                    [[1.0, 0.0, 0.3, 0.3, 0.1, 0.7, 1.0, 1.0], [0.0, 0.0, 0.2, 0.9, 1.0, 0.0, 0.5, 0.25]],
                    torch.float32),
    "singletons among groups": ([0, 1, 2, 2, 2, 3, 4, 4],
                                [[0.5, 0.2, 1.0, 0.0, 1.0, 0.3, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0, 1.0, 0.2, 1.0, 1.0]],
                                torch.float32),
    "two-valued groups": ([0] * 3 + [1] * 4 + [2] * 5,
                          [[0.1, 0.1, 0.7, 1, 1, 1, 0, 0.3, 0.3, 0.3, 0.3, 0.9],
                           [1, 0, 0, 0.2, 0.2, 0.6, 0.6, 0, 0, 0, 0, 1]], torch.float32),
    "lone outliers over a tiny spread": ([0] * 5 + [1] * 5,
                                         [[0.0, 1e-9, 2e-9, 4e-9, 1e3, -1e3, 7.0, 7.0 + 1e-9, 7.0 + 3e-9, 7.0 + 4e-9],
                                          [0, 0, 1, 1, 0, 0.5, 0.5, 0.5, 0.5, 0.25]], torch.float64),
    "offset 1e6 plus noise": ([0] * 6 + [1] * 6 + [2] * 2,
                              [_noise(1, 14, 1e-3, 1e6), _noise(2, 14, 1e-2, -1e6)], torch.float64),
    "interleaved prompts": ([2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 3],
                            [[1, 0, 0.5, 1, 0, 0.25, 0.25, 0, 1, 1, 0.4],
                             [0.3, 0.3, 0.1, 0.9, 0.3, 0.2, 0.7, 0.3, 0.3, 0.5, 0.4],
                             [0, 1, 1, 1, 0, 0, 1, 0, 0, 1, 1]], torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("leave_one_out, normalize_rewards", OPTIONS)
def test_estimator_is_nemo_rls_gdpo_evaluated_exactly(case, leave_one_out, normalize_rewards):
    groups, columns, dtype = CASES[case]
    weights = [1.0, 0.5, 2.0][: len(columns)]
    columns = [torch.tensor(c, dtype=dtype).tolist() for c in columns]  # the values NeMo-RL's batch holds
    got = plugin(groups, columns, weights, leave_one_out, normalize_rewards, dtype=dtype)
    want = nemo_rl_gdpo(groups, columns, weights, leave_one_out, normalize_rewards, batch_eps=NEMO_RL_EPS)
    assert_close(got, want)


@pytest.mark.parametrize("leave_one_out, normalize_rewards", OPTIONS)
def test_masked_and_nan_rollouts_are_nemo_rls_gdpo_without_them(leave_one_out, normalize_rewards):
    # Group 0 loses one of 3 (its others become one rollout: undivided), group 1 one of 2
    # (alone: 0), group 2 a NaN rollout; group 3 keeps its 4.
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    a = [1.0, 0.0, 0.3, 0.5, 0.1, 0.2, 0.9, 0.4, 0.0, 1.0, 1.0, 0.6]
    b = [0.0, 0.0, 1.0, 1.0, 0.0, float("nan"), 0.3, 0.8, 0.1, 0.1, 0.7, 0.2]
    sample_mask = [1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    got = plugin(groups, [a, b], [1.0, 2.0], leave_one_out, normalize_rewards, sample_mask=sample_mask,
                 nonfinite="mask")
    kept = [i for i in range(12) if sample_mask[i] and not math.isnan(b[i])]
    want_kept = nemo_rl_gdpo([groups[i] for i in kept], [[a[i] for i in kept], [b[i] for i in kept]], [1.0, 2.0],
                             leave_one_out, normalize_rewards, batch_eps=NEMO_RL_EPS)
    want = [0.0] * 12
    for i, v in zip(kept, want_kept):
        want[i] = v
    assert_close(got, want)
    with pytest.raises(ValueError, match="NaN"):
        plugin(groups, [a, b], [1.0, 2.0], leave_one_out, normalize_rewards, sample_mask=sample_mask)


VALUES = st.one_of(
    st.sampled_from([0.0, 1.0, 0.1, 0.3, 0.7, -2.0]),  # ties, constant and two-valued groups
    st.floats(-5, 5, allow_nan=False, width=32),
)


@st.composite
def nemo_rl_batches(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(groups))))
    groups = [groups[i] for i in order]
    k = draw(st.integers(2, 3))
    offset = draw(st.sampled_from([0.0, 0.0, 1e3]))
    columns = [[offset + v for v in draw(st.lists(VALUES, min_size=len(groups), max_size=len(groups)))]
               for _ in range(k)]
    weights = draw(st.lists(st.sampled_from([1.0, 0.5, 2.0, 0.0, -1.0]), min_size=k, max_size=k))
    return groups, columns, weights, draw(st.sampled_from(OPTIONS))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nemo_rl_batches())
def test_estimator_matches_exact_nemo_rl_on_random_batches(batch):
    groups, columns, weights, (leave_one_out, normalize_rewards) = batch
    got = plugin(groups, columns, weights, leave_one_out, normalize_rewards, dtype=torch.float64)
    want = nemo_rl_gdpo(groups, columns, weights, leave_one_out, normalize_rewards, batch_eps=NEMO_RL_EPS)
    assert_close(got, want, tol=1e-5)


def _core(values, groups, leave_one_out, normalize_rewards):
    rewards = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    config = AdvantageConfig(batch_norm=False, eps=0.0, leave_one_out=leave_one_out, normalize_rewards=normalize_rewards)
    return compute_advantages(rewards, torch.tensor(groups), config=config).advantages


def _relative_error(got, want, elementwise):
    """Largest error relative to each value (``elementwise``) or to the largest value."""
    want = torch.tensor(want, dtype=torch.float64)
    nonzero = want != 0
    assert torch.equal(got != 0, nonzero)
    scale = want[nonzero].abs() if elementwise else want.abs().max()
    return ((got - want)[nonzero].abs() / scale).max().item()


@pytest.mark.parametrize("offset", [1e6, 1e8])
@pytest.mark.parametrize("leave_one_out, normalize_rewards", OPTIONS)
def test_a_large_common_offset_keeps_float64_precision(offset, leave_one_out, normalize_rewards):
    # Noise of 1e-3 on a common offset: the centered values must not inherit the rounding of a
    # baseline formed at the offset's magnitude (ulp(1e8) ~ 1.5e-8 would cost ~1e-5 here).
    values = _noise(3, 12, 1e-3, offset)
    groups = [0] * 6 + [1] * 6
    got = _core(values, groups, leave_one_out, normalize_rewards)
    want = nemo_rl_gdpo(groups, [values], [1.0], leave_one_out, normalize_rewards, eps=0.0, batch_norm=False)
    assert _relative_error(got, want, elementwise=False) <= 1e-9


@pytest.mark.parametrize("outlier", [10.0, -10.0])
@pytest.mark.parametrize("spread", [1e-9, 1e-12])
def test_a_lone_outlier_over_a_tiny_spread_keeps_float64_precision(outlier, spread):
    # The outlier's others spread over `spread`, the group over 10: their std must come out as
    # exactly as a direct computation on the others, not off by (ulp(10) / spread)^2.
    values = [0.0, spread, 3 * spread, outlier]
    got = _core(values, [0] * 4, True, True)
    want = nemo_rl_gdpo([0] * 4, [values], [1.0], True, True, eps=0.0, batch_norm=False)
    assert _relative_error(got, want, elementwise=True) <= 1e-9


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("leave_one_out, normalize_rewards", OPTIONS)
def test_grpo_mode_is_nemo_rls_grpo_estimator(case, leave_one_out, normalize_rewards):
    # NeMo-RL's GRPOAdvantageEstimator: the same per-prompt rule on the total reward, no batch step.
    groups, columns, dtype = CASES[case]
    weights = [1.0, 0.5, 2.0][: len(columns)]
    rewards = torch.tensor(columns, dtype=dtype).T.double()
    config = AdvantageConfig(mode="grpo", eps=NEMO_RL_EPS, leave_one_out=leave_one_out,
                             normalize_rewards=normalize_rewards)
    got = compute_advantages(rewards, torch.tensor(groups), weights=weights, config=config).advantages
    total = (rewards @ torch.tensor(weights, dtype=torch.float64)).tolist()
    want = nemo_rl_gdpo(groups, [total], [1.0], leave_one_out, normalize_rewards, batch_norm=False)
    assert_close(got, want, tol=1e-9)
