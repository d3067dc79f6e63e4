"""Evaluate a Hugging Face checkpoint: completions scored by rewards or by BFCL's checker.

Completions are sampled as ``sampling`` says (temperature 0: greedy) by the rollout engine
the trainer uses (``rollout.engine``'s default, one rank), each seeded on its own. Prompts
longer than the context left for the answer are skipped and counted, never cut. The engine's
KV cache is ``kv_cache_gib`` where given, else the engine's size for the evaluation (on the
CPU: every evaluated prompt at once, each up to the longest one plus ``max_new_tokens``; on
GPU the engine's own sizing: see ``RolloutEngine.kv_cache_gib``), never a share of the host.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from gdpo_megatron.config.policy import ModelConfig
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.config.rollout import RolloutConfig
from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.data.samples import Sample
from gdpo_megatron.device import Machine
from gdpo_megatron.rollout.engine import SamplingConfig


def fits(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt of ``prompt_tokens`` leaves room for a full answer: those that do not are skipped."""
    return prompt_tokens + max_new_tokens <= max_model_len


def engine_section(model: ModelConfig, machine: Machine, prompt_tokens: Sequence[int], max_new_tokens: int,
                   max_model_len: int, kv_cache_gib: float | None = None) -> RolloutConfig:
    """The rollout section the engine is built from: ``rollout.engine``'s default, one rank, the
    context ``max_model_len`` and a KV cache of ``kv_cache_gib`` GiB, else the engine's size for
    all the prompts (of ``prompt_tokens`` tokens each) generating ``max_new_tokens`` at once."""
    from gdpo_megatron.resolve import resolve_engine

    rollout = RolloutConfig(max_new_tokens=max_new_tokens, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib)
    return resolve_engine(rollout, model, machine, len(prompt_tokens), max(prompt_tokens) + max_new_tokens)


def evaluate(model_dir: str | Path, samples: Sequence[Sample], rewards: Sequence[RewardSpec] = (), *,
             machine: Machine, model: ModelConfig, sampling: SamplingConfig, max_model_len: int = 2048,
             kv_cache_gib: float | None = None, bfcl: bool = False, num_workers: int = 2,
             allow_weaker_sandbox: bool = False) -> tuple[dict[str, float], list[str]]:
    """Metrics (``eval/...``) and the completions of the samples that fit (in order).

    ``model``: the checkpoint's shape (what its KV cache holds per token); ``sampling``: how
    completions are drawn; ``allow_weaker_sandbox`` as the reward stage takes it; the engine
    runs on ``machine`` (this one)."""
    from transformers import AutoTokenizer

    from gdpo_megatron.data.bfcl import bfcl_accuracy
    from gdpo_megatron.rewards.stage import RewardStage
    from gdpo_megatron.rollout.factory import build_engine

    max_new_tokens = sampling.max_new_tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # the files the engine loads its tokenizer from
    encoded = [(s, encode_prompt(tokenizer, s.messages)) for s in samples]
    kept = [(s, ids) for s, ids in encoded if fits(len(ids), max_new_tokens, max_model_len)]
    metrics = {"eval/prompts": float(len(kept)), "eval/skipped_too_long": float(len(samples) - len(kept))}
    if not kept:
        return metrics, []
    rollout = engine_section(model, machine, [len(ids) for _, ids in kept], max_new_tokens, max_model_len,
                             kv_cache_gib)
    engine = build_engine(rollout, str(model_dir), machine)
    try:
        groups = engine.generate([ids for _, ids in kept], 1, sampling)
    finally:
        engine.close()
    completions = [g[0] for g in groups]
    texts = [c.text for c in completions]
    kept_samples = [s for s, _ in kept]
    if bfcl:
        metrics.update(bfcl_accuracy(kept_samples, texts))
    if rewards:
        with RewardStage(rewards, num_workers=num_workers, allow_weaker_sandbox=allow_weaker_sandbox) as stage:
            values, stage_metrics = stage.score(texts, [len(c.token_ids) for c in completions],
                                                [s.reward_truth() for s in kept_samples])
        for k, spec in enumerate(rewards):
            metrics[f"eval/{spec.name}/mean"] = values[:, k].mean().item()
            metrics[f"eval/{spec.name}/failures"] = stage_metrics[f"reward/{spec.name}/failures"]
    return metrics, texts
