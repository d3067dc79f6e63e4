"""Rollouts: the engine contract and its data (sampling settings, completions), the factory that
builds the engine ``rollout.engine`` names, and the colocated vLLM engine."""
from gdpo_megatron.rollout.engine import Completion, PrefixCacheCounts, RolloutEngine, SamplingConfig
from gdpo_megatron.rollout.factory import build_engine, engine_class
from gdpo_megatron.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

__all__ = ["Completion", "PrefixCacheCounts", "RolloutEngine", "SamplingConfig", "VLLMEngine", "VLLMEngineConfig",
           "build_engine", "engine_class"]
