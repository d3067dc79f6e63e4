"""Which rollout engine ``rollout.engine`` names, and building it.

:data:`ENGINES` maps each value of ``rollout.engine`` to its
:class:`~gdpo_megatron.rollout.engine.RolloutEngine` class. Code that needs an engine, or what
one needs before it exists (memory, whether it loads a checkpoint), asks here for the class
and never names an engine itself.
"""
from __future__ import annotations

from gdpo_megatron.config.rollout import RolloutConfig
from gdpo_megatron.device import Machine
from gdpo_megatron.rollout.engine import RolloutEngine
from gdpo_megatron.rollout.vllm_engine import VLLMEngine

ENGINES: dict[str, type[RolloutEngine]] = {"vllm": VLLMEngine}
# The engine of a command that takes no config (gdpo-eval): rollout.engine's default.
DEFAULT_ENGINE: str = RolloutConfig.engine


def engine_class(name: str) -> type[RolloutEngine]:
    """The class of engine ``name`` (a value of ``rollout.engine``)."""
    return ENGINES[name]


def build_engine(rollout: RolloutConfig, model_path: str, machine: Machine, seed: int = 0) -> RolloutEngine:
    """The engine ``rollout.engine`` names on ``machine``, laid out and sized as ``rollout`` says
    (its ``kv_cache_gib`` is the cache to build: see ``RolloutEngine.kv_cache_gib``), loaded
    from the Hugging Face checkpoint ``model_path``."""
    return engine_class(rollout.engine).build(rollout, model_path, machine, seed)

