"""BFCL's multi-turn questions as rows and samples of the ``bfcl_multi_turn`` family.

Reads the questions and possible answers of the categories ``base``, ``long_context``,
``miss_func`` and ``miss_param`` shipped in the ``bfcl-eval`` package (its data only) and makes
each a row in the family's layout (:mod:`gdpo_megatron.tasks.bfcl_multi_turn`): ``messages``
(the first user turn), ``multi_turn`` (the environment config, the reference calls, the later
user turns) and ``category``. Written as JSON Lines, the rows are read by the normal data path
(``data.family: bfcl_multi_turn``). A miss_func turn that only reveals functions becomes BFCL's
prompting message: the functions' docs, then "I have updated some more functions you can choose
from. What about now?".

**Held-out split.** The four categories are variants of the same 200 scenarios
(``multi_turn_<category>_<n>``), so the split is by scenario number ``n``, never by row: ``n``
is held out when the SHA-256 of ``"bfcl_multi_turn:<n>"`` read as a big-endian integer is
divisible by 5 (:func:`split_of`; about a fifth of the scenarios), the same for every
category, machine and release.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Sequence

from gdpo_megatron.data.bfcl import read_json_lines
from gdpo_megatron.data.samples import Sample, make_sample
from gdpo_megatron.environments.bfcl import bfcl_data_dir, function_docs
from gdpo_megatron.tasks import UnusableGroundTruth

CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
SPLITS = ("train", "heldout")
ADDED_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"


def split_of(question_id: str) -> str:
    """``"heldout"`` or ``"train"`` for a question ``multi_turn_<category>_<n>`` (by ``n``)."""
    number = question_id.rsplit("_", 1)[-1]
    if not number.isdigit():
        raise ValueError(f"BFCL multi-turn question id {question_id!r} does not end in a scenario number")
    digest = hashlib.sha256(f"bfcl_multi_turn:{int(number)}".encode()).digest()
    return "heldout" if int.from_bytes(digest, "big") % 5 == 0 else "train"


def bfcl_multi_turn_rows(categories: Sequence[str] = CATEGORIES, split: str | None = None,
                         data_dir: str | Path | None = None) -> list[dict]:
    """The rows of ``categories`` (all, or those of ``split``), in file order."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"BFCL multi-turn split: expected one of {SPLITS}, got {split!r}")
    data_dir = Path(data_dir) if data_dir is not None else bfcl_data_dir()
    rows = []
    for category in categories:
        if category not in CATEGORIES:
            raise ValueError(f"BFCL multi-turn category: expected one of {CATEGORIES}, got {category!r}")
        name = f"BFCL_v4_multi_turn_{category}.json"
        answers = {r["id"]: r["ground_truth"] for r in read_json_lines(data_dir / "possible_answer" / name)}
        for question in read_json_lines(data_dir / name):
            if split is None or split_of(question["id"]) == split:
                rows.append(_row(question, answers[question["id"]], category))
    return rows


def load_bfcl_multi_turn(categories: Sequence[str] = CATEGORIES, split: str | None = None,
                         data_dir: str | Path | None = None, limit: int | None = None) -> list[Sample]:
    """Samples of the rows (at most ``limit`` per category); questions whose reference calls do
    not fit are left out, named in one warning."""
    samples, left_out, taken = [], [], dict.fromkeys(categories, 0)
    for row in bfcl_multi_turn_rows(categories, split, data_dir):
        if limit is not None and taken[row["category"]] >= limit:
            continue
        try:
            samples.append(make_sample(row, "bfcl_multi_turn", row["id"], row["id"]))
            taken[row["category"]] += 1
        except UnusableGroundTruth:
            left_out.append(row["id"])
    if left_out:
        warnings.warn(f"BFCL multi-turn: left out {len(left_out)} questions whose reference calls do not fit their "
                      f"functions: {', '.join(left_out)}", stacklevel=2)
    return samples


def _row(question: dict, reference: list[list[str]], category: str) -> dict:
    missed = question.get("missed_function") or {}
    turns = []
    for t, messages in enumerate(question["question"]):
        if not messages and str(t) in missed:
            docs = [doc for cls in question["involved_classes"] for doc in function_docs(cls)
                    if doc["name"] in missed[str(t)]]
            shown = json.dumps(docs, ensure_ascii=False)
            messages = [{"role": "user", "content": f"{shown}\n{ADDED_FUNCTIONS_PROMPT}"}]
        turns.append(messages)
    return {
        "id": question["id"],
        "messages": turns[0],
        "multi_turn": {
            "environment_config": {
                "involved_classes": question["involved_classes"],
                "initial_config": question["initial_config"],
                "long_context": category == "long_context",
                "excluded_functions": question.get("excluded_function") or [],
                "missed_functions": missed,
            },
            "reference_calls": reference,
            "later_turns": turns[1:],
        },
        "category": category,
    }

