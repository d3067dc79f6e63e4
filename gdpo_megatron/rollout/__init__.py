"""Rollouts: sampling settings and completions, and the colocated vLLM engine."""
from gdpo_megatron.rollout.engine import Completion, SamplingConfig
from gdpo_megatron.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

__all__ = ["Completion", "SamplingConfig", "VLLMEngine", "VLLMEngineConfig"]
