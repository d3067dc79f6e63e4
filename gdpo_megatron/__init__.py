"""gdpo-megatron: multi-reward RL (GDPO) for language models on Megatron-core.

The advantage API is imported on first use, so that ``import gdpo_megatron.<module>`` does
not import torch (the CLI decides how to start the process before torch is loaded).
"""
__all__ = ["AdvantageConfig", "AdvantageResult", "Condition", "compute_advantages"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "AdvantageConfig":
        from gdpo_megatron.config.advantage import AdvantageConfig

        return AdvantageConfig
    if name in __all__:
        from gdpo_megatron import advantages

        return getattr(advantages, name)
    raise AttributeError(f"module 'gdpo_megatron' has no attribute {name!r}")
