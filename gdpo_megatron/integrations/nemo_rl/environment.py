"""A NeMo-RL environment that scores completions with this project's reward stage.

NeMo-RL's GDPO reads one ``reward/<name>`` column per reward from the rollout batch; its
rollout code builds those columns from an environment whose ``step`` returns
``EnvironmentReturn.rewards`` as a dict ``{"reward/<name>": Tensor[B]}``.
:class:`RewardStageEnvironment` does that with :class:`~gdpo_megatron.rewards.stage.RewardStage`:
every reward of the config (tool format and correctness, math, length, code pass / no-bug,
or a user's reward file) runs in the stage's process pool with a timeout per call, code
runs in the sandbox, and a failure scores the reward's ``failure_value`` (by default its
declared minimum) and is counted. :class:`ScoringEnvironment` is what it shares with the
multi-turn environment (:mod:`gdpo_megatron.integrations.nemo_rl.multi_turn`): the stage, the
tokenizer, the reward keys and the metrics.

NeMo-RL runs environments as Ray actors, created from a registered class path with
``.options(...).remote(env_config)``. ``RewardStageEnvironmentActor`` (this module's
attribute, built on first access, so importing the module does not import Ray) is that
actor class; register it in the launch script::

    register_env("gdpo_tool_call", "gdpo_megatron.integrations.nemo_rl.environment.RewardStageEnvironmentActor")
    ACTOR_ENVIRONMENT_REGISTRY[that path] = PY_EXECUTABLES.SYSTEM

Its config (``env.<name>`` in the NeMo-RL config) is the project's ``rewards`` section plus
the tokenizer that counts completion tokens::

    tokenizer: Qwen/Qwen2.5-1.5B-Instruct   # for num_tokens (the length reward)
    num_workers: 8
    timeout_s: 30
    reward_files: []
    rewards:
      - {name: tool_format}
      - {name: tool_correctness}

Each ``extra_env_info`` (the ``metadata`` of ``step``) is the sample's ground truth dict, as
:func:`gdpo_megatron.integrations.nemo_rl.prompt_processor` builds it. Episodes are one turn.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gdpo_megatron.config import ConfigError, RewardsConfig, from_dict
from gdpo_megatron.preflight.validation import (
    check_code_sandbox, check_reward_specs, check_sandbox_python, load_reward_files,
)
from gdpo_megatron.integrations.nemo_rl.estimator import REWARD_PREFIX
from gdpo_megatron.rewards.stage import RewardStage

CONFIG_PATH = "env.<name>"
ACTOR_CLASS = "RewardStageEnvironmentActor"


class EnvironmentReturn(NamedTuple):
    """NeMo-RL's ``EnvironmentReturn``: the same fields in the same order (its rollout code
    unpacks the six positionally)."""

    observations: list[dict[str, str]]
    metadata: list[Any]
    next_stop_strings: list[None]
    rewards: dict[str, torch.Tensor]
    terminateds: torch.Tensor
    answers: list[str | None] | None


class ScoringEnvironment:
    """What the plug-in's environments share: the config's reward stage, the policy's tokenizer,
    the ``reward/<name>`` keys, and the metrics of what was scored (:meth:`take_metrics`).

    ``cfg`` is the project's ``rewards`` section plus ``tokenizer``; a subclass takes its own
    keys out first. Everything is checked before the tokenizer loads.
    """

    def __init__(self, cfg: Mapping):
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{CONFIG_PATH}: expected a mapping, got {cfg!r}")
        cfg = dict(cfg)
        tokenizer = cfg.pop("tokenizer", None)
        if not isinstance(tokenizer, str) or not tokenizer:
            raise ConfigError(f"{CONFIG_PATH}.tokenizer: expected the name or path of the policy's tokenizer, "
                              f"got {tokenizer!r}")
        rewards = from_dict(RewardsConfig, cfg, CONFIG_PATH)
        for i, spec in enumerate(rewards.rewards):
            if spec.weight != 1.0:
                raise ConfigError(f"{CONFIG_PATH}.rewards.{i}.weight: a NeMo-RL run weighs rewards in "
                                  "grpo.adv_estimator.reward_weights (a list in sorted name order), not here")
        # The rewards (files, names, kwargs) are checked before the tokenizer loads.
        load_reward_files(rewards.reward_files, f"{CONFIG_PATH}.reward_files")
        check_reward_specs(rewards.rewards, f"{CONFIG_PATH}.rewards")
        check_sandbox_python(rewards.sandbox_python, f"{CONFIG_PATH}.sandbox_python")
        check_code_sandbox(rewards.rewards, f"{CONFIG_PATH}.rewards", rewards.allow_weaker_sandbox,
                           f"set {CONFIG_PATH}.allow_weaker_sandbox: true")
        self._stage = RewardStage.from_config(rewards)
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        except BaseException:
            self._stage.close()
            raise
        self.reward_keys = [REWARD_PREFIX + name for name in rewards.names]
        self._totals = None  # (rollouts, per-reward sums, failures, timeouts) since take_metrics

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """The batch unchanged, and :meth:`take_metrics`."""
        return batch, self.take_metrics()

    def take_metrics(self) -> dict[str, float]:
        """``reward/<name>/{mean,failures,timeouts}`` over the rollouts scored since the last
        call (empty if none), then start counting again."""
        totals, self._totals = self._totals, None
        if totals is None:
            return {}
        count, sums, failures, timeouts = totals
        out = {}
        for k, key in enumerate(self.reward_keys):
            out[f"{key}/mean"] = sums[k] / count
            out[f"{key}/failures"] = failures[k]
            out[f"{key}/timeouts"] = timeouts[k]
        return out

    def shutdown(self) -> None:
        self._stage.close()

    def _score(self, completions: Sequence[Any], num_tokens: Sequence[int], truths: Sequence[dict]) -> torch.Tensor:
        """Rewards ``[n, K]`` of the reward stage, counted for :meth:`take_metrics`."""
        rewards, stage_metrics = self._stage.score(completions, num_tokens, truths)
        if rewards.shape[0] == 0:
            return rewards
        K = len(self.reward_keys)
        count, sums, failures, timeouts = self._totals or (0, [0.0] * K, [0.0] * K, [0.0] * K)
        column_sums = rewards.double().sum(dim=0).tolist()
        self._totals = (
            count + rewards.shape[0],
            [s + c for s, c in zip(sums, column_sums)],
            [f + stage_metrics[f"{key}/failures"] for f, key in zip(failures, self.reward_keys)],
            [t + stage_metrics[f"{key}/timeouts"] for t, key in zip(timeouts, self.reward_keys)],
        )
        return rewards


class RewardStageEnvironment(ScoringEnvironment):
    """NeMo-RL ``EnvironmentInterface`` (``step``, ``global_post_process_and_metrics``,
    ``shutdown``) scoring single-turn completions with a :class:`RewardStage`.

    Calls are served one at a time (the actor's default concurrency): the stage's own
    process pool scores a call's rollouts in parallel.
    """

    def step(self, message_log_batch: Sequence[Sequence[Mapping]], metadata: Sequence[Mapping]) -> EnvironmentReturn:
        """Score each conversation's assistant text against its ground truth; every episode ends."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"step: {len(message_log_batch)} message logs but {len(metadata)} metadata entries")
        texts = [_completion(log, i) for i, log in enumerate(message_log_batch)]
        truths = [_ground_truth(m, i) for i, m in enumerate(metadata)]
        token_ids = self._tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        rewards = self._score(texts, [len(ids) for ids in token_ids], truths)
        n = len(texts)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(n)],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards={key: rewards[:, k].clone() for k, key in enumerate(self.reward_keys)},
            terminateds=torch.ones(n),
            answers=None,
        )


def ray_actor_class(cls: type, module: str, name: str) -> type:
    """``cls`` as a Ray actor class (Ray imported here), restarted like NeMo-RL's own
    environments if the actor dies."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{module}.{name} needs ray (NeMo-RL's environments are Ray actors)") from e
    return ray.remote(max_restarts=-1, max_task_retries=-1)(cls)


def actor_class_attribute(cls: type, module: str, name: str):
    """A module ``__getattr__`` whose one attribute ``name`` is ``cls`` as a Ray actor class, built
    (and Ray imported) on first use, so that importing the module does not import Ray."""
    built: list[type] = []

    def __getattr__(attribute: str) -> type:
        if attribute != name:
            raise AttributeError(f"module {module!r} has no attribute {attribute!r}")
        if not built:
            built.append(ray_actor_class(cls, module, name))
        return built[0]

    return __getattr__


__getattr__ = actor_class_attribute(RewardStageEnvironment, __name__, ACTOR_CLASS)


def _completion(message_log: Sequence[Mapping], row: int) -> str:
    """The assistant's text of one conversation (its assistant messages, joined)."""
    if not isinstance(message_log, Sequence) or not all(isinstance(m, Mapping) for m in message_log):
        raise ValueError(f"message_log_batch[{row}]: expected a list of {{'role', 'content'}} messages")
    parts = [str(m.get("content", "")) for m in message_log if m.get("role") == "assistant"]
    if not parts:
        raise ValueError(f"message_log_batch[{row}]: no assistant message to score "
                         f"(roles: {[m.get('role') for m in message_log]})")
    return "".join(parts)


def _ground_truth(metadata: Any, row: int) -> dict:
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata[{row}]: expected the sample's ground truth dict (extra_env_info), "
                         f"got {type(metadata).__name__}")
    return dict(metadata)
