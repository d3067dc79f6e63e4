"""Sampling and the colocated rollout engine (:mod:`gdpo_megatron.rollout.factory` builds the one
``engine`` names; vLLM, :mod:`gdpo_megatron.rollout.vllm_engine`, is the only one today)."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Literal, Optional

from gdpo_megatron.config.loader import require, section

# vLLM's SamplingParams refuses a temperature above 2 and raises one in (0, 0.01) to 0.01,
# which the policy, dividing its logits by the configured value, would not match.
TEMPERATURE_RANGE = (0.01, 2.0)


@section
class RolloutConfig:
    """How completions are sampled, and how the engine is laid out and sized."""

    engine: Literal["vllm"] = "vllm"  # which rollout engine (rollout/factory.py); the keys below are vLLM's
    group_size: int = 8  # completions per prompt (G); GDPO and GRPO normalize inside the group
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = dataclasses.field(default_factory=list)
    tensor_parallel_size: int = 1  # vLLM's own TP; may differ from the policy's
    gpu_memory_utilization: float = 0.5  # unused on GPU when kv_cache_gib is set (derived from it)
    kv_cache_gib: Optional[float] = None  # null: vLLM's sizing on GPU, one step's rollouts on CPU
    max_model_len: int = 2048
    enforce_eager: Optional[bool] = None  # null: eager on CPU, CUDA graphs on GPU
    # Prompt and decode tokens vLLM schedules in one engine step. null: vLLM's default; on the
    # CPU, where a prompt's prefill is never split over steps, at least max_model_len.
    max_num_batched_tokens: Optional[int] = None
    # vLLM's sleep level while the policy trains. 2: the weights are discarded, and the weight
    # sync after each update loads every one (checked); 1: they are copied to pinned host memory
    # and back each step, only to be overwritten by the sync.
    sleep_level: Literal[1, 2] = 2
    quantization: Optional[Literal["fp8"]] = None  # FP8 rollouts on GPU

    def __post_init__(self):
        require(self.group_size >= 2, "rollout.group_size",
                ">= 2 (advantages compare the completions of a prompt; one alone gets advantage 0)", self.group_size)
        low, high = TEMPERATURE_RANGE
        require(low <= self.temperature <= high, "rollout.temperature",
                f"> 0 (training samples; gdpo-eval is greedy) and in [{low}, {high:g}] (vLLM refuses more and "
                f"raises less to {low})", self.temperature)
        require(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        require(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", "-1 (off) or >= 1", self.top_k)
        if self.top_p < 1 or self.top_k > 0:
            warnings.warn("rollout.top_p / rollout.top_k: the policy's logprobs do not truncate the "
                          "distribution, so the importance ratio of the first update is biased")
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.max_model_len > self.max_new_tokens, "rollout.max_model_len",
                f"> max_new_tokens={self.max_new_tokens}", self.max_model_len)
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "in (0, 1]",
                self.gpu_memory_utilization)
        require(self.kv_cache_gib is None or self.kv_cache_gib > 0, "rollout.kv_cache_gib", "> 0 or null",
                self.kv_cache_gib)
        require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                "rollout.max_num_batched_tokens", ">= 1 or null", self.max_num_batched_tokens)
