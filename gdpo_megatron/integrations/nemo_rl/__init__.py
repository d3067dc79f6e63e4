"""This project's GDPO inside NeMo-RL: the advantage estimator, its diagnostics in NeMo-RL's
logs, the reward stage as a NeMo-RL environment, multi-turn episodes through this project's
environments, and the prompt files as NeMo-RL data.

Nothing here imports NeMo-RL or Ray at import time; ``install`` and the environment's Ray
actor class import them when used. The interfaces were read from NeMo-RL at commit
``7ea279abfbeb698b092856d0dab61e7cf39bc909`` (see the README).
"""
from gdpo_megatron.integrations.nemo_rl.data import multi_turn_prompt_processor, prompt_processor, write_response_jsonl
from gdpo_megatron.integrations.nemo_rl.environment import RewardStageEnvironment
from gdpo_megatron.integrations.nemo_rl.estimator import (GDPOMegatronEstimator, install, last_built_estimator,
                                                          prompt_groups, reward_names)
from gdpo_megatron.integrations.nemo_rl.metrics import DiagnosticsLogger
from gdpo_megatron.integrations.nemo_rl.multi_turn import MultiTurnEnvironment

__all__ = [
    "DiagnosticsLogger",
    "GDPOMegatronEstimator",
    "MultiTurnEnvironment",
    "RewardStageEnvironment",
    "install",
    "last_built_estimator",
    "multi_turn_prompt_processor",
    "prompt_groups",
    "prompt_processor",
    "reward_names",
    "write_response_jsonl",
]
