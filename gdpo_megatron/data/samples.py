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
  in verl's ``reward_model.ground_truth``, or name a flattened column), by default the first
  present of the family's fields, else, for a family that allows it (``math``, ``toolrl``),
  the chat's final assistant message. The family (:mod:`gdpo_megatron.tasks`) says which
  fields, what the value becomes (the ``ground_truth`` its rewards receive) and which values
  leave the row out.
* **Instructions**: the family's (the answer format; for ``tool`` also the function schemas)
  are added to the system message, unless ``system_prompt`` replaces them (``""``: none).
  ToolRL's prompts carry their own, so ``toolrl`` adds none by default.

Every other field is kept as metadata, except fields named like a key of the sample's ground
truth (e.g. ``answer``), which would shadow it; ``id`` defaults to ``<file stem>-<line or row>``.
Malformed rows are one error, :class:`BadRows`, naming the file and the line or row of each
(the first :data:`LISTED_BAD_ROWS`, and how many in all). Rows that hold no usable
ground truth (:class:`~gdpo_megatron.tasks.UnusableGroundTruth`: a ``math`` row whose answer
is null or blank, a ``toolrl`` row whose reference is null or one ToolRL's reward cannot
parse) are left out and named in one warning.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gdpo_megatron.data.readers import Where, read_records
from gdpo_megatron.tasks import Task, UnusableGroundTruth, get_task

PROMPT_KEYS = ("messages", "prompt", "problem", "question")
LISTED_BAD_ROWS = 20  # the malformed rows an error names one by one; the rest are counted


class BadRows(ValueError):
    """The malformed rows of a data file: one line each for the first :data:`LISTED_BAD_ROWS`,
    then one line with how many more."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path, self.listed, self.count = str(path), [], 0

    def add(self, error: ValueError) -> None:
        self.count += 1
        if len(self.listed) < LISTED_BAD_ROWS:
            self.listed.append(" ".join(str(error).split()))

    def lines(self) -> list[str]:
        more = self.count - len(self.listed)
        return self.listed + ([f"{self.path}: {more} more malformed rows (the first {len(self.listed)} are "
                               "listed above)"] if more else [])

    def __str__(self) -> str:
        return "\n".join(self.lines())


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
    """Samples of task ``family`` from a data file or dataset directory (see the module docstring).

    ``system_prompt`` replaces the family's instructions (``""``: add none); ``split`` picks
    a split of a dataset directory (default: ``train`` of a DatasetDict, all of a single
    dataset; see :func:`gdpo_megatron.data.readers.read_records`).
    """
    task = get_task(family)
    samples, rows, bad = [], 0, BadRows(path)
    left_out: dict[str, list[str]] = {}  # why -> line or row numbers
    for where, record in read_records(path, split, bad.add):
        rows += 1
        try:
            samples.append(_make_sample(record, task, f"{Path(path).stem}-{where.number}", where,
                                        system_prompt, fields))
        except UnusableGroundTruth as e:
            left_out.setdefault(e.why, []).append(str(where.number))
        except ValueError as e:
            bad.add(e)
    if bad.count:
        raise bad
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
    """A :class:`Sample` of task ``family`` from one row (``where`` names it in error messages).

    Raises ValueError naming ``where`` for a malformed row; :class:`~gdpo_megatron.tasks.UnusableGroundTruth`
    for a row without a usable ground truth.
    """
    return _make_sample(record, get_task(family), default_id, where, system_prompt, fields)


def _make_sample(record: dict, task: Task, default_id: str, where: Where | str, system_prompt: str | None,
                 fields: Fields) -> Sample:
    record = dict(record)
    messages, reference = _prompt(record, fields, where)
    ground_truth = _ground_truth(record, task, fields.ground_truth_key, reference, where)
    instructions = task.instructions(ground_truth) if system_prompt is None else system_prompt
    if instructions and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{instructions}"}
    elif instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    sample_id = str(record.pop("id", default_id))
    metadata = {k: v for k, v in record.items() if k not in ground_truth}
    return Sample(sample_id, task.name, messages, ground_truth, metadata)


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


def _ground_truth(record: dict, task: Task, key: str | None, reference: str | None, where: Where | str) -> dict:
    """The task's ground truth from the row (popping the fields used); checked by the task."""
    keys = (key,) if key is not None else task.ground_truth_keys
    present = [k for k in keys if _lookup(record, k) is not _MISSING]
    found = next((k for k in present if _lookup(record, k) is not None), present[0] if present else None)
    from_chat = key is None and task.reference_in_chat
    if found is not None:
        value = _pop(record, found)
    elif reference is not None and from_chat:
        found, value = "the final assistant message", reference
    else:
        tried = " or ".join(map(repr, keys)) + (" or a final assistant message" if from_chat else "")
        raise ValueError(f"{where}: missing the {task.name} ground truth {tried}"
                         + ("" if key is not None else " (or set data.ground_truth_key)"))
    return task.parse_ground_truth(value, found, record, str(where))


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

