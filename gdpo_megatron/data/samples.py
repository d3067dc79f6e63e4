"""Prompt datasets for the three task families: JSONL files of prompts and ground truth.

One JSON object per line. The prompt is ``"messages"`` (a chat: ``[{"role", "content"}]``)
or ``"prompt"`` (one user message). The family's instructions (answer format; for tool
calling also the function schemas) go into the system message: appended to the chat's own
system message if it starts with one, else as a new first message. Ground truth, by family:

* ``math``: ``"answer"`` (string or number), checked by ``math_correctness``;
* ``tool``: ``"tool_calls"`` (list; empty for "answer without a call") and ``"tools"``
  (function schemas shown in the system prompt), checked by ``tool_correctness``;
* ``code``: ``"tests"`` (``{"input", "output"}`` or ``{"assert"}`` objects), run by ``code_pass``.

Every other key is kept as metadata; ``"id"`` defaults to ``<file stem>-<line number>``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAMILIES = ("math", "tool", "code")
GROUND_TRUTH_KEYS = {"math": ("answer",), "tool": ("tool_calls", "tools"), "code": ("tests",)}

MATH_SYSTEM_PROMPT = (
    "Think step by step inside <think>...</think>, then give the final answer in \\boxed{}."
)
CODE_SYSTEM_PROMPT = (
    "Think inside <think>...</think>, then write a complete Python 3 program in one ```python "
    "code block. It reads the input from standard input and prints the answer."
)
TOOL_SYSTEM_PROMPT = (
    "You can call these functions:\n{tools}\n\n"
    "Think inside <think>...</think>. Then, to call functions, write\n"
    '<tool_call>\n[{{"name": "<function name>", "arguments": {{<argument>: <value>}}}}, ...]\n</tool_call>\n'
    "listing every call needed. If no function fits, answer in plain text after the think block."
)


@dataclass
class Sample:
    """One prompt: the chat to complete and what the rewards check the completion against."""

    id: str
    family: str
    messages: list[dict[str, str]]
    ground_truth: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)


def load_jsonl(path: str | Path, family: str, system_prompt: str | None = None) -> list[Sample]:
    """Samples of ``family`` from a JSONL file.

    ``system_prompt`` replaces the family's instructions (``""``: add none).
    """
    path = Path(path)
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    samples = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            samples.append(make_sample(record, family, f"{path.stem}-{lineno}", where, system_prompt))
    if not samples:
        raise ValueError(f"dataset file {path} has no samples")
    return samples


def make_sample(record: dict, family: str, default_id: str, where: str, system_prompt: str | None = None) -> Sample:
    """A :class:`Sample` from one record (``where`` names it in error messages)."""
    record = dict(record)
    messages = _messages(record, where)
    ground_truth = {}
    for key in GROUND_TRUTH_KEYS[family]:
        if key not in record:
            if key == "tools":
                continue
            raise ValueError(f"{where}: missing '{key}' (required for {family} samples)")
        ground_truth[key] = record.pop(key)
    _check_ground_truth(family, ground_truth, where)
    instructions = _system_prompt(family, ground_truth) if system_prompt is None else system_prompt
    if instructions and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{instructions}"
    elif instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    return Sample(str(record.pop("id", default_id)), family, messages, ground_truth, record)


def _messages(record: dict, where: str) -> list[dict[str, str]]:
    if "messages" in record:
        messages = record.pop("messages")
        if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
        return [dict(m) for m in messages]
    if isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record.pop("prompt")}]
    raise ValueError(f"{where}: expected 'messages' (a chat) or 'prompt' (a string)")


def _check_ground_truth(family: str, truth: dict, where: str) -> None:
    if family == "math" and (not isinstance(truth["answer"], (str, int, float)) or isinstance(truth["answer"], bool)):
        raise ValueError(f"{where}: 'answer' must be a string or a number, got {truth['answer']!r}")
    if family == "tool":
        calls = truth["tool_calls"]
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str)
            and (isinstance(c.get("arguments"), dict) or isinstance(c.get("accepted"), dict))
            for c in calls
        ):
            raise ValueError(f"{where}: 'tool_calls' must be a list of {{'name': str, 'arguments': dict}}")
        if not isinstance(truth.get("tools", []), list):
            raise ValueError(f"{where}: 'tools' must be a list of function schemas")
    if family == "code":
        tests = truth["tests"]
        if not isinstance(tests, list) or not tests or not all(
            isinstance(t, dict) and (("input" in t and "output" in t) or "assert" in t) for t in tests
        ):
            raise ValueError(f"{where}: 'tests' must be a non-empty list of {{'input', 'output'}} or {{'assert'}}")


def _system_prompt(family: str, truth: dict) -> str:
    if family == "math":
        return MATH_SYSTEM_PROMPT
    if family == "code":
        return CODE_SYSTEM_PROMPT
    tools = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in truth.get("tools", []))
    return TOOL_SYSTEM_PROMPT.format(tools=tools)
