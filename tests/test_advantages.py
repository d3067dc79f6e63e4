"""The advantage math against the paper's worked example and a plain per-group loop."""
import math
import statistics

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advantage_reference import reference_advantages
from gdpo_megatron.advantages import GROUP_FILTERS, GROUP_NORMALIZERS, Condition, compute_advantages
from gdpo_megatron.config import AdvantageConfig, ConfigError, from_dict
from gdpo_megatron.config.advantage import FILTERS, MODES

WORKED_REWARDS = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
WORKED_GROUPS = torch.tensor([0, 0, 1, 1])


def _adv(mode, **settings):
    settings.setdefault("batch_norm", False)
    config = AdvantageConfig(mode=mode, **settings)
    return compute_advantages(WORKED_REWARDS, WORKED_GROUPS, config=config).advantages.tolist()


def test_worked_example_grpo_collapses_distinct_reward_combinations():
    # Totals (0, 1) and (0, 2): GRPO gives both groups the same advantages.
    s = 1 / math.sqrt(2)  # (1 - 0.5) / stdev([0, 1]) with stdev = sqrt(0.5)
    assert _adv("grpo", eps=0.0) == pytest.approx([-s, s, -s, s], abs=1e-12)
    assert _adv("grpo") == pytest.approx([-0.7071, 0.7071, -0.7071, 0.7071], abs=1e-4)


def test_worked_example_gdpo_keeps_them_apart():
    z = 0.5 / (math.sqrt(0.5) + 1e-4)  # one reward's z-score in a {0, 1} group, eps included
    assert _adv("gdpo") == pytest.approx([-z, z, -2 * z, 2 * z], abs=1e-12)
    assert _adv("gdpo") == pytest.approx([-0.7071, 0.7071, -1.4142, 1.4142], abs=3e-4)
    s = 1 / math.sqrt(2)
    assert _adv("gdpo", eps=0.0) == pytest.approx([-s, s, -2 * s, 2 * s], abs=1e-12)


def test_worked_example_grpo_without_std():
    assert _adv("grpo_no_std") == pytest.approx([-0.5, 0.5, -1.0, 1.0], abs=1e-12)


def test_worked_example_gdpo_batch_normalized():
    raw = [-0.5, 0.5, -1.0, 1.0]  # GDPO sums with eps=0, scaled by 1/sqrt(2) below
    res = compute_advantages(WORKED_REWARDS, WORKED_GROUPS, config=AdvantageConfig(eps=0.0))  # batch_norm defaults on for gdpo
    sd = statistics.stdev(raw)
    assert res.advantages.tolist() == pytest.approx([v / sd for v in raw], abs=1e-12)
    assert res.batch_mean == pytest.approx(0.0, abs=1e-12)
    assert res.batch_std == pytest.approx(statistics.stdev([v * math.sqrt(2) for v in raw]), abs=1e-12)


def test_per_reward_z_scores_can_cancel_under_gdpo():
    res = compute_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([7, 7]), config=AdvantageConfig(batch_norm=False))
    assert res.advantages.tolist() == [0.0, 0.0]
    # ... and with unequal weights they no longer cancel
    res = compute_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([7, 7]), weights=[2.0, 1.0], config=AdvantageConfig(batch_norm=False, eps=0.0))
    s = 1 / math.sqrt(2)
    assert res.advantages.tolist() == pytest.approx([2 * s - s, -2 * s + s], abs=1e-6)


def test_a_reward_constant_in_every_group_leaves_gdpo_a_rescaled_grpo():
    # ToolRL's correctness on a model that never gets a call right is -3 (or 0 for a text
    # answer) for the whole group: it normalizes to 0 under GDPO and shifts the group's sum
    # under GRPO, so GDPO's advantages are GRPO's divided by their batch std, nothing more.
    gen = torch.Generator().manual_seed(0)
    groups = torch.arange(6).repeat_interleave(8)
    fmt = torch.randint(0, 2, (48,), generator=gen).to(torch.float64)
    correctness = torch.tensor([-3.0, 0.0, -3.0, -3.0, 0.0, -3.0], dtype=torch.float64)[groups]
    rewards = torch.stack([fmt, correctness], dim=1)
    grpo = compute_advantages(rewards, groups, config=AdvantageConfig(mode="grpo")).advantages
    gdpo = compute_advantages(rewards, groups, config=AdvantageConfig(mode="gdpo")).advantages
    assert grpo.abs().sum() > 0
    assert gdpo.tolist() == pytest.approx((grpo / (statistics.stdev(grpo.tolist()) + 1e-4)).tolist(), abs=1e-9)
    # Once correctness varies inside a group, GDPO is no longer a rescaled GRPO.
    rewards[0, 1] = 3.0
    grpo = compute_advantages(rewards, groups, config=AdvantageConfig(mode="grpo")).advantages
    gdpo = compute_advantages(rewards, groups, config=AdvantageConfig(mode="gdpo")).advantages
    scale = float(gdpo @ grpo / (grpo @ grpo))
    assert (gdpo - scale * grpo).abs().max() > 0.1


def test_conditioned_reward_counts_only_where_condition_holds():
    # columns: correct, short. "short" counts only for correct answers.
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    res = compute_advantages(rewards, torch.zeros(4, dtype=torch.long), conditions=[Condition(1, 0, 1.0)], config=AdvantageConfig(batch_norm=False))
    assert res.rewards[:, 1].tolist() == [1.0, 0.0, 0.0, 0.0]
    expected = reference_advantages(rewards.tolist(), [0] * 4, [True] * 4, [1.0, 1.0], "gdpo", False,
                                    conditions=[(1, 0, 1.0)])
    assert res.advantages.tolist() == pytest.approx(expected, abs=1e-12)


def test_invalid_rollouts_get_zero_and_do_not_enter_statistics():
    rewards = torch.tensor([[1.0], [0.0], [100.0], [3.0]], dtype=torch.float64)
    mask = torch.tensor([True, True, False, True])
    res = compute_advantages(rewards, torch.zeros(4, dtype=torch.long), mask=mask, config=AdvantageConfig(batch_norm=False))
    assert res.advantages[2] == 0
    expected = reference_advantages(rewards.tolist(), [0] * 4, mask.tolist(), [1.0], "gdpo", False)
    assert res.advantages.tolist() == pytest.approx(expected, abs=1e-12)
    assert res.group_count.tolist() == [3.0]
    assert res.group_mean[0, 0].item() == pytest.approx(4 / 3)


def test_all_groups_zero_spread_give_zero_advantages_and_full_zero_spread_fraction():
    rewards = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 5.0], [0.0, 5.0]])
    for mode in ("gdpo", "grpo", "grpo_no_std"):
        res = compute_advantages(rewards, torch.tensor([0, 0, 1, 1]), config=AdvantageConfig(mode=mode, batch_norm=True))
        assert res.advantages.tolist() == [0.0] * 4
        assert res.zero_spread_fraction.tolist() == [1.0, 1.0]
        assert res.variance_share.tolist() == [0.0, 0.0]
        assert res.distinct_per_group == 1.0


def test_single_rollout_and_single_reward():
    res = compute_advantages(torch.tensor([[3.5]]), torch.tensor([0]))
    assert res.advantages.tolist() == [0.0]
    res = compute_advantages(torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([0, 0, 0]), config=AdvantageConfig(batch_norm=False))
    assert res.advantages.tolist() == pytest.approx(reference_advantages([[1], [2], [4]], [0] * 3, [True] * 3, [1.0],
                                                                         "gdpo", False), abs=1e-6)


def test_groups_of_different_sizes_interleaved_with_arbitrary_ids():
    rewards = torch.tensor([[1.0, 0.0], [5.0, 1.0], [0.0, 1.0], [2.0, 2.0], [7.0, 0.0], [3.0, 3.0]], dtype=torch.float64)
    groups = torch.tensor([42, -3, 42, 42, 1000, -3])
    for mode in ("gdpo", "grpo", "grpo_no_std"):
        res = compute_advantages(rewards, groups, config=AdvantageConfig(mode=mode, batch_norm=True))
        expected = reference_advantages(rewards.tolist(), groups.tolist(), [True] * 6, [1.0, 1.0], mode, True)
        assert res.advantages.tolist() == pytest.approx(expected, abs=1e-9), mode
    assert res.group_ids.tolist() == [-3, 42, 1000]
    assert res.group_count.tolist() == [2.0, 3.0, 1.0]


def test_diagnostics_against_direct_computation():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    res = compute_advantages(rewards, groups, weights=[1.0, 0.5], config=AdvantageConfig(batch_norm=False, eps=0.0))
    # reward 0 has no spread in group 2; reward 1 has spread everywhere
    assert res.zero_spread_fraction.tolist() == pytest.approx([1 / 3, 0.0])
    # group 0: z = (+s, -s) for reward 0 and (-s, +s) for reward 1 -> sums (s/2, -s/2)
    s = 1 / math.sqrt(2)
    parts = [[s, -0.5 * s], [-s, 0.5 * s], [s, 0.5 * s], [-s, -0.5 * s], [0.0, -0.5 * s], [0.0, 0.5 * s]]
    total = [a + b for a, b in parts]
    assert res.advantages.tolist() == pytest.approx(total, abs=1e-12)
    mean = statistics.fmean(total)
    var = sum((t - mean) ** 2 for t in total)
    shares = [sum(p[k] * (t - mean) for p, t in zip(parts, total)) / var for k in range(2)]
    assert res.variance_share.tolist() == pytest.approx(shares, abs=1e-12)
    assert sum(shares) == pytest.approx(1.0)
    # distinct values: group 0 {+s/2, -s/2}, group 1 {1.5 s, -1.5 s}, group 2 {-s/2, s/2}
    assert res.distinct_per_group == 2.0
    metrics = res.metrics(["correct", "short"])
    assert metrics["reward/correct/zero_spread_frac"] == pytest.approx(1 / 3)
    assert metrics["reward/short/advantage_var_share"] == pytest.approx(shares[1])


def test_grpo_distinct_values_show_the_collapse():
    grpo = compute_advantages(WORKED_REWARDS, WORKED_GROUPS, config=AdvantageConfig(mode="grpo", eps=0.0))
    gdpo = compute_advantages(WORKED_REWARDS, WORKED_GROUPS, config=AdvantageConfig(mode="gdpo", eps=0.0))
    # both have 2 distinct values per group, but GRPO's are the same across groups
    assert len({round(v, 6) for v in grpo.advantages.tolist()}) == 2
    assert len({round(v, 6) for v in gdpo.advantages.tolist()}) == 4


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_large_offset_keeps_relative_precision(leave_one_out):
    gen = torch.Generator().manual_seed(0)
    rewards = 1e6 + 0.01 * torch.randn(64, 3, generator=gen, dtype=torch.float64)
    groups = torch.arange(64) % 8
    for mode in ("gdpo", "grpo", "grpo_no_std"):
        got = compute_advantages(rewards, groups, config=AdvantageConfig(mode=mode, batch_norm=True, eps=0.0, leave_one_out=leave_one_out)).advantages
        want = torch.tensor(reference_advantages(rewards.tolist(), groups.tolist(), [True] * 64, [1.0] * 3, mode,
                                                 True, eps=0.0, leave_one_out=leave_one_out), dtype=torch.float64)
        # 1e-6 relative to the advantage scale (elementwise relative error is meaningless near 0)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), mode


def _loo(rewards, groups, mask=None, **settings):
    settings.setdefault("batch_norm", False)
    rewards = torch.tensor(rewards, dtype=torch.float64)
    return compute_advantages(rewards.reshape(len(rewards), -1), torch.tensor(groups), mask,
                              config=AdvantageConfig(leave_one_out=True, **settings)).advantages.tolist()


def test_leave_one_out_by_hand():
    e = 1e-4
    # [0, 1, 3]: others of 0 are [1, 3] (mean 2, std sqrt 2); of 1 [0, 3] (1.5, 3/sqrt 2); of 3 [0, 1] (0.5, 1/sqrt 2)
    want = [(0 - 2) / (math.sqrt(2) + e), (1 - 1.5) / (3 / math.sqrt(2) + e), (3 - 0.5) / (1 / math.sqrt(2) + e)]
    assert _loo([0, 1, 3], [0, 0, 0]) == pytest.approx(want, abs=1e-12)
    assert _loo([0, 1, 3], [0, 0, 0], normalize_rewards=False) == pytest.approx([-2.0, -0.5, 2.5], abs=1e-12)
    # [1, 0, 0]: the others of the 1 are equal, so it keeps 1 - 0 undivided; each 0 sees [1, 0]
    z = -0.5 / (1 / math.sqrt(2) + e)
    assert _loo([1, 0, 0], [0, 0, 0]) == pytest.approx([1.0, z, z], abs=1e-12)


def test_leave_one_out_groups_of_two_and_one():
    # A group of 2 sees one other rollout: no spread, so the difference, undivided (NeMo-RL's
    # rule); a rollout alone in its group gets 0; masked rollouts leave their group.
    got = _loo([3.0, 1.0, 5.0, 2.0, 2.0, 7.0, 9.0], [0, 0, 1, 2, 2, 3, 3],
               mask=torch.tensor([True, True, True, True, True, True, False]))
    assert got == [2.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # GDPO over two rewards, then batch normalization over the five valid rollouts
    res = compute_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0], [4.0, 1.0], [0.5, 1.0], [0.5, -2.0]]),
                             torch.tensor([0, 0, 1, 2, 2]), config=AdvantageConfig(leave_one_out=True, eps=0.0))
    # group 0: reward 0 gives 1 - 0 and 0 - 1; group 2: reward 1 gives 1 - (-2) and -2 - 1
    summed = [1.0, -1.0, 0.0, 3.0, -3.0]
    m, sd = statistics.fmean(summed), statistics.stdev(summed)
    assert res.advantages.tolist() == pytest.approx([(v - m) / sd for v in summed], abs=1e-6)


def test_leave_one_out_constant_and_two_valued_groups_are_exact():
    # Non-dyadic constants: every rollout's others are equal, the baseline is exactly 0.1.
    assert _loo([0.1, 0.1, 0.1], [0, 0, 0]) == [0.0, 0.0, 0.0]
    # Two values: the lone 0.3 sees [0.1, 0.1] exactly; each 0.1 sees [0.3, 0.1].
    z = (0.1 - 0.2) / (statistics.stdev([0.3, 0.1]) + 1e-4)
    assert _loo([0.3, 0.1, 0.1], [0, 0, 0]) == pytest.approx([0.3 - 0.1, z, z], rel=1e-12)
    assert _loo([0.3, 0.1, 0.1], [0, 0, 0])[0] == 0.3 - 0.1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_leave_one_out_lone_extreme_keeps_the_others_spread(sign):
    # The others of the outlier spread over 1e-9 while the group spreads over 1e3: removing
    # the outlier from the group's sums would cancel; the others' own deviations do not.
    values = [sign * v for v in (0.0, 1e-9, 2e-9, 1000.0)]
    got = _loo(values, [0] * 4, eps=0.0)
    want = reference_advantages([[v] for v in values], [0] * 4, [True] * 4, [1.0], "gdpo", False, eps=0.0,
                                leave_one_out=True)
    assert got == pytest.approx(want, rel=1e-9)
    assert abs(got[3]) == pytest.approx(1e12, rel=1e-6)  # (1000 - 1e-9) / 1e-9


def test_leave_one_out_in_the_grpo_modes():
    # Worked example totals (0, 1) and (0, 2): with one other rollout each, the differences.
    for mode in ("grpo", "grpo_no_std"):
        assert _adv(mode, leave_one_out=True) == [-1.0, 1.0, -2.0, 2.0]
    # A group whose total is constant while its rewards are not: the total's baseline is exact
    # (summing the per-reward leave-one-out baselines would leave about 3e-17, which batch
    # normalization would blow up to +-1).
    rewards = torch.tensor([[0.1, 0.2], [0.2, 0.1], [0.2, 0.1]], dtype=torch.float64)
    res = compute_advantages(rewards, torch.zeros(3, dtype=torch.long), config=AdvantageConfig(mode="grpo", leave_one_out=True, batch_norm=True))
    assert res.advantages.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("settings, message", [
    ({"leave_one_out": 1}, "advantage.leave_one_out: expected true or false, got 1"),
    ({"normalize_rewards": "no"}, "advantage.normalize_rewards: expected true or false, got 'no'"),
    ({"mode": "ppo"}, "advantage.mode: expected one of"),
    ({"eps": -1.0}, "advantage.eps: expected a finite value >= 0"),
    ({"nonfinite": "ignore"}, "advantage.nonfinite: expected one of"),
    ({"filter": "dynamic"}, "advantage.filter: expected one of"),
    ({"conditions": [{"reward": "a", "gate": "a"}]}, "advantage.conditions.0.gate: expected another reward than 'a'"),
])
def test_settings_are_checked_when_the_config_loads(settings, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(AdvantageConfig, settings, "advantage")


@pytest.mark.parametrize("settings, message", [
    ({"mode": "ppo"}, r"^mode: expected one of \('gdpo', 'grpo', 'grpo_no_std'\), got 'ppo'$"),
    ({"filter": "dynamic"}, r"^filter: expected one of \('none', 'informative_groups'\), got 'dynamic'$"),
])
def test_the_python_api_names_the_allowed_modes_and_filters(settings, message):
    with pytest.raises(ConfigError, match=message):
        AdvantageConfig(**settings)


def test_nonfinite_rewards_raise_by_default_naming_rows():
    rewards = torch.tensor([[1.0, 0.0], [float("nan"), 1.0], [0.0, float("inf")]])
    with pytest.raises(ValueError, match=r"2 valid rollout\(s\) have NaN/inf rewards \(rows \[1, 2\]"):
        compute_advantages(rewards, torch.tensor([0, 0, 0]))


def test_nonfinite_rewards_can_be_masked_and_counted():
    rewards = torch.tensor([[1.0], [float("nan")], [0.0], [2.0]], dtype=torch.float64)
    mask = torch.tensor([True, True, True, True])
    res = compute_advantages(rewards, torch.zeros(4, dtype=torch.long), mask=mask, config=AdvantageConfig(nonfinite="mask", batch_norm=False))
    assert res.num_nonfinite == 1
    assert res.mask.tolist() == [True, False, True, True]
    expected = reference_advantages([[1.0], [0.0], [0.0], [2.0]], [0] * 4, [True, False, True, True], [1.0],
                                    "gdpo", False)
    assert res.advantages.tolist() == pytest.approx(expected, abs=1e-12)
    # NaN on an already-invalid rollout is not an error
    res = compute_advantages(rewards, torch.zeros(4, dtype=torch.long), mask=torch.tensor([True, False, True, True]))
    assert res.num_nonfinite == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rewards=torch.zeros(3)), r"rewards: expected shape \[N, K\]"),
        (dict(rewards=torch.zeros(3, 0)), r"K >= 1"),
        (dict(group_ids=torch.zeros(2, dtype=torch.long)), r"group_ids: expected shape \[3\]"),
        (dict(group_ids=torch.zeros(3)), r"group_ids: expected an integer tensor"),
        (dict(mask=torch.ones(3)), r"mask: expected a bool tensor of shape \[3\]"),
        (dict(weights=[1.0]), r"weights: expected 2 values"),
        (dict(weights=[1.0, float("nan")]), r"weights: must be finite"),
        (dict(conditions=[Condition(0, 2, 1.0)]), r"conditions: gate=2 is not a reward column in \[0, 2\)"),
        (dict(conditions=[Condition(1, 1, 1.0)]), r"cannot be gated by itself"),
    ],
)
def test_bad_input_names_the_field(kwargs, message):
    args = dict(rewards=torch.zeros(3, 2), group_ids=torch.zeros(3, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        compute_advantages(**args)


def test_metrics_checks_reward_names():
    res = compute_advantages(WORKED_REWARDS, WORKED_GROUPS)
    with pytest.raises(ValueError, match="reward_names has 1 names for 2 rewards"):
        res.metrics(["only_one"])


@st.composite
def batches(draw):
    k = draw(st.integers(1, 4))
    n = draw(st.integers(1, 30))
    num_groups = draw(st.integers(1, max(1, n)))
    groups = draw(st.lists(st.integers(0, num_groups - 1), min_size=n, max_size=n))
    # discrete rewards make ties and zero-spread groups common; continuous ones cover the rest
    value = st.one_of(st.sampled_from([0.0, 1.0, -3.0, 3.0]), st.floats(-10, 10, allow_nan=False))
    rewards = draw(st.lists(st.lists(value, min_size=k, max_size=k), min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    weights = draw(st.lists(st.floats(0.0, 3.0), min_size=k, max_size=k))
    conditions = []
    if k >= 2 and draw(st.booleans()):
        conditions = [Condition(draw(st.integers(1, k - 1)), 0, draw(st.sampled_from([0.5, 1.0])))]
    mode = draw(st.sampled_from(["gdpo", "grpo", "grpo_no_std"]))
    batch_norm = draw(st.booleans())
    options = dict(leave_one_out=draw(st.booleans()), normalize_rewards=draw(st.booleans()))
    return rewards, groups, mask, weights, conditions, mode, batch_norm, options


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_matches_per_group_loop(batch):
    rewards, groups, mask, weights, conditions, mode, batch_norm, options = batch
    res = compute_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(groups),
        mask=torch.tensor(mask),
        weights=weights,
        conditions=conditions,
        config=AdvantageConfig(mode=mode, batch_norm=batch_norm, **options),
    )
    expected = reference_advantages(rewards, groups, mask, weights, mode, batch_norm,
                                    conditions=[(c.reward, c.gate, c.threshold) for c in conditions], **options)
    assert res.advantages.tolist() == pytest.approx(expected, rel=1e-7, abs=1e-7)
    assert res.variance_share.sum().item() == pytest.approx(1.0 if res.variance_share.any() else 0.0, abs=1e-6)


def test_every_mode_and_filter_name_is_registered():
    assert set(GROUP_NORMALIZERS) == set(MODES)
    assert set(GROUP_FILTERS) == set(FILTERS) - {"none"}


def _informative_reference(rewards, groups, mask, conditions):
    """Valid rollouts of the groups in which some conditioned reward takes two values, and the
    share of non-empty groups that are such."""
    conditioned = [list(row) for row in rewards]
    for target, on, threshold in conditions:
        for row, raw in zip(conditioned, rewards):
            row[target] = raw[target] if raw[on] >= threshold else 0.0
    members = {}
    for row, g, m in zip(conditioned, groups, mask):
        if m:
            members.setdefault(g, []).append(row)
    varies = {g: any(len({row[j] for row in rows}) > 1 for j in range(len(rows[0]))) for g, rows in members.items()}
    kept = [m and varies[g] for g, m in zip(groups, mask)]
    return kept, (sum(varies.values()) / len(varies) if varies else 0.0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_informative_groups_filter_recomputes_without_the_flat_groups(batch):
    rewards, groups, mask, weights, conditions, mode, batch_norm, options = batch
    triples = [(c.reward, c.gate, c.threshold) for c in conditions]
    res = compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups),
                             mask=torch.tensor(mask), weights=weights, conditions=conditions,
                             config=AdvantageConfig(mode=mode, batch_norm=batch_norm, filter="informative_groups",
                                                    **options))
    kept, kept_fraction = _informative_reference(rewards, groups, mask, triples)
    expected = reference_advantages(rewards, groups, kept, weights, mode, batch_norm, conditions=triples, **options)
    assert res.mask.tolist() == kept
    assert res.advantages.tolist() == pytest.approx(expected, rel=1e-7, abs=1e-7)
    assert res.kept_group_fraction == pytest.approx(kept_fraction, abs=1e-12)
    assert res.metrics([f"r{j}" for j in range(len(weights))])["advantage/kept_group_frac"] == res.kept_group_fraction


def test_a_gdpo_group_with_a_flat_sum_is_kept_and_a_flat_group_dropped():
    # Group 0: weighted sum 2 for both rollouts, but each reward varies; group 1: no reward varies.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    config = AdvantageConfig(filter="informative_groups", batch_norm=False, eps=0.0)
    res = compute_advantages(rewards, groups, weights=[2.0, 1.0], config=config)
    assert res.mask.tolist() == [True, True, False, False]
    s = 1 / math.sqrt(2)  # each reward's z-score in a two-valued group of 2
    assert res.advantages.tolist() == pytest.approx([2 * s - s, -2 * s + s, 0.0, 0.0], abs=1e-12)
    assert res.kept_group_fraction == 0.5
    assert "advantage/kept_group_frac" not in compute_advantages(rewards, groups).metrics(["a", "b"])
