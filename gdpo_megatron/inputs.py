"""What a training run reads before anything is built: preflight gathers it, the trainer uses it."""
from __future__ import annotations

from dataclasses import dataclass

from gdpo_megatron.advantages import Condition
from gdpo_megatron.data.samples import Sample
from gdpo_megatron.config.policy import ModelConfig
from gdpo_megatron.resolve import Resolved


@dataclass
class TrainingInputs:
    """The data, the base model's shape, the resolved reward gates and the run resolved for this machine and world."""

    samples: list[Sample]
    hf_config: dict  # base_model/config.json
    model: ModelConfig  # the policy's shape, from hf_config
    conditions: list[Condition]  # advantage.conditions as reward columns
    resume_step: int  # the step of the run directory's checkpoint to resume from; 0: a new run
    resolved: Resolved  # the config for this machine, the launch's world size and the base model
