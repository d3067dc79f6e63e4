"""The ``toolrl`` task: ToolRL's tool-calling data, scored by ToolRL's own rules.

Ground truth: ``reward_model.ground_truth`` (ToolRL's parquet), ``output`` (ToolRL's JSON),
else the chat's final assistant message: the reference answer as ToolRL writes it, which
becomes ``{"answer"}`` for the ``toolrl_*`` rewards. A null reference, or one whose calls
ToolRL's reward cannot read, leaves the row out. ToolRL's prompts carry their own
instructions, so this task adds none.
"""
from __future__ import annotations

from typing import Any

from gdpo_megatron.rewards.toolrl import UnscorableReference, parse_reference
from gdpo_megatron.tasks.task import Task, UnusableGroundTruth

UNSCORABLE = ("reference answer ToolRL's reward cannot parse (its first <tool_call> block is not one JSON call "
              "per line)")


def parse_ground_truth(value: Any, key: str, row: dict, where: str) -> dict:
    if value is None:
        raise UnusableGroundTruth(f"{where}: {key!r} (the reference answer) is empty", "empty answer")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} (ToolRL's reference answer) must be a string, got {type(value).__name__}")
    try:
        parse_reference(value)
    except UnscorableReference as e:
        raise UnusableGroundTruth(f"{where}: {key!r}: {e}", UNSCORABLE) from None
    return {"answer": value}


def instructions(ground_truth: dict) -> str:
    return ""


TASK = Task(
    name="toolrl",
    ground_truth_keys=("reward_model.ground_truth", "output"),
    parse_ground_truth=parse_ground_truth,
    instructions=instructions,
    rewards=("toolrl_format", "toolrl_correctness"),
    reference_in_chat=True,
)
