"""The typed configuration: one schema per owner, loaded from YAML plus dotted overrides.

``load_config(TrainConfig, "configs/tiny_cpu.yaml", ["policy.optim.lr=1e-5"])`` reads the
file, applies the overrides and builds the dataclasses, converting every value to its
annotation (a ``Literal`` lists the values a key takes). Each rule is checked once, here, and
a bad value raises :class:`ConfigError` naming the dotted key; a section built from Python
checks its values the same way. Values that depend on the machine (``"auto"``, ``null``) stay
as written; :func:`gdpo_megatron.resolve.resolve` decides them, once per run.

Sections: :mod:`.policy` (model shape, parallelism, precision, optimizer, loss),
:mod:`.rollout`, :mod:`.rewards`, :mod:`.advantage`, :mod:`.data`, :mod:`.checkpoint`,
:mod:`.distributed` (how long ranks wait for each other), :mod:`.environment` (a multi-turn
family's environment), and :mod:`.train` (the whole run). Of the rest of the package the
schema imports only :mod:`gdpo_megatron.errors` (a :class:`ConfigError` is a user error).
"""
from gdpo_megatron.config.advantage import AdvantageConfig, ConditionConfig
from gdpo_megatron.config.checkpoint import CheckpointConfig
from gdpo_megatron.config.data import DataConfig
from gdpo_megatron.config.distributed import DistributedConfig
from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.loader import ConfigError, apply_override, from_dict, load_config, read_yaml, to_dict
from gdpo_megatron.config.policy import (LossConfig, ModelConfig, OptimConfig, ParallelConfig, PolicyConfig,
                                         PrecisionConfig)
from gdpo_megatron.config.rewards import RewardsConfig, RewardSpec
from gdpo_megatron.config.rollout import RolloutConfig
from gdpo_megatron.config.train import LoggingConfig, TrainConfig

__all__ = [
    "AdvantageConfig", "CheckpointConfig", "ConditionConfig", "ConfigError", "DataConfig", "DistributedConfig",
    "EnvironmentConfig",
    "LoggingConfig", "LossConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "PolicyConfig", "PrecisionConfig",
    "RewardSpec", "RewardsConfig", "RolloutConfig", "TrainConfig", "apply_override", "from_dict", "load_config",
    "read_yaml", "to_dict",
]
