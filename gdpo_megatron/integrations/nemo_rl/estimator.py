"""GDPO as a NeMo-RL advantage estimator (``grpo.adv_estimator`` in a NeMo-RL GRPO config).

NeMo-RL's GRPO loop calls its estimator once per step, on the driver, over the whole batch
of B rollouts::

    advantages = estimator.compute_advantage(
        prompt_ids=...,      # [B, S] prompt token ids, right-padded
        rewards=...,         # [B] total reward (not used: GDPO needs the separate rewards)
        mask=...,            # [B, T] token_mask * sample_mask
        repeated_batch=...,  # dict-like batch, one [B] tensor per reward under "reward/<name>"
        logprobs_policy=..., logprobs_reference=...,  # not used
    )

and stores the returned ``[B, T]`` tensor as the token advantages.

Groups: NeMo-RL builds the batch with ``repeat_interleave(grpo.num_generations_per_prompt)``,
so the rollouts of one dataset row are ``G`` consecutive rows; its dynamic sampling keeps or
drops whole groups and slices to ``num_prompts_per_step * G`` rows, and the asynchronous loop
concatenates whole per-prompt groups. This estimator takes exactly those blocks as its groups
and checks them: a batch that is not a multiple of ``G`` rows, or a block whose prompt rows
differ, is an error. NeMo-RL's own estimators instead group the rows whose prompt token ids
are equal (``calculate_baseline_and_std_per_prompt``), which merges two dataset rows that
render the same prompt but differ elsewhere (a multi-turn question's environment state or
later turns): their baselines would mix different questions. (NeMo-RL's dynamic sampling
still decides, by its own prompt-id grouping, which groups it keeps.)

This module maps those inputs onto :func:`gdpo_megatron.advantages.compute_advantages` under
the ``gdpo`` mode of ``GROUP_NORMALIZERS`` (conditioned rewards, per-reward group
normalization, weighted sum, batch normalization over the valid rollouts) and broadcasts each
rollout's advantage over its tokens. The whole batch is in one process, so the local
reduction is exact.

NeMo-RL chooses its estimator by name inside ``nemo_rl.algorithms.grpo`` and has no
registry; :func:`install` adds this one, selected by ``implementation: gdpo_megatron``.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional

import torch

from gdpo_megatron.advantages import AdvantageResult, Condition, compute_advantages, conditions_by_column
from gdpo_megatron.config.advantage import AdvantageConfig, ConditionConfig, NonfinitePolicy
from gdpo_megatron.config.loader import ConfigError, from_dict

IMPLEMENTATION = "gdpo_megatron"
REWARD_PREFIX = "reward/"
CONFIG_PATH = "grpo.adv_estimator"
GROUP_SIZE_PATH = "grpo.num_generations_per_prompt"
NEMO_RL_EPS = 1e-6  # what NeMo-RL's GRPO and GDPO estimators add to a group's std

_last_built: weakref.ref | None = None  # the estimator the installed factory built last


@dataclass
class EstimatorConfig:
    """``grpo.adv_estimator``: NeMo-RL's ``AdvEstimatorConfig`` fields with NeMo-RL's defaults,
    then this estimator's own. Any other key is an error.

    * ``name``: ``gdpo`` (the only value this estimator computes).
    * ``use_leave_one_out_baseline`` (true): a rollout's baseline is the mean of the other
      rollouts of its prompt and its scale their unbiased std; where those others are all
      equal (always for 2 rollouts per prompt) the difference is kept undivided.
    * ``normalize_rewards`` (true): divide each reward's centered value by the group (or
      leave-one-out) std plus ``eps``; false only centers. Batch normalization still applies.
    * ``reward_weights`` (null = all 1): a list, one weight per reward in the sorted order of
      the reward names, as NeMo-RL's schema (``list[float] | None``) requires.
    * ``minus_baseline`` belongs to Reinforce++; only its default (true) is accepted.
    * ``conditions``: reward gates as in a training config's ``advantage.conditions``
      (``{reward, gate, threshold, fill}``, rewards by name); ``eps`` (1e-6, NeMo-RL's);
      ``batch_norm`` (true: normalize the weighted sum over the valid rollouts of the step);
      ``nonfinite`` ("raise" or "mask").
    """

    name: str = "gdpo"
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    reward_weights: Optional[list[float]] = None
    minus_baseline: bool = True
    implementation: str = IMPLEMENTATION
    conditions: list[ConditionConfig] = field(default_factory=list)
    eps: float = NEMO_RL_EPS
    batch_norm: bool = True
    nonfinite: NonfinitePolicy = "raise"

    def __post_init__(self):
        if self.name != "gdpo":
            raise ConfigError(f"name: the {IMPLEMENTATION} implementation computes GDPO; set name: gdpo "
                              f"(got {self.name!r})")
        if not self.minus_baseline:
            raise ConfigError("minus_baseline: false applies to NeMo-RL's reinforce_plus_plus estimator only; "
                              "GDPO always subtracts a baseline")
        self.advantage = AdvantageConfig(mode="gdpo", batch_norm=self.batch_norm, eps=self.eps,
                                         leave_one_out=self.use_leave_one_out_baseline,
                                         normalize_rewards=self.normalize_rewards, conditions=self.conditions,
                                         nonfinite=self.nonfinite)


class GDPOMegatronEstimator:
    """NeMo-RL advantage estimator computing GDPO with this project's math (settings:
    :class:`EstimatorConfig`).

    Where it differs from NeMo-RL's own ``GDPOAdvantageEstimator``, by design: a rollout
    counts only when it has an unmasked token (``mask = token_mask * sample_mask``; a
    ``valid_mask`` argument can drop more), the others get advantage 0 and stay out of every
    statistic (NeMo-RL keeps masked rollouts in its baselines); statistics are float64 and
    "no spread" is decided on the values, not on a rounded std; the batch step adds ``eps``
    to the batch std (NeMo-RL adds nothing, a relative difference of ``eps`` / std); one
    reward is accepted (GDPO then equals GRPO plus batch normalization).

    After each call, ``last_result`` holds the :class:`AdvantageResult` and ``last_metrics``
    its flat diagnostics (``reward/<name>/...``, ``advantage/...``). NeMo-RL's asynchronous
    loop logs ``last_metrics`` itself; for the synchronous loop wrap its logger in
    :class:`~gdpo_megatron.integrations.nemo_rl.DiagnosticsLogger`.

    ``group_size`` is ``grpo.num_generations_per_prompt`` (the factory installed by
    :func:`install` reads it from the master config): the batch is grouped in consecutive
    blocks of that many rollouts (see the module docstring).
    """

    def __init__(self, estimator_config: Any, loss_config: Any = None, *, group_size: int):
        del loss_config  # GDPO takes nothing from the loss; the argument is NeMo-RL's signature
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ConfigError(f"{GROUP_SIZE_PATH}: expected an integer >= 1, got {group_size!r}")
        self.config: EstimatorConfig = from_dict(EstimatorConfig, _fields(estimator_config), CONFIG_PATH)
        self.group_size = group_size
        self.last_result: AdvantageResult | None = None
        self.last_metrics: dict[str, float] = {}

    def compute_advantage(self, prompt_ids, rewards, mask, repeated_batch, valid_mask=None, **kwargs) -> torch.Tensor:
        """GDPO advantages, shape and dtype of ``mask`` (float32 for an integer mask)."""
        del rewards, kwargs  # the total reward is what GDPO avoids; logprobs are not needed
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"mask: expected a [B, T] token mask tensor, got {_describe(mask)}")
        batch_size, device = mask.shape[0], mask.device
        names = reward_names(repeated_batch)
        columns = [
            _per_rollout(repeated_batch[REWARD_PREFIX + n], f"repeated_batch[{REWARD_PREFIX + n!r}]", batch_size)
            for n in names
        ]
        reward_matrix = torch.stack([c.to(device=device, dtype=torch.float64) for c in columns], dim=1)
        valid = mask.ne(0).any(dim=1)
        if valid_mask is not None:
            valid &= _per_rollout(valid_mask, "valid_mask", batch_size).to(device).ne(0)

        result = compute_advantages(
            reward_matrix,
            prompt_groups(prompt_ids, batch_size, self.group_size).to(device),
            mask=valid,
            config=self.config.advantage,
            weights=self._weights_for(names),
            conditions=self._conditions_for(names),
        )
        self.last_result = result
        self.last_metrics = result.metrics(names)
        dtype = mask.dtype if mask.is_floating_point() else torch.float32
        # A real [B, T] tensor, not an expanded view: NeMo-RL may overwrite token spans in place.
        return result.advantages.to(dtype).unsqueeze(1).expand(mask.shape).contiguous()

    def _weights_for(self, names: list[str]) -> list[float]:
        weights = self.config.reward_weights
        if weights is None:
            return [1.0] * len(names)
        if len(weights) != len(names):
            raise ValueError(
                f"{CONFIG_PATH}.reward_weights: {len(weights)} weights for {len(names)} rewards; "
                f"give one per reward in sorted name order: {names}"
            )
        return list(weights)

    def _conditions_for(self, names: list[str]) -> list[Condition]:
        for i, c in enumerate(self.config.conditions):
            for key in ("reward", "gate"):
                if getattr(c, key) not in names:
                    raise ValueError(f"{CONFIG_PATH}.conditions.{i}.{key}: {getattr(c, key)!r} is not a reward of "
                                     f"the batch {names}")
        return conditions_by_column(self.config.conditions, names)


def install(grpo_module: ModuleType | None = None) -> None:
    """Make NeMo-RL's GRPO build :class:`GDPOMegatronEstimator` where the config asks for it.

    Wraps ``nemo_rl.algorithms.grpo._create_advantage_estimator``: a config whose
    ``grpo.adv_estimator.implementation`` is ``gdpo_megatron`` gets this estimator, any
    config without that key what NeMo-RL builds. Call it once at the top of the launch
    script, before other ``nemo_rl.algorithms`` modules are imported (``grpo_sync`` imports
    the factory by name); calling it again changes nothing. It patches the calling process:
    NeMo-RL's GRPO loops build their estimator on the driver.
    """
    if grpo_module is None:
        from nemo_rl.algorithms import grpo as grpo_module
    build_nemo_rl_estimator = grpo_module._create_advantage_estimator
    if getattr(build_nemo_rl_estimator, "builds_gdpo_megatron", False):
        return

    def create_advantage_estimator(master_config):
        global _last_built
        estimator_config = _get(_get(master_config, "grpo", {}), "adv_estimator", None)
        implementation = None if estimator_config is None else _get(estimator_config, "implementation", None)
        if implementation is None:
            return build_nemo_rl_estimator(master_config)
        if implementation != IMPLEMENTATION:
            raise ValueError(f"{CONFIG_PATH}.implementation: expected {IMPLEMENTATION!r}, got {implementation!r}")
        group_size = _get(_get(master_config, "grpo", {}), "num_generations_per_prompt", None)
        estimator = GDPOMegatronEstimator(estimator_config, _get(master_config, "loss_fn", None),
                                          group_size=group_size)
        _last_built = weakref.ref(estimator)
        return estimator

    create_advantage_estimator.builds_gdpo_megatron = True
    grpo_module._create_advantage_estimator = create_advantage_estimator


def last_built_estimator() -> GDPOMegatronEstimator | None:
    """The estimator the factory patched by :func:`install` built last in this process."""
    return None if _last_built is None else _last_built()


def reward_names(batch: Mapping) -> list[str]:
    """Names of the ``reward/<name>`` components of a batch, sorted (NeMo-RL's order)."""
    names = sorted(k[len(REWARD_PREFIX):] for k in batch.keys() if isinstance(k, str) and k.startswith(REWARD_PREFIX))
    if not names:
        raise ValueError(
            f"repeated_batch: no reward components; GDPO reads one [B] tensor per reward under "
            f"'{REWARD_PREFIX}<name>' keys (the batch has {sorted(map(str, batch.keys()))})"
        )
    return names


def prompt_groups(prompt_ids, batch_size: int, group_size: int) -> torch.Tensor:
    """Group index of each rollout: consecutive blocks of ``group_size`` rows, each block's rows
    of ``prompt_ids`` (NeMo-RL's ``[B, S]`` padded prompt token ids) checked to be identical."""
    ids = torch.as_tensor(prompt_ids)
    if ids.dim() != 2 or ids.shape[0] != batch_size:
        raise ValueError(
            f"prompt_ids: expected [{batch_size}, S] prompt token ids (one row per rollout), "
            f"got shape {tuple(ids.shape)}"
        )
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"prompt_ids: expected integer token ids, got {ids.dtype}")
    if batch_size % group_size:
        raise ValueError(f"prompt_ids: {batch_size} rollouts are not whole groups of {GROUP_SIZE_PATH}="
                         f"{group_size} (NeMo-RL repeats each prompt that many times in a row)")
    blocks = ids.reshape(batch_size // group_size, group_size, -1)
    differs = blocks.ne(blocks[:, :1]).flatten(1).any(dim=1).nonzero().flatten()
    if len(differs):
        g = int(differs[0])
        raise ValueError(f"prompt_ids: rows {g * group_size}..{(g + 1) * group_size - 1} (group {g} of "
                         f"{GROUP_SIZE_PATH}={group_size} consecutive rollouts) hold different prompts; "
                         "NeMo-RL repeats each prompt that many times in a row")
    return torch.arange(batch_size, device=ids.device) // group_size


def _per_rollout(values, name: str, batch_size: int) -> torch.Tensor:
    t = torch.as_tensor(values)
    if t.dim() == 2 and t.shape[1] == 1:
        t = t.squeeze(1)
    if t.shape != (batch_size,):
        raise ValueError(f"{name}: expected one value per rollout, shape [{batch_size}], got {_describe(t)}")
    return t


def _get(config: Any, key: str, default: Any) -> Any:
    """A config field from a dict (NeMo-RL's TypedDict configs) or an object (pydantic)."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _fields(config: Any) -> dict:
    """Every key of a dict, a pydantic model (with its extras) or a plain object."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "model_dump"):
        return config.model_dump()
    return dict(vars(config))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(type(value).__name__)
