"""The NeMo-RL estimator on inputs built the way NeMo-RL's GRPO loop builds them.

Read from NeMo-RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (not installable here):
``grpo_train`` repeats each prompt ``G`` times in a row (``repeat_interleave``), flattens the prompt
messages into right-padded token ids ``[B, S]``, builds ``mask = token_mask *
sample_mask[:, None]`` over the full sequence ``[B, T]`` (prompt tokens 0, response tokens
1), and passes the batch dict with one ``reward/<name>`` tensor per reward. The expected
advantages come from NeMo-RL's GDPO formulas written out here in plain Python
(``calculate_baseline_and_std_per_prompt``: baseline and unbiased std of the other rollouts,
or of all; divide where that std is > 0; then the batch step).
"""
import math
import statistics
import types
from collections import defaultdict

import pydantic
import pytest
import torch

from gdpo_megatron.integrations.nemo_rl import GDPOMegatronEstimator, install, last_built_estimator, prompt_groups

PAD = 0
NEMO_RL_EPS = 1e-6


def nemo_rl_inputs(prompts, group_size, rewards, response_lengths, sample_mask=None, order=None):
    """(prompt_ids [B, S], mask [B, T], repeated_batch) as NeMo-RL hands them over."""
    rows = [p for p in prompts for _ in range(group_size)]  # repeat_interleave
    B = len(rows)
    order = list(range(B)) if order is None else order
    rows = [rows[i] for i in order]
    rewards = {k: [v[i] for i in order] for k, v in rewards.items()}
    lengths = [response_lengths[i] for i in order]
    S = max(map(len, rows))
    prompt_ids = torch.full((B, S), PAD, dtype=torch.int64)
    T = S + max(lengths)
    token_mask = torch.zeros(B, T)
    for b, (p, n) in enumerate(zip(rows, lengths)):
        prompt_ids[b, : len(p)] = torch.tensor(p)
        token_mask[b, len(p) : len(p) + n] = 1.0
    sample = torch.ones(B) if sample_mask is None else torch.tensor([float(sample_mask[i]) for i in order])
    batch = {
        "message_log": [[{"role": "user", "token_ids": torch.tensor(p)}] for p in rows],
        "total_reward": torch.tensor([sum(v[b] for v in rewards.values()) for b in range(B)]),
        "loss_multiplier": torch.ones(B),
    }
    batch.update({f"reward/{k}": torch.tensor(v, dtype=torch.float32) for k, v in rewards.items()})
    return prompt_ids, token_mask * sample.unsqueeze(-1), batch, rows


def _centered(values, i, members, leave_one_out, normalize, eps):
    """NeMo-RL's per-rollout rule: baseline and unbiased std of the others (or of all)."""
    pool = [values[j] for j in members if j != i] if leave_one_out else [values[j] for j in members]
    mean = statistics.fmean(pool)
    std = statistics.stdev(pool) if len(pool) >= 2 else 0.0
    return (values[i] - mean) / (std + eps) if normalize and std > 0 else values[i] - mean


def reference_gdpo(groups, rewards, valid, weights, conditions=(), leave_one_out=True, normalize=True,
                   eps=NEMO_RL_EPS, batch_eps=0.0):
    """GDPO by NeMo-RL's definition, one rollout at a time (``batch_eps=0``: NeMo-RL's batch
    step; ``eps``: this project's). Conditions read the raw rewards."""
    r = {k: list(v) for k, v in rewards.items()}
    for target, on, threshold, fill in conditions:
        r[target] = [x if y >= threshold else fill for x, y in zip(rewards[target], rewards[on])]
    members = defaultdict(list)
    for i, g in enumerate(groups):
        if valid[i]:
            members[g].append(i)
    summed = [0.0] * len(groups)
    for name, values in r.items():
        for idx in members.values():
            if len(idx) < 2:
                continue  # NeMo-RL: baseline = reward
            for i in idx:
                summed[i] += weights[name] * _centered(values, i, idx, leave_one_out, normalize, eps)
    kept = [summed[i] for i in range(len(groups)) if valid[i]]
    mean, std = statistics.fmean(kept), statistics.stdev(kept)
    return [(summed[i] - mean) / (std + batch_eps) if valid[i] else 0.0 for i in range(len(groups))]


PROMPTS = [[11, 12], [11, 12, 13], [7, 3, 9, 4]]  # the first is a prefix of the second
REWARDS = {
    "correctness": [1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    "format": [1, 1, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1],
    "length": [0.2, 0.9, 0.5, 0.1, 0.3, 0.7, 0.6, 0.4, 0.8, 0.5, 0.25, 0.95],
}
LENGTHS = [3, 5, 1, 4, 2, 5, 3, 3, 4, 1, 2, 5]
WEIGHTS = {"correctness": 1.0, "format": 0.5, "length": 0.25}
WEIGHT_LIST = [WEIGHTS[k] for k in sorted(WEIGHTS)]  # NeMo-RL's form: sorted reward names
CONFIG = {
    "name": "gdpo",
    "implementation": "gdpo_megatron",
    "reward_weights": WEIGHT_LIST,
    "conditions": [{"reward": "length", "gate": "correctness", "threshold": 1.0}],
}
SHUFFLED = [9, 11, 8, 10, 3, 0, 2, 1, 6, 4, 7, 5]  # groups reordered, rollouts within each too


def _expect(values):
    return torch.tensor(values, dtype=torch.float32)


def test_defaults_are_nemo_rls():
    config = GDPOMegatronEstimator({}, group_size=4).config
    assert (config.use_leave_one_out_baseline, config.normalize_rewards, config.eps, config.reward_weights,
            config.batch_norm) == (True, True, NEMO_RL_EPS, None, True)


def test_a_pydantic_config_like_nemo_rls_gets_its_defaults_and_rejects_mapping_weights():
    class AdvEstimatorConfig(pydantic.BaseModel, extra="allow"):  # the schema at the commit read
        name: str = "grpo"
        normalize_rewards: bool = True
        use_leave_one_out_baseline: bool = True
        reward_weights: list[float] | None = None
        minus_baseline: bool = True

    cfg = AdvEstimatorConfig(name="gdpo", implementation="gdpo_megatron", reward_weights=WEIGHT_LIST,
                             conditions=CONFIG["conditions"])
    config = GDPOMegatronEstimator(cfg, group_size=4).config
    assert (config.use_leave_one_out_baseline, config.normalize_rewards, config.reward_weights) == (
        True, True, WEIGHT_LIST)
    assert config.conditions[0].reward == "length"
    with pytest.raises(pydantic.ValidationError):
        AdvEstimatorConfig(reward_weights=WEIGHTS)  # why the estimator takes lists only
    with pytest.raises(ValueError, match=r"name: the gdpo_megatron implementation computes GDPO.*'grpo'"):
        GDPOMegatronEstimator(AdvEstimatorConfig(implementation="gdpo_megatron"), group_size=4)  # name left at NeMo-RL's default


def test_leave_one_out_by_hand_with_groups_of_two_and_one():
    # Groups of 3 rollouts; masked ones leave the statistics: prompt 4 keeps 2 rollouts,
    # prompt 6 one, prompt 8 three. Rewards a and b, weights [2, 1].
    rewards = {"a": [1, 0, 9, 5, 9, 9, 1, 0, 0], "b": [0, 0, 9, 5, 9, 9, 1, 1, 0]}
    prompt_ids = torch.tensor([[4]] * 3 + [[6]] * 3 + [[8]] * 3)
    valid = [1, 1, 0, 1, 0, 0, 1, 1, 1]
    mask = torch.tensor(valid, dtype=torch.float32).unsqueeze(1).expand(9, 3)
    batch = {f"reward/{k}": torch.tensor(v, dtype=torch.float32) for k, v in rewards.items()}
    est = GDPOMegatronEstimator({"reward_weights": [2.0, 1.0]}, group_size=3)  # NeMo-RL's defaults otherwise
    out = est.compute_advantage(prompt_ids, None, mask, batch)[:, 0]

    s = 0.5 / (math.sqrt(0.5) + NEMO_RL_EPS)  # 0.5 off the mean of two others {0, 1}, over their std
    summed = [
        2 * 1 + 0, 2 * -1 + 0,  # a group of 2: each rollout minus the other one, undivided
        0,  # alone: no baseline but itself
        2 * (1 - 0) + s,  # a: the others {0, 0} are equal, undivided; b: others {1, 0}
        2 * -s + s,  # a: others {1, 0}; b: others {1, 0}
        2 * -s + (0 - 1),  # a: others {1, 0}; b: others {1, 1} are equal
    ]
    kept = [i for i in range(9) if valid[i]]

    def expected(summed):
        mean, std = statistics.fmean(summed), statistics.stdev(summed)
        full = [0.0] * 9
        for i, v in zip(kept, summed):
            full[i] = (v - mean) / std
        return _expect(full)

    torch.testing.assert_close(out, expected(summed), atol=1e-5, rtol=0)

    # normalize_rewards: false only centers; batch normalization stays.
    est = GDPOMegatronEstimator({"reward_weights": [2.0, 1.0], "normalize_rewards": False}, group_size=3)
    out = est.compute_advantage(prompt_ids, None, mask, batch)[:, 0]
    torch.testing.assert_close(out, expected([2, -2, 0, 2 * 1 + 0.5, 2 * -0.5 + 0.5, 2 * -0.5 - 1]), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_every_option_matches_nemo_rls_formulas(leave_one_out, normalize):
    prompt_ids, mask, batch, rows = nemo_rl_inputs(PROMPTS, 4, REWARDS, LENGTHS, order=SHUFFLED)
    config = {"name": "gdpo", "reward_weights": WEIGHT_LIST, "use_leave_one_out_baseline": leave_one_out,
              "normalize_rewards": normalize}
    out = GDPOMegatronEstimator(config, group_size=4).compute_advantage(prompt_ids, batch["total_reward"], mask, batch)
    rewards = {k: [v[i] for i in SHUFFLED] for k, v in REWARDS.items()}
    expected = reference_gdpo([tuple(p) for p in rows], rewards, [True] * 12, WEIGHTS, leave_one_out=leave_one_out,
                              normalize=normalize)
    # NeMo-RL's batch step adds no eps: the difference is eps / std, ~1e-6 relative.
    torch.testing.assert_close(out, _expect(expected).unsqueeze(1).expand_as(out), atol=1e-5, rtol=0)
    assert len(set(torch.tensor(expected).round(decimals=4).tolist())) > 6  # the case is not degenerate


def test_conditions_and_every_token():
    prompt_ids, mask, batch, rows = nemo_rl_inputs(PROMPTS, 4, REWARDS, LENGTHS, order=SHUFFLED)
    est = GDPOMegatronEstimator(CONFIG, loss_config={}, group_size=4)
    out = est.compute_advantage(prompt_ids=prompt_ids, rewards=batch["total_reward"], mask=mask, repeated_batch=batch)

    rewards = {k: [v[i] for i in SHUFFLED] for k, v in REWARDS.items()}
    expected = reference_gdpo([tuple(p) for p in rows], rewards, [True] * 12, WEIGHTS,
                              [("length", "correctness", 1.0, 0.0)], batch_eps=NEMO_RL_EPS)
    assert out.shape == mask.shape and out.dtype == mask.dtype and out.is_contiguous()
    torch.testing.assert_close(out, _expect(expected).unsqueeze(1).expand_as(out), atol=1e-6, rtol=0)


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_masked_rollouts_get_zero_and_leave_the_statistics(leave_one_out):
    sample_mask = [1.0] * 12
    sample_mask[1] = sample_mask[6] = 0.0  # e.g. dropped for a large logprob error
    prompt_ids, mask, batch, rows = nemo_rl_inputs(PROMPTS, 4, REWARDS, LENGTHS, sample_mask=sample_mask)
    valid_mask = torch.ones(12)
    valid_mask[9] = 0.0  # a placeholder row to keep out of its siblings' baselines
    est = GDPOMegatronEstimator({"reward_weights": WEIGHT_LIST, "use_leave_one_out_baseline": leave_one_out}, group_size=4)
    out = est.compute_advantage(prompt_ids, batch["total_reward"], mask, batch, valid_mask=valid_mask)

    valid = [s == 1.0 and i != 9 for i, s in enumerate(sample_mask)]
    expected = reference_gdpo([tuple(p) for p in rows], REWARDS, valid, WEIGHTS, leave_one_out=leave_one_out,
                              batch_eps=NEMO_RL_EPS)
    torch.testing.assert_close(out[:, 0], _expect(expected), atol=1e-6, rtol=0)
    assert out[[1, 6, 9]].abs().sum() == 0


def test_gdpo_keeps_reward_combinations_apart():
    # Totals (0, 1) for one prompt and (0, 2) for the other: GRPO gives both +-0.7071,
    # GDPO gives the second prompt exactly twice the advantages of the first.
    rewards = {"a": [0, 1, 0, 1], "b": [0, 0, 0, 1]}
    prompt_ids, mask, batch, _ = nemo_rl_inputs([[5], [6]], 2, rewards, [2, 2, 2, 2])
    for loo in (True, False):
        est = GDPOMegatronEstimator({"use_leave_one_out_baseline": loo}, group_size=2)
        out = est.compute_advantage(prompt_ids, batch["total_reward"], mask, batch)[:, 0]
        torch.testing.assert_close(out[2:], 2 * out[:2], atol=1e-6, rtol=0)
        assert out[1] > 0 > out[0]


def test_list_weights_follow_sorted_names():
    prompt_ids, mask, batch, rows = nemo_rl_inputs(PROMPTS, 4, REWARDS, LENGTHS)
    out = GDPOMegatronEstimator({"reward_weights": WEIGHT_LIST}, group_size=4).compute_advantage(
        prompt_ids, None, mask, batch)
    expected = reference_gdpo([tuple(p) for p in rows], REWARDS, [True] * 12, WEIGHTS, batch_eps=NEMO_RL_EPS)
    torch.testing.assert_close(out[:, 0], _expect(expected), atol=1e-6, rtol=0)


def test_two_questions_sharing_a_prompt_stay_two_groups():
    # Rows 0-3 and 4-7 render the same prompt but are different questions (say, one environment
    # state each): each is its own group of 4, as NeMo-RL's repeat_interleave made them.
    prompts = [[11, 12], [11, 12], [7, 3, 9, 4]]
    prompt_ids, mask, batch, rows = nemo_rl_inputs(prompts, 4, REWARDS, LENGTHS)
    out = GDPOMegatronEstimator({"reward_weights": WEIGHT_LIST}, group_size=4).compute_advantage(
        prompt_ids, None, mask, batch)
    by_block = reference_gdpo([b // 4 for b in range(12)], REWARDS, [True] * 12, WEIGHTS, batch_eps=NEMO_RL_EPS)
    by_prompt = reference_gdpo([tuple(p) for p in rows], REWARDS, [True] * 12, WEIGHTS, batch_eps=NEMO_RL_EPS)
    torch.testing.assert_close(out[:, 0], _expect(by_block), atol=1e-6, rtol=0)
    assert max(abs(x - y) for x, y in zip(by_block, by_prompt)) > 0.1  # merging them would be wrong


def test_prompt_groups_are_checked_consecutive_blocks():
    ids = torch.tensor([[11, 12, PAD], [11, 12, PAD], [11, 12, 13], [11, 12, 13], [11, 12, PAD], [11, 12, PAD]])
    assert prompt_groups(ids, 6, 2).tolist() == [0, 0, 1, 1, 2, 2]  # blocks 0 and 2 share a prompt
    with pytest.raises(ValueError, match=r"rows 0\.\.2 \(group 0 of grpo.num_generations_per_prompt=3 "
                                         r"consecutive rollouts\) hold different prompts"):
        prompt_groups(ids, 6, 3)  # [11, 12, PAD] is a prefix of [11, 12, 13] but not equal
    with pytest.raises(ValueError, match=r"6 rollouts are not whole groups of grpo.num_generations_per_prompt=4"):
        prompt_groups(ids, 6, 4)


def test_metrics_report_every_reward():
    prompt_ids, mask, batch, _ = nemo_rl_inputs(PROMPTS, 4, REWARDS, LENGTHS)
    est = GDPOMegatronEstimator(CONFIG, group_size=4)
    est.compute_advantage(prompt_ids, None, mask, batch)
    m = est.last_metrics
    length = [x if c >= 1 else 0.0 for x, c in zip(REWARDS["length"], REWARDS["correctness"])]
    conditioned = {**REWARDS, "length": length}
    for name, v in conditioned.items():
        flat = sum(max(v[g * 4 : g * 4 + 4]) == min(v[g * 4 : g * 4 + 4]) for g in range(3)) / 3
        assert m[f"reward/{name}/zero_spread_frac"] == pytest.approx(flat)
    assert m["reward/format/zero_spread_frac"] == pytest.approx(1 / 3)  # the third group always formats
    assert sum(m[f"reward/{n}/advantage_var_share"] for n in REWARDS) == pytest.approx(1.0)
    assert m["advantage/batch_std"] > 0 and est.last_result.advantages.shape == (12,)


def test_nonfinite_reward_is_masked_when_asked():
    rewards = {k: list(v) for k, v in REWARDS.items()}
    rewards["format"][4] = math.nan
    prompt_ids, mask, batch, rows = nemo_rl_inputs(PROMPTS, 4, rewards, LENGTHS)
    with pytest.raises(ValueError, match="NaN"):
        GDPOMegatronEstimator({}, group_size=4).compute_advantage(prompt_ids, None, mask, batch)
    est = GDPOMegatronEstimator({"nonfinite": "mask", "reward_weights": WEIGHT_LIST}, group_size=4)
    out = est.compute_advantage(prompt_ids, None, mask, batch)[:, 0]
    expected = reference_gdpo([tuple(p) for p in rows], rewards, [i != 4 for i in range(12)], WEIGHTS,
                              batch_eps=NEMO_RL_EPS)
    torch.testing.assert_close(out, _expect(expected), atol=1e-6, rtol=0)
    assert est.last_metrics["advantage/nonfinite_rollouts"] == 1


@pytest.mark.parametrize(
    "config, match",
    [
        ({"reward_weights": WEIGHTS}, r"grpo.adv_estimator.reward_weights: expected a list"),
        ({"reward_weights": "1,2"}, r"grpo.adv_estimator.reward_weights: expected a list"),
        ({"reward_weights": [1.0, "x"]}, r"grpo.adv_estimator.reward_weights.1: expected a number"),
        ({"name": "grpo"}, r"grpo.adv_estimator.name: the gdpo_megatron implementation computes GDPO"),
        ({"minus_baseline": False}, r"minus_baseline: false applies to NeMo-RL's reinforce_plus_plus"),
        ({"use_leave_one_out": False}, r"grpo.adv_estimator.use_leave_one_out: unknown key"),
        ({"use_leave_one_out_baseline": "no"}, r"use_leave_one_out_baseline: expected true or false"),
        ({"normalize_rewards": 0}, r"normalize_rewards: expected true or false"),
        ({"conditions": [{"reward": "length", "gate": "correctness", "target": "x"}]},
         r"grpo.adv_estimator.conditions.0.target: unknown key"),
        ({"conditions": [{"gate": "correctness"}]}, r"grpo.adv_estimator.conditions.0.reward: required key is missing"),
        ({"eps": -1.0}, r"grpo.adv_estimator.eps: expected a finite value >= 0"),
        ({"batch_norm": "yes"}, r"batch_norm"),
        ({"nonfinite": "drop"}, r"grpo.adv_estimator.nonfinite: expected one of"),
    ],
)
def test_bad_config_is_named(config, match):
    with pytest.raises(ValueError, match=match):
        GDPOMegatronEstimator(config, group_size=4)


def _call(config, batch_edit=None, prompt_rows=None, mask_1d=False, order=None):
    prompt_ids, mask, batch, _ = nemo_rl_inputs(PROMPTS, 4, REWARDS, LENGTHS, order=order)
    if batch_edit:
        batch_edit(batch)
    if prompt_rows is not None:
        prompt_ids = prompt_ids[:prompt_rows]
    GDPOMegatronEstimator(config, group_size=4).compute_advantage(prompt_ids, None, mask[:, 0] if mask_1d else mask, batch)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"config": {}, "batch_edit": lambda b: [b.pop(k) for k in list(b) if k.startswith("reward/")]},
         r"no reward components.*total_reward"),
        ({"config": {"reward_weights": [1.0, 2.0]}},
         r"2 weights for 3 rewards; give one per reward in sorted name order: \['correctness', 'format', 'length'\]"),
        ({"config": {"conditions": [{"reward": "len", "gate": "correctness", "threshold": 1}]}},
         r"grpo.adv_estimator.conditions.0.reward: 'len' is not a reward of the batch"),
        ({"config": {}, "batch_edit": lambda b: b.update({"reward/format": torch.ones(5)})},
         r"repeated_batch\['reward/format'\]: expected one value per rollout, shape \[12\]"),
        ({"config": {}, "prompt_rows": 6}, r"prompt_ids: expected \[12, S\]"),
        ({"config": {}, "order": [0, 1, 2, 4, 3, 5, 6, 7, 8, 9, 10, 11]},
         r"prompt_ids: rows 0\.\.3 \(group 0 .*\) hold different prompts"),
        ({"config": {}, "mask_1d": True}, r"mask: expected a \[B, T\] token mask"),
    ],
)
def test_bad_inputs_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_install_routes_the_selected_implementation_only():
    # Stands in for nemo_rl.algorithms.grpo (not installed here): only the factory is touched.
    grpo = types.ModuleType("grpo")
    grpo._create_advantage_estimator = lambda master_config: ("nemo_rl", master_config["grpo"]["adv_estimator"]["name"])
    install(grpo)
    install(grpo)  # idempotent: the second call must not wrap the wrapper

    selected = grpo._create_advantage_estimator(
        {"grpo": {"adv_estimator": CONFIG, "num_generations_per_prompt": 4}, "loss_fn": {}})
    assert isinstance(selected, GDPOMegatronEstimator) and selected.config.reward_weights == WEIGHT_LIST
    assert selected.group_size == 4
    assert last_built_estimator() is selected
    assert grpo._create_advantage_estimator({"grpo": {"adv_estimator": {"name": "grpo"}}}) == ("nemo_rl", "grpo")
    pydantic_like = types.SimpleNamespace(
        grpo=types.SimpleNamespace(adv_estimator=types.SimpleNamespace(name="gdpo", implementation="gdpo_megatron"),
                                   num_generations_per_prompt=8),
        loss_fn=None,
    )
    assert isinstance(grpo._create_advantage_estimator(pydantic_like), GDPOMegatronEstimator)
    with pytest.raises(ValueError, match=r"implementation: expected 'gdpo_megatron', got 'gdpo-megatron'"):
        typo = {"name": "gdpo", "implementation": "gdpo-megatron"}
        grpo._create_advantage_estimator({"grpo": {"adv_estimator": typo}})
    with pytest.raises(ValueError, match=r"grpo.num_generations_per_prompt: expected an integer >= 1, got None"):
        grpo._create_advantage_estimator({"grpo": {"adv_estimator": CONFIG}})


def test_reward_columns_of_mixed_dtypes_and_a_bool_mask():
    prompt_ids, mask, batch, rows = nemo_rl_inputs(PROMPTS, 4, REWARDS, LENGTHS)
    batch["reward/correctness"] = batch["reward/correctness"].to(torch.int64)  # e.g. from a verifier
    batch["reward/length"] = batch["reward/length"].to(torch.float64)
    est = GDPOMegatronEstimator({"reward_weights": WEIGHT_LIST}, group_size=4)
    out = est.compute_advantage(prompt_ids, None, mask.bool(), batch)
    expected = reference_gdpo([tuple(p) for p in rows], REWARDS, [True] * 12, WEIGHTS, batch_eps=NEMO_RL_EPS)
    assert out.dtype == torch.float32 and out.shape == mask.shape
    torch.testing.assert_close(out[:, -1], _expect(expected), atol=1e-6, rtol=0)
