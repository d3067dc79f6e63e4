"""Reward registry, user reward files, and spec validation."""
import pytest

from gdpo_megatron.config.rewards import RewardsConfig, RewardSpec
from gdpo_megatron.rewards import (
    get_reward,
    load_reward_file,
    register_reward,
    registered_rewards,
    reward_bounds,
    validate_specs,
)
from gdpo_megatron.rewards.registry import failure_score
from gdpo_megatron.config import ConfigError, from_dict

BUILT_IN = {"tool_format", "tool_correctness", "math_correctness", "math_format", "length", "code_pass", "code_no_bug"}


def test_built_in_rewards_are_registered():
    assert BUILT_IN <= set(registered_rewards())


def test_user_reward_file_registers_its_rewards(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "from gdpo_megatron.rewards import register_reward\n"
        "@register_reward('test_exclamations')\n"
        "def exclamations(completion, num_tokens, ground_truth, per=1.0):\n"
        "    return per * completion.count('!')\n"
    )
    load_reward_file(path)
    load_reward_file(path)  # importing twice is harmless
    assert get_reward("test_exclamations")("a!b!", 2, {}, per=0.5) == 1.0
    validate_specs([RewardSpec("test_exclamations", kwargs={"per": 2.0}), RewardSpec("length")])


def test_a_name_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("length")(lambda completion, num_tokens, ground_truth: 0.0)


def test_unknown_reward_lists_the_known_ones():
    with pytest.raises(ValueError, match="'no_such_reward' is not registered.*math_correctness"):
        get_reward("no_such_reward")


def test_missing_reward_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward_file(tmp_path / "nope.py")


@pytest.mark.parametrize("specs,match", [
    ([RewardSpec("length", kwargs={"max_token": 5})], "'length': kwargs"),
    ([RewardSpec("nope")], "not registered"),
])
def test_validate_specs(specs, match):
    with pytest.raises(ValueError, match=match):
        validate_specs(specs)


@pytest.mark.parametrize("entry,match", [
    ({"name": ""}, "rewards.rewards.0.name: expected a reward name"),
    ({"name": "x", "weight": float("nan")}, "rewards.rewards.0.weight: expected a finite number"),
    ({"name": "x", "failure_value": "low"}, "rewards.rewards.0.failure_value: expected a number"),
    ({"name": "x", "timeout_s": 0}, "rewards.rewards.0.timeout_s: expected > 0 seconds or null"),
    ({"name": "x", "kwargs": [1]}, "rewards.rewards.0.kwargs: expected a mapping"),
])
def test_reward_entries_with_bad_fields_are_refused_at_load(entry, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(RewardsConfig, {"rewards": [entry]}, "rewards")


@pytest.mark.parametrize("rewards,match", [
    ([], "rewards.rewards: expected at least one reward"),
    ([{"name": "length"}, {"name": "length"}], "rewards.rewards: expected unique names"),
])
def test_reward_lists_are_checked_at_load(rewards, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(RewardsConfig, {"rewards": rewards}, "rewards")


def test_built_in_rewards_declare_their_ranges():
    assert reward_bounds("tool_correctness") == reward_bounds("toolrl_correctness") == (-3.0, 3.0)
    assert all(reward_bounds(name) == (0.0, 1.0) for name in BUILT_IN - {"tool_correctness"})
    with pytest.raises(ValueError, match="not registered"):
        reward_bounds("no_such_reward")


@pytest.mark.parametrize("bounds", [(1.0, 0.0), (0.0, 0.0), (0.0, float("inf")), (0.0,), "01", (0.0, True)])
def test_bad_bounds_are_named(bounds):
    with pytest.raises(ValueError, match="'test_bounded': bounds"):
        register_reward("test_bounded", bounds=bounds)


def test_a_failure_scores_the_declared_low_bound_unless_the_spec_says_otherwise():
    register_reward("test_unbounded")(lambda completion, num_tokens, ground_truth: 5.0)
    assert failure_score(RewardSpec("tool_correctness")) == -3.0  # not 0, which beats a wrong call
    assert failure_score(RewardSpec("math_correctness")) == 0.0
    assert failure_score(RewardSpec("tool_correctness", failure_value=-10)) == -10.0
    assert failure_score(RewardSpec("tool_correctness", failure_value=0.0)) == 0.0
    assert failure_score(RewardSpec("test_unbounded")) == 0.0


def refusing_zero(max_tokens=1):
    if max_tokens == 0:
        raise ValueError("max_tokens must be positive")


def test_registering_a_name_again_replaces_its_bounds_and_check():
    """A module imported twice (its functions have the same qualified name) registers anew."""
    def reward(completion, num_tokens, ground_truth, max_tokens=1):
        return 0.0

    register_reward("test_reregistered", bounds=(0, 2), check=refusing_zero)(reward)
    assert reward_bounds("test_reregistered") == (0.0, 2.0)
    with pytest.raises(ValueError, match="test_reregistered: max_tokens must be positive"):
        validate_specs([RewardSpec("test_reregistered", kwargs={"max_tokens": 0})])

    register_reward("test_reregistered")(reward)
    assert reward_bounds("test_reregistered") is None
    validate_specs([RewardSpec("test_reregistered", kwargs={"max_tokens": 0})])  # no check any more


def test_configs_with_and_without_failure_value_load():
    assert failure_score(from_dict(RewardSpec, {"name": "tool_correctness"}, "rewards.0")) == -3.0
    assert failure_score(from_dict(RewardSpec, {"name": "tool_correctness", "failure_value": 0}, "rewards.0")) == 0.0
    assert from_dict(RewardSpec, {"name": "tool_correctness", "failure_value": None}, "rewards.0").failure_value is None
    with pytest.raises(ConfigError, match="rewards.0.failure_value"):
        from_dict(RewardSpec, {"name": "tool_correctness", "failure_value": "low"}, "rewards.0")
