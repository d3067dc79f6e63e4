"""Prompt datasets: rows of a published data file as prompts plus what the rewards check.

Files are read by :mod:`gdpo_megatron.data.readers` (JSON Lines, JSON, Parquet, Hugging Face
``datasets`` directories). Each row gives a :class:`Sample`:

* **Prompt**: the field ``prompt_key``, a chat (``[{"role", "content"}, ...]``) or a string
  (one user message). By default the first of ``messages`` (NeMo-RL, OpenAI), ``prompt``
  (verl), ``problem`` (DeepScaleR, NeMo-RL math) and ``question`` (APPS, TACO). A chat that
  ends with an assistant message (NeMo-RL's layout) ends the prompt before it: that message is
  the reference answer. ``system_key`` names a field holding the system message (ToolRL's SFT
  set: ``instruction``).
* **Ground truth**: the field ``ground_truth_key`` (dotted names reach into nested fields, as
  in verl's ``reward_model.ground_truth``, or name a flattened column), by default the first present of the family's
  fields below, else (``math``, ``toolrl``) the chat's final assistant message:

  - ``math``: ``answer``, ``expected_answer``, ``reward_model.ground_truth``; gives
    ``{"answer"}`` for ``math_correctness``;
  - ``tool``: ``tool_calls`` (and ``tools``, the schemas shown in the prompt); gives
    ``{"tool_calls", "tools"}`` for ``tool_correctness``;
  - ``code``: ``tests`` (this project's list), ``input_output`` (APPS, TACO),
    ``reward_model.ground_truth`` (Eurus-2-RL); gives ``{"tests"}`` for ``code_pass`` (see
    :mod:`gdpo_megatron.data.code_tests`);
  - ``toolrl``: ``reward_model.ground_truth`` (ToolRL's parquet), ``output`` (ToolRL's JSON);
    gives ``{"answer"}`` for the ``toolrl_*`` rewards.

* **Instructions**: the family's answer format (for ``tool`` also the function schemas) is
  added to the system message, unless ``system_prompt`` replaces it (``""``: none). ToolRL's
  prompts carry their own, so ``toolrl`` adds none by default.

Every other field is kept as metadata, except fields named like a key of the sample's ground
truth (e.g. ``answer``), which would shadow it; ``id`` defaults to ``<file stem>-<line or row>``.
A malformed row is an error naming the file and the line or row. Rows that hold no usable
ground truth are left out and named in one warning: a ``math`` row whose answer is null or
blank, a ``toolrl`` row whose reference is null or one ToolRL's reward cannot parse.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from gdpo_megatron.config.data import Family

from gdpo_megatron.data.code_tests import tests_from_input_output
from gdpo_megatron.data.readers import Where, read_records
from gdpo_megatron.rewards.toolrl import UnscorableReference, parse_reference

FAMILIES = get_args(Family)
PROMPT_KEYS = ("messages", "prompt", "problem", "question")
GROUND_TRUTH_KEYS = {
    "math": ("answer", "expected_answer", "reward_model.ground_truth"),
    "tool": ("tool_calls",),
    "code": ("tests", "input_output", "reward_model.ground_truth"),
    "toolrl": ("reward_model.ground_truth", "output"),
}

# The rewards each family's ground truth is made for (gdpo-eval scores with them by default).
FAMILY_REWARDS = {
    "math": ("math_correctness", "math_format"),
    "tool": ("tool_format", "tool_correctness"),
    "code": ("code_pass", "code_no_bug"),
    "toolrl": ("toolrl_format", "toolrl_correctness"),
}

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


class EmptyGroundTruth(ValueError):
    """A row whose answer field is there but empty (null or blank)."""


_LEFT_OUT_BECAUSE = {
    EmptyGroundTruth: "empty answer",
    UnscorableReference: "reference answer ToolRL's reward cannot parse (its first <tool_call> block is not "
                         "one JSON call per line)",
}


@dataclass
class Sample:
    """One prompt: the chat to complete and what the rewards check the completion against."""

    id: str
    family: str
    messages: list[dict[str, str]]
    ground_truth: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)

    def reward_truth(self) -> dict[str, Any]:
        """What a reward function receives as ``ground_truth``: the ground truth and the metadata."""
        return {**self.ground_truth, **self.metadata}


@dataclass(frozen=True)
class Fields:
    """Which fields of a row hold the prompt, the system message and the ground truth (None: defaults)."""

    prompt_key: str | None = None
    system_key: str | None = None
    ground_truth_key: str | None = None


def load_samples(path: str | Path, family: str, system_prompt: str | None = None, *, fields: Fields = Fields(),
                 split: str | None = None) -> list[Sample]:
    """Samples of ``family`` from a data file or dataset directory (see the module docstring).

    ``system_prompt`` replaces the family's instructions (``""``: add none); ``split`` picks
    a split of a dataset directory (default: ``train`` of a DatasetDict, all of a single
    dataset; see :func:`gdpo_megatron.data.readers.read_records`).
    """
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    samples, rows = [], 0
    left_out: dict[str, list[str]] = {}  # why -> line or row numbers
    for where, record in read_records(path, split):
        rows += 1
        try:
            samples.append(make_sample(record, family, f"{Path(path).stem}-{where.number}", where,
                                       system_prompt, fields))
        except (EmptyGroundTruth, UnscorableReference) as e:
            left_out.setdefault(_LEFT_OUT_BECAUSE[type(e)], []).append(str(where.number))
    summary = ""
    if left_out:
        count = sum(map(len, left_out.values()))
        reasons = "; ".join(f"{why}: {where.unit}s {', '.join(numbers)}" for why, numbers in left_out.items())
        summary = f"left out {count} of {rows} rows, {reasons}"
    if not samples:
        raise ValueError(f"dataset {path} has no samples" + (f": {summary}" if summary else ""))
    if summary:
        warnings.warn(f"{path}: {summary}", stacklevel=2)
    return samples


def make_sample(record: dict, family: str, default_id: str, where: Where | str, system_prompt: str | None = None,
                fields: Fields = Fields()) -> Sample:
    """A :class:`Sample` from one row (``where`` names it in error messages).

    Raises ValueError naming ``where`` for a malformed row; :class:`EmptyGroundTruth` or
    :class:`UnscorableReference` for a row without a usable ground truth.
    """
    record = dict(record)
    messages, reference = _prompt(record, fields, where)
    ground_truth = _ground_truth(record, family, fields.ground_truth_key, reference, where)
    instructions = _system_prompt(family, ground_truth) if system_prompt is None else system_prompt
    if instructions and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{instructions}"}
    elif instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    sample_id = str(record.pop("id", default_id))
    metadata = {k: v for k, v in record.items() if k not in ground_truth}
    return Sample(sample_id, family, messages, ground_truth, metadata)


def _prompt(record: dict, fields: Fields, where: Where | str) -> tuple[list[dict[str, str]], str | None]:
    """The chat to complete, and the final assistant message it came with (if any); pops the fields."""
    if fields.prompt_key is not None:
        key = fields.prompt_key
        if _lookup(record, key) is _MISSING:
            raise ValueError(f"{where}: no prompt field {key!r} (data.prompt_key)")
    else:
        key = next((k for k in PROMPT_KEYS if record.get(k) is not None), None)
        if key is None:
            raise ValueError(f"{where}: expected a prompt in one of {', '.join(map(repr, PROMPT_KEYS))} "
                             f"(or set data.prompt_key); fields: {sorted(record)}")
    prompt = _pop(record, key)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"{where}: {key!r} must be a string or a non-empty list of {{'role': str, 'content': str}}")
    reference = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    if not messages:
        raise ValueError(f"{where}: {key!r} holds only an assistant message, no prompt")
    if fields.system_key is not None:
        system = _pop(record, fields.system_key)
        if not isinstance(system, str):
            raise ValueError(f"{where}: the system message field {fields.system_key!r} (data.system_key) must be "
                             f"a string, got {'nothing' if system is _MISSING else type(system).__name__}")
        if messages[0]["role"] == "system":
            raise ValueError(f"{where}: {key!r} already starts with a system message; data.system_key "
                             f"{fields.system_key!r} would add a second")
        messages.insert(0, {"role": "system", "content": system})
    return messages, reference


def _ground_truth(record: dict, family: str, key: str | None, reference: str | None, where: Where | str) -> dict:
    """The family's ground truth from the row (popping the fields used); checks it."""
    keys = (key,) if key is not None else GROUND_TRUTH_KEYS[family]
    present = [k for k in keys if _lookup(record, k) is not _MISSING]
    found = next((k for k in present if _lookup(record, k) is not None), present[0] if present else None)
    if found is not None:
        value = _pop(record, found)
    elif reference is not None and key is None and family in ("math", "toolrl"):
        found, value = "the final assistant message", reference
    else:
        tried = " or ".join(map(repr, keys)) + (" or a final assistant message" if family in ("math", "toolrl")
                                                 and key is None else "")
        raise ValueError(f"{where}: missing the {family} ground truth {tried}"
                         + ("" if key is not None else " (or set data.ground_truth_key)"))
    if family == "math":
        if value is None or (isinstance(value, str) and not value.strip()):
            raise EmptyGroundTruth(f"{where}: {found!r} (the answer) is empty")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: {found!r} (the answer) must be a string or a number, got {value!r}")
        return {"answer": value}
    if family == "toolrl":
        if value is None:
            raise EmptyGroundTruth(f"{where}: {found!r} (the reference answer) is empty")
        if not isinstance(value, str):
            raise ValueError(f"{where}: {found!r} (ToolRL's reference answer) must be a string, "
                             f"got {type(value).__name__}")
        parse_reference(value)  # raises UnscorableReference
        return {"answer": value}
    if family == "tool":
        truth = {"tool_calls": value}
        if "tools" in record:
            truth["tools"] = record.pop("tools")
        _check_tool_calls(truth, found, where)
        return truth
    if isinstance(value, list):
        _check_tests(value, found, where)
        return {"tests": value}
    try:
        return {"tests": tests_from_input_output(value)}
    except ValueError as e:
        raise ValueError(f"{where}: {found!r}: {e}") from None


def _check_tool_calls(truth: dict, key: str, where: Where | str) -> None:
    calls = truth["tool_calls"]
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str)
        and (isinstance(c.get("arguments"), dict) or isinstance(c.get("accepted"), dict))
        for c in calls
    ):
        raise ValueError(f"{where}: {key!r} must be a list of {{'name': str, 'arguments': dict}}")
    if not isinstance(truth.get("tools", []), list):
        raise ValueError(f"{where}: 'tools' must be a list of function schemas")


def _check_tests(tests: list, key: str, where: Where | str) -> None:
    if not tests or not all(
        isinstance(t, dict) and (("input" in t and "output" in t) or "assert" in t) for t in tests
    ):
        raise ValueError(f"{where}: {key!r} must be a non-empty list of {{'input', 'output'}} or {{'assert'}}")


def _system_prompt(family: str, truth: dict) -> str:
    if family == "math":
        return MATH_SYSTEM_PROMPT
    if family == "code":
        return CODE_SYSTEM_PROMPT
    if family == "toolrl":
        return ""
    tools = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in truth.get("tools", []))
    return TOOL_SYSTEM_PROMPT.format(tools=tools)


_MISSING = object()


def _lookup(record: dict, dotted: str) -> Any:
    """The value of field ``a.b.c`` (a flattened column of that name, else nested dicts), or ``_MISSING``."""
    if dotted in record:
        return record[dotted]
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _pop(record: dict, dotted: str) -> Any:
    """Remove and return the value :func:`_lookup` finds (copying the dicts on the way), or ``_MISSING``."""
    if dotted in record:
        return record.pop(dotted)
    *parents, last = dotted.split(".")
    node = record
    for part in parents:
        if not isinstance(node.get(part), dict):
            return _MISSING
        node[part] = dict(node[part])
        node = node[part]
    return node.pop(last, _MISSING)

