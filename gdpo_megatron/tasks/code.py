"""The ``code`` task: a programming problem and the tests a program must pass.

Ground truth: the first of ``tests`` (this project's list of ``{"input", "output"}`` or
``{"assert"}``), ``input_output`` (APPS, TACO), ``reward_model.ground_truth`` (Eurus-2-RL)
that is there; published test cases are converted by :mod:`gdpo_megatron.tasks.code_tests`.
Gives ``{"tests"}`` for ``code_pass`` and ``code_no_bug``.
"""
from __future__ import annotations

from typing import Any

from gdpo_megatron.tasks.code_tests import tests_from_input_output
from gdpo_megatron.tasks.task import Task

SYSTEM_PROMPT = (
    "Think inside <think>...</think>, then write a complete Python 3 program in one ```python "
    "code block. It reads the input from standard input and prints the answer."
)


def parse_ground_truth(value: Any, key: str, row: dict, where: str) -> dict:
    if not isinstance(value, list):
        try:
            return {"tests": tests_from_input_output(value)}
        except ValueError as e:
            raise ValueError(f"{where}: {key!r}: {e}") from None
    if not value or not all(isinstance(t, dict) and (("input" in t and "output" in t) or "assert" in t)
                            for t in value):
        raise ValueError(f"{where}: {key!r} must be a non-empty list of {{'input', 'output'}} or {{'assert'}}")
    return {"tests": value}


def instructions(ground_truth: dict) -> str:
    return SYSTEM_PROMPT


TASK = Task(
    name="code",
    ground_truth_keys=("tests", "input_output", "reward_model.ground_truth"),
    parse_ground_truth=parse_ground_truth,
    instructions=instructions,
    rewards=("code_pass", "code_no_bug"),
)
