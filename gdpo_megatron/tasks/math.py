"""The ``math`` task: a problem and its final answer.

Ground truth: the first of ``answer``, ``expected_answer`` (NeMo-RL), ``reward_model.ground_truth``
(verl) that is there, else the chat's final assistant message; a string or a number, which
becomes ``{"answer": ...}`` for ``math_correctness``. A null or blank answer leaves the row out.
"""
from __future__ import annotations

from typing import Any

from gdpo_megatron.tasks.task import Task, UnusableGroundTruth

SYSTEM_PROMPT = "Think step by step inside <think>...</think>, then give the final answer in \\boxed{}."


def parse_ground_truth(value: Any, key: str, row: dict, where: str) -> dict:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise UnusableGroundTruth(f"{where}: {key!r} (the answer) is empty", "empty answer")
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError(f"{where}: {key!r} (the answer) must be a string or a number, got {value!r}")
    return {"answer": value}


def instructions(ground_truth: dict) -> str:
    return SYSTEM_PROMPT


TASK = Task(
    name="math",
    ground_truth_keys=("answer", "expected_answer", "reward_model.ground_truth"),
    parse_ground_truth=parse_ground_truth,
    instructions=instructions,
    rewards=("math_correctness", "math_format"),
    reference_in_chat=True,
)
