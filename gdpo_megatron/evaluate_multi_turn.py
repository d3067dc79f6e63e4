"""Evaluate a Hugging Face checkpoint on multi-turn questions: one trajectory per question, judged
as BFCL's ``multi_turn_checker`` judges it and scored by the multi-turn rewards.

Each question is rolled out once through its environment by the rollouts training uses
(:class:`~gdpo_megatron.trajectories.TrajectoryRollouts`: every question of the evaluation
advancing together, turn by turn, through the rollout engine :mod:`gdpo_megatron.evaluate`
builds), sampled as ``sampling`` says, each question seeded by its id (:func:`sample_keys`), so
that it samples the same whichever questions are evaluated with it. Questions whose prompt
leaves no room for ``max_new_tokens`` in the context are skipped and counted, never cut; a
trajectory that reaches the context ends there and is judged on what it did. The engine's KV cache is ``kv_cache_gib``
where given, else (on the CPU) every trajectory at once, each up to the whole context.

The verdict of a question (:func:`verdict`) reads :func:`~gdpo_megatron.environments.judge.judge`,
the replay the multi-turn rewards read: right when every graded turn passes BFCL's checks,
else BFCL's first failing check (``empty``, ``state``, ``response``) and its turn; a
trajectory that failed (its environment failed, or the chat template could not continue it) is
wrong (``failed``). The rewards (the family's, by default) go through the reward stage, as in
training.

Metrics, per category (a sample's ``category``, where it has one) and ``overall``:
``eval/<family>/<category>/questions``, ``.../accuracy`` (the share of right verdicts) and
``.../<reward>/mean``; besides ``eval/prompts``, ``eval/skipped_too_long``,
``eval/<reward>/failures`` and how the trajectories went (``eval/model_turns_mean``,
``eval/ended_<how>_frac``, as training's ``rollout/`` metrics).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.policy import ModelConfig
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.data.samples import Sample
from gdpo_megatron.device import Machine
from gdpo_megatron.environments.judge import ReferenceRefused, check_reference, judge
from gdpo_megatron.environments.trajectory import Trajectory
from gdpo_megatron.evaluate import engine_section, fits
from gdpo_megatron.rollout.engine import SamplingConfig, derive_seed
from gdpo_megatron.trajectories import TrajectoryRollout, TrajectoryRollouts, trajectory_metrics

OVERALL = "overall"


@dataclass(frozen=True)
class Verdict:
    """BFCL's verdict on one trajectory."""

    valid: bool
    failure: str | None  # "empty", "state", "response" (BFCL's first failing check), "failed", or None
    turn: int | None  # the user turn of the failing check (None: valid, or the trajectory failed)


def verdict(trajectory: Trajectory, ground_truth: dict) -> Verdict:
    """The verdict on ``trajectory`` for a question of the multi-turn layout (``environment_config``,
    ``reference_calls``)."""
    if trajectory.failure is not None:
        return Verdict(False, "failed", None)
    judgement = judge(trajectory, ground_truth["environment_config"], ground_truth["reference_calls"])
    failure = judgement.first_failure
    return Verdict(judgement.valid, failure and failure[1], failure and failure[0])


def check_reference_calls(samples: Sequence[Sample], environment: str) -> None:
    """ValueError naming the first question whose reference calls cannot be replayed in a fresh
    ``environment`` (its verdict could not be judged): one that does not parse or is refused."""
    for sample in samples:
        try:
            check_reference(environment, sample.ground_truth["environment_config"],
                            sample.ground_truth["reference_calls"])
        except ReferenceRefused as e:
            raise ValueError(f"{sample.id}: {e}") from None


def sample_keys(samples: Sequence[Sample]) -> list[int]:
    """What seeds each question's sampling: its id (and how many questions before it share the
    id), so that its trajectory does not change with ``--limit`` or the categories chosen."""
    seen: Counter[str] = Counter()
    keys = []
    for sample in samples:
        keys.append(derive_seed("eval", sample.id, seen[sample.id]))
        seen[sample.id] += 1
    return keys


def evaluate_trajectories(model_dir: str | Path, samples: Sequence[Sample], rewards: Sequence[RewardSpec], *,
                          environment: str, environment_config: EnvironmentConfig, machine: Machine,
                          model: ModelConfig, sampling: SamplingConfig, max_model_len: int,
                          kv_cache_gib: float | None = None, num_workers: int = 2,
                          ) -> tuple[dict[str, float], list[dict]]:
    """Metrics (``eval/...``) and one record per question that fits, in order: its ``id``,
    ``category``, the :class:`Verdict`'s fields, ``rewards`` (name -> value), how the trajectory
    ``ended``, why it failed (``trajectory_failure``, or None) and the model's messages per user
    turn (``turns``).

    ``environment``: the reference of the environment every question steps through;
    ``environment_config``: its time limit per step and messages per user turn; ``model``: the
    checkpoint's shape; the engine runs on ``machine`` (this one)."""
    from transformers import AutoTokenizer

    from gdpo_megatron.rewards.stage import RewardStage
    from gdpo_megatron.rollout.factory import build_engine

    max_new_tokens = sampling.max_new_tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # the files the engine loads its tokenizer from
    kept = [s for s in samples if fits(len(encode_prompt(tokenizer, s.messages)), max_new_tokens, max_model_len)]
    metrics = {"eval/prompts": float(len(kept)), "eval/skipped_too_long": float(len(samples) - len(kept))}
    if not kept:
        return metrics, []
    rollout = engine_section(model, machine, [max_model_len - max_new_tokens] * len(kept), max_new_tokens,
                             max_model_len, kv_cache_gib)
    rollouts = TrajectoryRollouts(environment, environment_config.step_timeout_s,
                                  environment_config.max_steps_per_turn, max_model_len)
    engine = build_engine(rollout, str(model_dir), machine)
    try:
        done = rollouts.roll_out(engine, kept, 1, sampling, sample_keys(kept))
    finally:
        rollouts.close()
        engine.close()
    scores: list[dict[str, float]] = [{} for _ in done]
    if rewards:
        with RewardStage(rewards, num_workers=num_workers) as stage:
            values, stage_metrics = stage.score([r.trajectory for r in done], [r.model_tokens for r in done],
                                                [s.reward_truth() for s in kept])
        scores = [{spec.name: values[i, k].item() for k, spec in enumerate(rewards)} for i in range(len(done))]
        metrics.update({f"eval/{spec.name}/failures": stage_metrics[f"reward/{spec.name}/failures"]
                        for spec in rewards})
    records = [_record(s, r, score) for s, r, score in zip(kept, done, scores)]
    metrics.update(_by_category(records, kept[0].family, [spec.name for spec in rewards]))
    metrics.update({k.replace("rollout/", "eval/", 1): v for k, v in trajectory_metrics(done).items()})
    return metrics, records


def _record(sample: Sample, rollout: TrajectoryRollout, rewards: dict[str, float]) -> dict:
    trajectory = rollout.trajectory
    return {"id": sample.id, "category": sample.metadata.get("category"),
            **asdict(verdict(trajectory, sample.ground_truth)), "rewards": rewards, "ended": rollout.ending,
            "trajectory_failure": trajectory.failure,
            "turns": [[message.text for message in turn] for turn in trajectory.turns]}


def _by_category(records: Sequence[dict], family: str, rewards: Sequence[str]) -> dict[str, float]:
    """Questions, accuracy and reward means of each category and over all."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        for key in ([record["category"]] if record["category"] is not None else []) + [OVERALL]:
            groups[key].append(record)
    metrics = {}
    for key, group in groups.items():
        prefix, n = f"eval/{family}/{key}", len(group)
        metrics[f"{prefix}/questions"] = float(n)
        metrics[f"{prefix}/accuracy"] = sum(r["valid"] for r in group) / n
        metrics.update({f"{prefix}/{name}/mean": sum(r["rewards"][name] for r in group) / n for name in rewards})
    return metrics
