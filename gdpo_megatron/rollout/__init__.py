"""Rollout engines: the interface and the colocated vLLM engine."""
from gdpo_megatron.rollout.engine import Completion, RolloutEngine, SamplingConfig
from gdpo_megatron.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "VLLMEngine", "VLLMEngineConfig"]
