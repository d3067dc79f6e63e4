"""A training run: every section, and the rules that tie them together."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from gdpo_megatron.config.advantage import AdvantageConfig
from gdpo_megatron.config.checkpoint import CheckpointConfig
from gdpo_megatron.config.data import DataConfig
from gdpo_megatron.config.distributed import DistributedConfig
from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.loader import ConfigError, require, require_path, section
from gdpo_megatron.config.policy import PolicyConfig
from gdpo_megatron.config.rewards import RewardsConfig
from gdpo_megatron.config.rollout import RolloutConfig


@section
class LoggingConfig:
    wandb_project: Optional[str] = None  # None: JSONL only
    progress_bar: bool = True


@section
class TrainConfig:
    """Everything ``gdpo-train`` reads.

    The policy trains the shape of ``base_model/config.json``, seeded with ``seed``, and
    computes its logprobs at ``rollout.temperature``: those of the distribution the rollouts
    were sampled from.
    """

    run_dir: str
    base_model: str  # a Hugging Face directory; the policy's shape comes from its config.json
    data: DataConfig
    rewards: RewardsConfig
    steps: int = 100
    seed: int = 1234
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    environment: EnvironmentConfig = dataclasses.field(default_factory=EnvironmentConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        "dynamic_sampling": "advantage.filter (dynamic_sampling: true is advantage.filter: informative_groups)",
    }

    def __post_init__(self):
        require_path(self.run_dir, "run_dir")
        require_path(self.base_model, "base_model")
        require(self.steps >= 1, "steps", ">= 1", self.steps)
        names = self.rewards.names
        for i, condition in enumerate(self.advantage.conditions):
            for key in ("reward", "gate"):
                if getattr(condition, key) not in names:
                    raise ConfigError(f"advantage.conditions.{i}.{key}: {getattr(condition, key)!r} is not a "
                                      f"configured reward (rewards: {names})")
        longest = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        require(longest <= self.rollout.max_model_len, "rollout.max_model_len",
                f">= data.max_prompt_tokens + rollout.max_new_tokens = {longest}", self.rollout.max_model_len)
