"""gdpo-megatron: multi-reward RL (GDPO) for language models on Megatron-core."""
from gdpo_megatron.advantages import AdvantageResult, Condition, compute_advantages

__all__ = ["AdvantageResult", "Condition", "compute_advantages"]
__version__ = "0.1.0"
