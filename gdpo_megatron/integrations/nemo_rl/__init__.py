"""This project's GDPO inside NeMo-RL: the advantage estimator, its diagnostics in NeMo-RL's
logs, the reward stage as a NeMo-RL environment, and the prompt files as NeMo-RL data.

Nothing here imports NeMo-RL or Ray at import time; ``install`` and the environment's Ray
actor class import them when used. The interfaces were read from NeMo-RL at commit
``7ea279abfbeb698b092856d0dab61e7cf39bc909`` (see the README).
"""
from gdpo_megatron.integrations.nemo_rl.data import prompt_processor, write_response_jsonl
from gdpo_megatron.integrations.nemo_rl.environment import RewardStageEnvironment
from gdpo_megatron.integrations.nemo_rl.estimator import (GDPOMegatronEstimator, install, last_built_estimator,
                                                          prompt_groups, reward_names)
from gdpo_megatron.integrations.nemo_rl.metrics import DiagnosticsLogger

__all__ = [
    "DiagnosticsLogger",
    "GDPOMegatronEstimator",
    "RewardStageEnvironment",
    "install",
    "last_built_estimator",
    "prompt_groups",
    "prompt_processor",
    "reward_names",
    "write_response_jsonl",
]
