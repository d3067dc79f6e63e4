"""Reward functions (registered by name) and the sharded reward stage that scores rollouts.

Importing this package registers the built-in rewards: ``tool_format``,
``tool_correctness``, ``toolrl_format``, ``toolrl_correctness``, ``math_correctness``,
``math_format``, ``length``, ``code_pass``, ``code_no_bug`` and the multi-turn ``multi_turn_format``,
``multi_turn_state``, ``multi_turn_response``, ``multi_turn_accuracy`` and ``multi_turn_efficiency``.
"""
from gdpo_megatron.rewards import coding, length, math_answer, multi_turn, tool_call, toolrl  # noqa: F401  (registration)
from gdpo_megatron.rewards.registry import (
    get_reward,
    load_reward_file,
    register_reward,
    registered_rewards,
    reward_bounds,
    validate_specs,
)
from gdpo_megatron.rewards.stage import RewardStage

__all__ = [
    "RewardStage", "get_reward", "load_reward_file", "register_reward", "registered_rewards",
    "reward_bounds", "validate_specs",
]
