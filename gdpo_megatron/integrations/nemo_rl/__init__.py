"""This project's GDPO inside NeMo-RL.

Nothing here imports NeMo-RL at import time; ``install`` imports it when called. The
interfaces were read from NeMo-RL at commit ``7ea279abfbeb698b092856d0dab61e7cf39bc909``.
"""
from gdpo_megatron.integrations.nemo_rl.estimator import (GDPOMegatronEstimator, install, last_built_estimator,
                                                          prompt_groups, reward_names)

__all__ = ["GDPOMegatronEstimator", "install", "last_built_estimator", "prompt_groups", "reward_names"]
