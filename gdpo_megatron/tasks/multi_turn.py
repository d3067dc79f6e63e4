"""The ``multi_turn`` task: multi-turn questions answered against the config's own environment.

Ground truth (the field ``multi_turn``), a dict, as the ``bfcl_multi_turn`` family's:

* ``environment_config``: the dict the environment's ``reset`` takes;
* ``reference_calls``: per user turn, the reference calls (Python call syntax), which the
  multi-turn rewards replay in a fresh environment to judge a trajectory;
* ``later_turns``: the user messages of the turns after the first (the prompt is the first).

The environment is the config's (``environment.name``, ``environment.file``: a user's own
:class:`~gdpo_megatron.environments.Environment`); the prompt carries its own instructions
(the functions it may call), there are none added. Rewards: the multi-turn ones
(:mod:`gdpo_megatron.rewards.multi_turn`).
"""
from __future__ import annotations

from typing import Any

from gdpo_megatron.tasks.task import Task

FIELDS = {"environment_config", "reference_calls", "later_turns"}
REWARDS = ("multi_turn_format", "multi_turn_state", "multi_turn_response", "multi_turn_efficiency")


def check_fields(value: Any, key: str, where: str) -> None:
    """ValueError unless ``value`` is a dict of exactly the multi-turn ground truth's fields."""
    if not isinstance(value, dict) or set(value) != FIELDS:
        raise ValueError(f"{where}: {key!r} must be a dict of environment_config, reference_calls and later_turns")


def check_turns(value: dict, key: str, where: str) -> None:
    """ValueError unless ``reference_calls`` and ``later_turns`` describe the same user turns."""
    reference, later = value["reference_calls"], value["later_turns"]
    if not (isinstance(reference, list) and reference
            and all(isinstance(t, list) and all(isinstance(c, str) for c in t) for t in reference)):
        raise ValueError(f"{where}: {key}.reference_calls must be a non-empty list (one per user turn) of "
                         "lists of call strings")
    if not (isinstance(later, list) and len(later) == len(reference) - 1 and all(
            isinstance(t, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in t)
            for t in later)):
        raise ValueError(f"{where}: {key}.later_turns must hold the user messages of the {len(reference) - 1} "
                         "turns after the first")


def parse_ground_truth(value: Any, key: str, row: dict, where: str) -> dict:
    check_fields(value, key, where)
    if not isinstance(value["environment_config"], dict):
        raise ValueError(f"{where}: {key}.environment_config must be a dict (what the environment's reset takes)")
    check_turns(value, key, where)
    return dict(value)


TASK = Task(
    name="multi_turn",
    ground_truth_keys=("multi_turn",),
    parse_ground_truth=parse_ground_truth,
    instructions=lambda ground_truth: "",
    rewards=REWARDS,
    multi_turn=True,
)
