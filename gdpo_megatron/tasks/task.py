"""What a task family is: where a row's ground truth is, what it becomes, what the prompt is told, what scores it.

A :class:`Task` is all that differs between families when a prompt file is read
(:mod:`gdpo_megatron.data.samples` does the reading, the same for every family): the fields
that hold the ground truth, the function that turns the value found there into the dict the
rewards receive as ``ground_truth``, the instructions added to the system message, and the
rewards made for that ground truth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class UnusableGroundTruth(ValueError):
    """A row whose ground truth is there but cannot be scored (null, blank, unreadable): the
    row is left out and named in one warning, not an error. ``why`` is that warning's reason."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


# (value, key, row, where) -> ground truth: ``value`` was found at ``key`` (or is the chat's
# final assistant message); ``row`` holds the row's other fields, and the function pops those
# it takes too; ``where`` names the row in messages. Raises ValueError for a malformed value,
# UnusableGroundTruth for one to leave out.
GroundTruthParser = Callable[[Any, str, dict, str], dict]


@dataclass(frozen=True)
class Task:
    """One task family (registered in :mod:`gdpo_megatron.tasks.registry` under ``name``)."""

    name: str
    # The fields tried in order for the ground truth when data.ground_truth_key is not set
    # (dotted names reach into nested fields).
    ground_truth_keys: tuple[str, ...]
    parse_ground_truth: GroundTruthParser
    # The instructions added to the system message, from the sample's ground truth ("": none).
    instructions: Callable[[dict], str]
    # The rewards this ground truth is made for: gdpo-eval scores with them by default.
    rewards: tuple[str, ...]
    # Whether a chat's final assistant message (NeMo-RL's layout) is the ground truth when
    # none of ground_truth_keys is there.
    reference_in_chat: bool = False
    # Whether a rollout is a multi-turn trajectory through an environment (else one completion).
    multi_turn: bool = False
    # The environment a multi-turn family's rollouts step through by default (a reference that
    # gdpo_megatron.environments.registry resolves, e.g. "bfcl"); None: the config's
    # environment section names it (a single-turn family has none).
    environment: str | None = None
