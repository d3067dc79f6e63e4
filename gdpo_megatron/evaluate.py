"""Evaluate a Hugging Face checkpoint: greedy completions scored by rewards or by BFCL's checker.

Completions come from the rollout engine the trainer uses (``rollout.engine``'s default,
laid out as a default rollout section: one rank, the engine's own memory sizing). Prompts longer than the context
left for the answer are skipped and counted, never cut.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.data.samples import Sample
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.device import Machine


def fits(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt of ``prompt_tokens`` leaves room for a full answer: those that do not are skipped."""
    return prompt_tokens + max_new_tokens <= max_model_len


def evaluate(model_dir: str | Path, samples: Sequence[Sample], rewards: Sequence[RewardSpec] = (), *,
             machine: Machine, bfcl: bool = False, max_new_tokens: int = 256, max_model_len: int = 2048,
             num_workers: int = 2, allow_weaker_sandbox: bool = False) -> tuple[dict[str, float], list[str]]:
    """Metrics (``eval/...``) and the completions of the samples that fit (in order);
    ``allow_weaker_sandbox`` as the reward stage takes it; the engine runs on ``machine`` (this one)."""
    from gdpo_megatron.data.bfcl import bfcl_accuracy
    from gdpo_megatron.rewards.stage import RewardStage
    from gdpo_megatron.config.rollout import RolloutConfig
    from gdpo_megatron.rollout.engine import SamplingConfig
    from gdpo_megatron.rollout.factory import build_engine

    engine = build_engine(RolloutConfig(max_new_tokens=max_new_tokens, max_model_len=max_model_len), str(model_dir),
                          machine)
    try:
        tokenizer = engine.tokenizer
        encoded = [(s, encode_prompt(tokenizer, s.messages)) for s in samples]
        kept = [(s, ids) for s, ids in encoded if fits(len(ids), max_new_tokens, max_model_len)]
        metrics = {"eval/prompts": float(len(kept)), "eval/skipped_too_long": float(len(samples) - len(kept))}
        if not kept:
            return metrics, []
        groups = engine.generate([ids for _, ids in kept], 1,
                                 SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens))
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
