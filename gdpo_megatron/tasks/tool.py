"""The ``tool`` task: a request and the function calls that answer it.

Ground truth: ``tool_calls``, a list of ``{"name", "arguments"}`` (or ``{"name", "accepted"}``:
the values each argument may take), and ``tools``, the function schemas shown in the prompt;
together ``{"tool_calls", "tools"}`` for ``tool_correctness``. The instructions list the schemas
and the call format ``tool_format`` checks.
"""
from __future__ import annotations

import json
from typing import Any

from gdpo_megatron.tasks.task import Task

SYSTEM_PROMPT = (
    "You can call these functions:\n{tools}\n\n"
    "Think inside <think>...</think>. Then, to call functions, write\n"
    '<tool_call>\n[{{"name": "<function name>", "arguments": {{<argument>: <value>}}}}, ...]\n</tool_call>\n'
    "listing every call needed. If no function fits, answer in plain text after the think block."
)


def parse_ground_truth(value: Any, key: str, row: dict, where: str) -> dict:
    if not isinstance(value, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str)
        and (isinstance(c.get("arguments"), dict) or isinstance(c.get("accepted"), dict))
        for c in value
    ):
        raise ValueError(f"{where}: {key!r} must be a list of {{'name': str, 'arguments': dict}}")
    truth = {"tool_calls": value}
    if "tools" in row:
        truth["tools"] = row.pop("tools")
        if not isinstance(truth["tools"], list):
            raise ValueError(f"{where}: 'tools' must be a list of function schemas")
    return truth


def instructions(ground_truth: dict) -> str:
    tools = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in ground_truth.get("tools", []))
    return SYSTEM_PROMPT.format(tools=tools)


TASK = Task(
    name="tool",
    ground_truth_keys=("tool_calls",),
    parse_ground_truth=parse_ground_truth,
    instructions=instructions,
    rewards=("tool_format", "tool_correctness"),
)
