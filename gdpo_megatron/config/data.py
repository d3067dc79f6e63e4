"""Prompt data of one task family, in a published layout (:mod:`gdpo_megatron.data.samples`)."""
from __future__ import annotations

from typing import Optional

from gdpo_megatron.config.loader import require, require_path, section


@section
class DataConfig:
    """Where the prompts are, which fields hold what, and how many a step takes."""

    train_path: str  # .jsonl, .json, .parquet, or a Hugging Face datasets directory (save_to_disk)
    # A task family's name (math, tool, code, toolrl: gdpo_megatron.tasks.registry, which
    # preflight checks it against before the data is read).
    family: str
    # The split of a datasets directory; None: "train" of a DatasetDict, all of a single dataset.
    split: Optional[str] = None
    # Field names, as verl's data.prompt_key; dotted names reach into nested fields. None: the
    # usual ones (messages / prompt / problem / question; the family's ground-truth fields).
    prompt_key: Optional[str] = None
    system_key: Optional[str] = None  # a field holding the system message (ToolRL's SFT set: instruction)
    ground_truth_key: Optional[str] = None
    # Instructions added to each chat's system message: None, the family's own (answer format,
    # tool schemas; none for toolrl, whose prompts carry ToolRL's); "" none.
    system_prompt: Optional[str] = None
    prompts_per_step: int = 8  # over all data-parallel ranks
    max_prompt_tokens: int = 512
    shuffle_seed: int = 0

    def __post_init__(self):
        require_path(self.train_path, "data.train_path")
        require(self.prompts_per_step >= 1, "data.prompts_per_step", ">= 1", self.prompts_per_step)
        require(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", ">= 1", self.max_prompt_tokens)
        for key in ("prompt_key", "system_key", "ground_truth_key"):
            value = getattr(self, key)
            require(value is None or (value and all(value.split("."))), f"data.{key}",
                    "a field name (dotted for nested fields) or null", value)
