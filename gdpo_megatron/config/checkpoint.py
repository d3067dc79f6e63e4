"""Where and how often a run saves, and what it resumes from."""
from __future__ import annotations

from typing import Literal, Union

from gdpo_megatron.config.loader import require, section


@section
class CheckpointConfig:
    """Checkpoints under ``run_dir/checkpoints``; a rerun resumes from the latest complete one."""

    save_every: int = 0  # steps; 0: only at the end
    keep_last: int = 2
    # A run directory with checkpoints: true resumes it when its settings are this config's
    # (those that change what it trains), false refuses it, "force" resumes it under this config.
    resume: Union[bool, Literal["force"]] = True
    export_hf: bool = True  # write a Hugging Face directory at the end
    # The distributed optimizer's state on disk (megatron-core's formats): "dp_reshardable"
    # resumes under another data-parallel size only, "fully_reshardable" under any TP/PP/DP
    # layout, at a cost in host memory: saving gathers the Adam state of each TP x PP shard
    # (12 bytes a parameter) on its data-parallel rank 0, loading reads it on every rank.
    # The plain optimizer's state and the weights reshard either way.
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"

    def __post_init__(self):
        require(self.save_every >= 0, "checkpoint.save_every", ">= 0", self.save_every)
        require(self.keep_last >= 1, "checkpoint.keep_last", ">= 1", self.keep_last)
