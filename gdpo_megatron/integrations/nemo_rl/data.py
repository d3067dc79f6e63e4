"""This project's prompt files as NeMo-RL data: a JSONL its ``ResponseDataset`` loads, and
the data processor that turns one of its rows into NeMo-RL's ``DatumSpec``.

:func:`write_response_jsonl` reads a prompt file of a task family the way the trainer does
(:func:`gdpo_megatron.data.samples.load_samples`: JSONL, JSON, parquet or a ``datasets``
directory; the family's instructions, e.g. the tool schemas, go into the system message) and writes one row per sample::

    {"id": ..., "messages": [{"role": "system", ...}, {"role": "user", ...}], "ground_truth": "<JSON>"}

The ground truth travels as a JSON string: NeMo-RL loads the file with Hugging Face
``datasets`` into Arrow columns, and a string reaches the environment exactly as written
whatever type a ``datasets`` release would infer for differently shaped dicts (tool
arguments). :func:`prompt_processor` (register it with
``nemo_rl.data.processors.register_processor``) renders the chat with the tokenizer's
template and decodes the ground truth into ``extra_env_info``, which NeMo-RL hands to the
environment's ``step`` as its ``metadata``.

Multi-turn rows (families ``multi_turn`` and ``bfcl_multi_turn``: the first user turn is the
prompt, the ground truth holds the environment config, the reference calls and the later user
turns) are written the same way; :func:`multi_turn_prompt_processor` gives them the
``extra_env_info`` that :class:`~gdpo_megatron.integrations.nemo_rl.MultiTurnEnvironment`
takes: ``{"ground_truth": ..., "messages": [the prompt's chat]}`` (the environment renders
later messages under the chat template after these).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from gdpo_megatron.data.chat import encode_prompt, render_prompt
from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.tasks.multi_turn import FIELDS as MULTI_TURN_FIELDS

MIN_TRUNCATED_TOKENS = 4  # what NeMo-RL's processors keep of an over-long prompt


def write_response_jsonl(src: str | Path, family: str, dst: str | Path, system_prompt: str | None = None) -> int:
    """Write the samples of ``src`` (a prompt file of ``family``) to ``dst``; return how many.

    ``dst`` appears complete or not at all (written under a temporary name, then renamed).
    """
    samples = load_samples(src, family, system_prompt)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for s in samples:
            truth = json.dumps(s.reward_truth(), ensure_ascii=False)
            f.write(json.dumps({"id": s.id, "messages": s.messages, "ground_truth": truth}, ensure_ascii=False) + "\n")
    os.replace(tmp, dst)
    return len(samples)


def prompt_processor(datum_dict: dict, task_data_spec: Any, tokenizer: Any, max_seq_length: int, idx: int) -> dict:
    """A NeMo-RL ``DatumSpec`` for one row of :func:`write_response_jsonl` (NeMo-RL's
    processor signature). A prompt of ``max_seq_length`` tokens or more is cut to a few
    tokens and masked out (``loss_multiplier`` 0), as NeMo-RL's own processors do."""
    where = _where(datum_dict, idx)
    for attr, key in (("system_prompt", "system_prompt_file"), ("prompt", "prompt_file")):
        if getattr(task_data_spec, attr, None):
            raise ValueError(f"data {key}: the rows of write_response_jsonl carry their own instructions; "
                             f"set {key} to null")
    for key in ("messages", "ground_truth"):
        if key not in datum_dict:
            raise ValueError(f"{where}: no {key!r}; write the data with write_response_jsonl")
    truth = json.loads(datum_dict["ground_truth"])
    if not isinstance(truth, dict):
        raise ValueError(f"{where}: 'ground_truth' must encode a JSON object, got {type(truth).__name__}")
    messages = _chat(datum_dict)
    token_ids = torch.tensor(encode_prompt(tokenizer, messages), dtype=torch.int64)
    loss_multiplier = 1.0
    if len(token_ids) >= max_seq_length:
        token_ids = token_ids[: min(MIN_TRUNCATED_TOKENS, max_seq_length)]
        loss_multiplier = 0.0
    return {
        "message_log": [{"role": "user", "content": render_prompt(tokenizer, messages), "token_ids": token_ids}],
        "length": len(token_ids),  # of the tokens kept: NeMo-RL finds the prompt in the log by it
        "extra_env_info": truth,
        "loss_multiplier": loss_multiplier,
        "idx": idx,
        "task_name": datum_dict["task_name"],
    }


def multi_turn_prompt_processor(datum_dict: dict, task_data_spec: Any, tokenizer: Any, max_seq_length: int,
                                idx: int) -> dict:
    """:func:`prompt_processor` for a multi-turn row: its ``extra_env_info`` is ``{"ground_truth",
    "messages"}``, what :class:`~gdpo_megatron.integrations.nemo_rl.MultiTurnEnvironment` starts
    an episode from."""
    datum = prompt_processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx)
    truth = datum["extra_env_info"]
    missing = sorted(MULTI_TURN_FIELDS - truth.keys())
    if missing:
        raise ValueError(f"{_where(datum_dict, idx)}: the ground truth has no {', '.join(missing)}; write the data "
                         "with write_response_jsonl of a multi-turn family (multi_turn, bfcl_multi_turn)")
    datum["extra_env_info"] = {"ground_truth": truth, "messages": _chat(datum_dict)}
    return datum


def _where(datum_dict: dict, idx: int) -> str:
    return f"row {idx}" + (f" ({datum_dict['id']})" if "id" in datum_dict else "")


def _chat(datum_dict: dict) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in datum_dict["messages"]]
