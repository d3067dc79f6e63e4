"""The all-reduce advantages equal the single-process ones for any split over gloo ranks."""
import pytest
import torch
import torch.distributed as dist

from advantage_reference import reference_advantages
from gdpo_megatron.advantages import Condition, compute_advantages
from gdpo_megatron.config import AdvantageConfig
from gdpo_megatron.distributed.advantages import AllReduce

SETTINGS = ("mode", "filter", "batch_norm", "eps", "nonfinite", "leave_one_out", "normalize_rewards")


def advantages(rewards, groups, mask=None, kwargs=(), reduction=None):
    """compute_advantages with ``kwargs``'s settings as the config and its conditions as (reward, gate, threshold)."""
    kwargs = dict(kwargs)
    config = AdvantageConfig(**{k: kwargs.pop(k) for k in SETTINGS if k in kwargs})
    conditions = [Condition(*c) for c in kwargs.pop("conditions", ())]
    return compute_advantages(rewards, groups, mask, config=config, conditions=conditions, reduction=reduction,
                              **kwargs)


def _on_rank(rewards, groups, mask, owner, kwargs):
    """Each rank takes the rows it owns and returns them with their advantages and global stats."""
    rows = (owner == dist.get_rank()).nonzero().flatten()
    res = advantages(rewards[rows], groups[rows], mask[rows], kwargs, AllReduce())
    return {
        "rows": rows,
        "advantages": res.advantages,
        "zero_spread_fraction": res.zero_spread_fraction,
        "variance_share": res.variance_share,
        "distinct_per_group": res.distinct_per_group,
        "batch": (res.batch_mean, res.batch_std),
        "num_nonfinite": res.num_nonfinite,
        "group_count": res.group_count,
        "moments": (res.mean, res.abs_mean),
        "kept_group_fraction": res.kept_group_fraction,
    }


def _expect_error(rewards, groups, kwargs):
    rows = torch.arange(rewards.shape[0])[dist.get_rank() :: dist.get_world_size()]
    try:
        advantages(rewards[rows], groups[rows], None, kwargs, AllReduce())
    except ValueError as e:
        return str(e)
    return None


def _random_batch(seed, num_prompts, group_size, k, masked_fraction=0.2):
    gen = torch.Generator().manual_seed(seed)
    n = num_prompts * group_size
    groups = torch.arange(num_prompts).repeat_interleave(group_size)
    groups = groups[torch.randperm(n, generator=gen)]  # interleaved rollouts
    discrete = torch.randint(0, 2, (n, k), generator=gen).to(torch.float64)
    continuous = torch.randn(n, k, generator=gen, dtype=torch.float64)
    rewards = torch.where(torch.rand(n, k, generator=gen) < 0.5, discrete, continuous)
    mask = torch.rand(n, generator=gen) >= masked_fraction
    return rewards, groups, mask, gen


def _check_equal(results, rewards, groups, mask, kwargs):
    want = advantages(rewards, groups, mask, kwargs)
    got = torch.zeros_like(want.advantages)
    for r in results:
        got[r["rows"]] = r["advantages"]
    assert torch.allclose(got, want.advantages, atol=1e-9, rtol=1e-9)
    for r in results:
        assert torch.allclose(r["zero_spread_fraction"], want.zero_spread_fraction)
        assert torch.allclose(r["variance_share"], want.variance_share, atol=1e-9)
        assert r["distinct_per_group"] == pytest.approx(want.distinct_per_group)
        assert r["batch"] == pytest.approx((want.batch_mean, want.batch_std), abs=1e-9)
        assert r["num_nonfinite"] == want.num_nonfinite
        assert r["kept_group_fraction"] == want.kept_group_fraction
        valid = want.advantages[want.mask]
        assert r["moments"] == pytest.approx((valid.mean().item(), valid.abs().mean().item()), abs=1e-9)
        # ranks see every prompt id 0..P-1; the local result only the ones present
        assert torch.equal(r["group_count"][want.group_ids], want.group_count)
    return got


@pytest.mark.parametrize("mode", ["gdpo", "grpo", "grpo_no_std"])
def test_two_ranks_random_split_matches_single_process(gloo_world_2, mode):
    rewards, groups, mask, gen = _random_batch(seed=1, num_prompts=6, group_size=5, k=3)
    owner = torch.randint(0, 2, (rewards.shape[0],), generator=gen)  # groups spread over both ranks
    kwargs = dict(mode=mode, weights=[1.0, 0.5, 2.0], batch_norm=True, conditions=[(2, 0, 0.5)])
    results = gloo_world_2.run(_on_rank, rewards, groups, mask, owner, kwargs)
    got = _check_equal(results, rewards, groups, mask, kwargs)
    expected = reference_advantages(rewards.tolist(), groups.tolist(), mask.tolist(), [1.0, 0.5, 2.0], mode, True,
                                    conditions=[(2, 0, 0.5)])
    assert got.tolist() == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("mode, options", [
    ("gdpo", dict(leave_one_out=True)),
    ("gdpo", dict(leave_one_out=True, normalize_rewards=False)),
    ("gdpo", dict(normalize_rewards=False)),
    ("grpo", dict(leave_one_out=True)),
    ("grpo_no_std", dict(leave_one_out=True)),
])
def test_two_ranks_leave_one_out_and_unnormalized_match_single_process(gloo_world_2, mode, options):
    rewards, groups, mask, gen = _random_batch(seed=6, num_prompts=8, group_size=4, k=3)
    groups[:2] = 8  # a group of 2 ...
    groups[2] = 9  # ... and a group of 1
    owner = torch.randint(0, 2, (rewards.shape[0],), generator=gen)
    kwargs = dict(mode=mode, weights=[1.0, 0.5, 2.0], conditions=[(2, 0, 0.5)], **options)
    results = gloo_world_2.run(_on_rank, rewards, groups, mask, owner, kwargs)
    got = _check_equal(results, rewards, groups, mask, kwargs)
    expected = reference_advantages(rewards.tolist(), groups.tolist(), mask.tolist(), [1.0, 0.5, 2.0], mode,
                                    mode == "gdpo", conditions=[(2, 0, 0.5)], **options)
    assert got.tolist() == pytest.approx(expected, abs=1e-9)


def test_leave_one_out_lone_maximum_on_another_rank(gloo_world_2):
    # The outlier of group 0 sits alone on rank 1; its others' tiny spread must survive, and
    # group 1 (1e6 + noise) is split over both ranks.
    gen = torch.Generator().manual_seed(7)
    values = torch.cat([torch.tensor([0.0, 1e-9, 2e-9, 1000.0], dtype=torch.float64),
                        1e6 + 0.01 * torch.randn(6, dtype=torch.float64, generator=gen)]).unsqueeze(1)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    owner = torch.tensor([0, 0, 0, 1, 0, 1, 0, 1, 0, 1])
    mask = torch.ones(10, dtype=torch.bool)
    kwargs = dict(leave_one_out=True, eps=0.0, batch_norm=False)
    results = gloo_world_2.run(_on_rank, values, groups, mask, owner, kwargs)
    got = torch.zeros(10, dtype=torch.float64)
    for r in results:
        got[r["rows"]] = r["advantages"]
    want = reference_advantages(values.tolist(), groups.tolist(), [True] * 10, [1.0], "gdpo", False, eps=0.0,
                                leave_one_out=True)
    assert got.tolist() == pytest.approx(want, rel=1e-7)


def test_four_ranks_with_an_empty_rank_and_a_group_on_every_rank(gloo_world_4):
    rewards, groups, mask, gen = _random_batch(seed=2, num_prompts=5, group_size=8, k=2)
    owner = torch.randint(0, 3, (rewards.shape[0],), generator=gen)  # rank 3 holds nothing
    owner[groups == 0] = torch.arange(int((groups == 0).sum())) % 3  # prompt 0 on ranks 0, 1 and 2
    assert not (owner == 3).any()
    kwargs = dict(mode="gdpo")
    results = gloo_world_4.run(_on_rank, rewards, groups, mask, owner, kwargs)
    assert results[3]["advantages"].numel() == 0
    _check_equal(results, rewards, groups, mask, kwargs)


def test_four_ranks_each_group_on_one_rank_and_single_rollout_groups(gloo_world_4):
    rewards, groups, mask, gen = _random_batch(seed=3, num_prompts=12, group_size=4, k=3, masked_fraction=0.5)
    owner = groups % 4
    kwargs = dict(mode="gdpo", batch_norm=False)
    results = gloo_world_4.run(_on_rank, rewards, groups, mask, owner, kwargs)
    _check_equal(results, rewards, groups, mask, kwargs)


def test_large_offset_across_ranks(gloo_world_2):
    rewards, groups, mask, gen = _random_batch(seed=4, num_prompts=8, group_size=8, k=3, masked_fraction=0.0)
    rewards = 1e6 + 0.01 * rewards
    owner = torch.randint(0, 2, (rewards.shape[0],), generator=gen)
    kwargs = dict(mode="gdpo", eps=0.0)
    results = gloo_world_2.run(_on_rank, rewards, groups, mask, owner, kwargs)
    got = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for r in results:
        got[r["rows"]] = r["advantages"]
    want = torch.tensor(reference_advantages(rewards.tolist(), groups.tolist(), [True] * 64, [1.0] * 3, "gdpo", True,
                                             eps=0.0), dtype=torch.float64)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("mode", ["gdpo", "grpo"])
def test_informative_groups_filter_over_two_ranks_matches_single_process(gloo_world_2, mode):
    rewards, groups, mask, gen = _random_batch(seed=8, num_prompts=8, group_size=4, k=2, masked_fraction=0.0)
    rewards[groups == 1] = 1.0  # no reward varies in prompts 1 and 5, whose rollouts sit on both ranks
    rewards[groups == 5] = torch.tensor([0.0, 3.0], dtype=torch.float64)
    rewards[(groups == 6).nonzero()[0]] = float("nan")  # and the step's NaN rollout is still counted
    owner = torch.arange(32) % 2
    kwargs = dict(mode=mode, filter="informative_groups", nonfinite="mask", conditions=[(1, 0, 0.5)])
    results = gloo_world_2.run(_on_rank, rewards, groups, mask, owner, kwargs)
    got = _check_equal(results, rewards, groups, mask, kwargs)
    kept = mask & (groups != 1) & (groups != 5) & torch.isfinite(rewards).all(dim=1)
    expected = reference_advantages(rewards.tolist(), groups.tolist(), kept.tolist(), [1.0, 1.0], mode,
                                    mode == "gdpo", conditions=[(1, 0, 0.5)])
    assert got.tolist() == pytest.approx(expected, abs=1e-9)
    assert [(r["kept_group_fraction"], r["num_nonfinite"]) for r in results] == [(6 / 8, 1)] * 2


def test_masked_nonfinite_rollouts_are_counted_globally(gloo_world_2):
    rewards, groups, mask, gen = _random_batch(seed=5, num_prompts=4, group_size=4, k=2, masked_fraction=0.0)
    rewards[3, 1] = float("nan")
    rewards[10, 0] = float("inf")
    owner = torch.arange(16) % 2
    kwargs = dict(nonfinite="mask")
    results = gloo_world_2.run(_on_rank, rewards, groups, mask, owner, kwargs)
    assert [r["num_nonfinite"] for r in results] == [2, 2]
    _check_equal(results, rewards, groups, mask, kwargs)


def test_nan_on_one_rank_raises_on_every_rank_without_hanging(gloo_world_2):
    rewards = torch.zeros(4, 2)
    rewards[2, 1] = float("nan")  # row 2 belongs to rank 0
    errors = gloo_world_2.run(_expect_error, rewards, torch.tensor([0, 0, 1, 1]), {})
    assert "valid rollout(s) have NaN/inf rewards" in errors[0]
    assert "NaN/inf reward on another rank" in errors[1]


def test_negative_prompt_ids_are_rejected_on_every_rank(gloo_world_2):
    errors = gloo_world_2.run(_expect_error, torch.zeros(4, 1), torch.tensor([0, -1, 1, 1]), {})
    assert all("expected global prompt ids >= 0" in e for e in errors)


@pytest.mark.parametrize("leave_one_out, normalize_rewards", [(True, True), (True, False), (False, True)])
def test_four_uneven_ranks_match_nemo_rls_formulas_exactly(gloo_world_4, leave_one_out, normalize_rewards):
    # Rank 0 holds one rollout, rank 3 only masked ones. Group 0's lone maximum (over a 1e-9
    # spread) sits alone on rank 0; group 1's maximum is tied across ranks 1 and 2; group 2 is
    # a pair split over two ranks; group 3 one rollout; group 4 1e6 + noise over three ranks;
    # group 5 a constant 0.1 with a masked outlier.
    from nemo_rl_reference import nemo_rl_gdpo

    noise = [1e6 + 1e-3 * v for v in (0.3, -1.2, 0.7, 2.1, -0.4)]
    values = [1e3, 0.0, 1e-9, 3e-9, 0.5, 0.5, 0.1, 0.2, 0.7, 0.9, 0.4, *noise, 0.1, 0.1, 0.1, 5.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 4, 4, 4, 4, 4, 5, 5, 5, 5]
    owner = [0, 1, 2, 1, 1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 2, 2, 1, 1, 2, 3]
    mask = [True] * 19 + [False]
    owner, mask = torch.tensor(owner), torch.tensor(mask)
    rewards = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    kwargs = dict(leave_one_out=leave_one_out, normalize_rewards=normalize_rewards, eps=1e-6)
    results = gloo_world_4.run(_on_rank, rewards, torch.tensor(groups), mask, owner, kwargs)
    got = torch.zeros(20, dtype=torch.float64)
    for r in results:
        got[r["rows"]] = r["advantages"]
    want = nemo_rl_gdpo(groups[:19], [values[:19]], [1.0], leave_one_out, normalize_rewards, batch_eps=1e-6) + [0.0]
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-12)
