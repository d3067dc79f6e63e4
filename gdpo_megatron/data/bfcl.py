"""The Berkeley Function Calling Leaderboard (BFCL) as a tool-calling evaluation set.

Reads the question and possible-answer JSON files shipped in the ``bfcl-eval`` package
(only its data; its code is never imported) for the single-turn categories with possible
answers: ``simple``, ``multiple``, ``parallel``, ``parallel_multiple`` and their ``live_``
counterparts. Each possible answer lists the acceptable values of every argument, ``""``
marking one that may be omitted; with the question's function schemas it becomes the BFCL
form of ``tool_correctness``'s ground truth. A completion is correct when
``tool_correctness == 3``, which is BFCL's own checker's verdict (see
:mod:`gdpo_megatron.rewards.tool_call` for the one difference).
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from gdpo_megatron.data.samples import Sample, make_sample
from gdpo_megatron.environments.bfcl import bfcl_data_dir
from gdpo_megatron.rewards.tool_call import MAX_CORRECTNESS, tool_correctness

CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple",
              "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
# File stems by category, newest release first (v4 renamed "simple" to "simple_python").
_FILE_STEMS = {"simple": ("simple_python", "simple")}


def load_bfcl(
    categories: Sequence[str] = CATEGORIES, limit: int | None = None, data_dir: str | Path | None = None
) -> list[Sample]:
    """Tool samples of the given categories (at most ``limit`` per category)."""
    data_dir = Path(data_dir) if data_dir is not None else bfcl_data_dir()
    samples = []
    for category in categories:
        if category not in CATEGORIES:
            raise ValueError(f"BFCL category: expected one of {CATEGORIES}, got {category!r}")
        questions_path, answers_path = _category_files(data_dir, category)
        answers = {r["id"]: r["ground_truth"] for r in read_json_lines(answers_path)}
        for n, question in enumerate(read_json_lines(questions_path)):
            if limit is not None and n >= limit:
                break
            where = f"{questions_path}: id {question.get('id')!r}"
            if question["id"] not in answers:
                raise ValueError(f"{where}: no possible answer in {answers_path}")
            turns = question["question"]
            if len(turns) != 1:
                raise ValueError(f"{where}: expected a single-turn question, got {len(turns)} turns")
            record = {
                "id": question["id"],
                "messages": turns[0],
                "tools": question["function"],
                "tool_calls": [_accepted_call(call, where) for call in answers[question["id"]]],
                "category": category,
            }
            samples.append(make_sample(record, "tool", question["id"], where))
    return samples


def bfcl_accuracy(samples: Sequence[Sample], completions: Sequence[str]) -> dict[str, float]:
    """Share of exactly correct completions per category and over all samples, and how many
    prompts each share is of."""
    if len(samples) != len(completions):
        raise ValueError(f"bfcl_accuracy: {len(samples)} samples but {len(completions)} completions")
    correct, total = defaultdict(int), defaultdict(int)
    for sample, completion in zip(samples, completions):
        category = sample.metadata.get("category", "unknown")
        score = tool_correctness(completion, 0, sample.ground_truth)
        for key in (category, "overall"):
            total[key] += 1
            correct[key] += score == MAX_CORRECTNESS
    out = {f"eval/bfcl/{key}/accuracy": correct[key] / total[key] for key in total}
    out.update({f"eval/bfcl/{key}/prompts": float(total[key]) for key in total})
    return out


def _category_files(data_dir: Path, category: str) -> tuple[Path, Path]:
    """Question and possible-answer files of ``category``, from the newest BFCL release."""
    for stem in _FILE_STEMS.get(category, (category,)):
        pattern = re.compile(rf"BFCL_v(\d+)_{stem}\.json")
        found = [(int(m[1]), p) for p in data_dir.glob("BFCL_v*.json") if (m := pattern.fullmatch(p.name))]
        for _, questions in sorted(found, reverse=True):
            answers = data_dir / "possible_answer" / questions.name
            if answers.is_file():
                return questions, answers
    raise FileNotFoundError(f"no BFCL question and possible_answer files for category {category!r} in {data_dir}")


def read_json_lines(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _accepted_call(call: dict, where: str) -> dict:
    """``{name: {arg: [values]}}`` -> ``{"name": name, "accepted": {arg: [values]}}``."""
    if not (isinstance(call, dict) and len(call) == 1):
        raise ValueError(f"{where}: expected a possible answer {{name: {{arg: [values]}}}}, got {call!r}")
    (name, accepted), = call.items()
    return {"name": name, "accepted": accepted}
