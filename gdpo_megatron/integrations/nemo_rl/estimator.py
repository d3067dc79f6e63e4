"""GDPO as a NeMo-RL advantage estimator (``grpo.adv_estimator`` in a NeMo-RL GRPO config).

NeMo-RL's GRPO loop calls its estimator once per step, on the driver, over the whole batch
of B rollouts::

    advantages = estimator.compute_advantage(
        prompt_ids=...,      # [B, S] prompt token ids, right-padded; identical rows = one prompt
        rewards=...,         # [B] total reward (not used: GDPO needs the separate rewards)
        mask=...,            # [B, T] token_mask * sample_mask
        repeated_batch=...,  # dict-like batch, one [B] tensor per reward under "reward/<name>"
        logprobs_policy=..., logprobs_reference=...,  # not used
    )

and stores the returned ``[B, T]`` tensor as the token advantages. This module maps those
inputs onto :func:`gdpo_megatron.advantages.compute_advantages` (conditioned rewards,
per-reward group normalization, weighted sum, batch normalization over the valid rollouts)
and broadcasts each rollout's advantage over its tokens. The whole batch is in one process,
so the local reduction is exact.

NeMo-RL chooses its estimator by name inside ``nemo_rl.algorithms.grpo`` and has no
registry; :func:`install` adds this one, selected by ``implementation: gdpo_megatron``.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from gdpo_megatron.advantages import NONFINITE_POLICIES, AdvantageResult, Condition, compute_advantages

IMPLEMENTATION = "gdpo_megatron"
REWARD_PREFIX = "reward/"
CONFIG_PATH = "grpo.adv_estimator"
NEMO_RL_EPS = 1e-6  # what NeMo-RL's GRPO and GDPO estimators add to a group's std
_CONDITION_FIELDS = ("target", "gate", "threshold", "fill")  # not "on": YAML 1.1 reads it as true
# NeMo-RL's AdvEstimatorConfig fields, then this estimator's own (AdvEstimatorConfig allows extras).
_NEMO_RL_FIELDS = ("name", "normalize_rewards", "use_leave_one_out_baseline", "reward_weights", "minus_baseline")
_OWN_FIELDS = ("implementation", "conditions", "eps", "batch_norm", "nonfinite")

_last_built: weakref.ref | None = None  # the estimator the installed factory built last


class GDPOMegatronEstimator:
    """NeMo-RL advantage estimator computing GDPO with this project's math.

    NeMo-RL's ``AdvEstimatorConfig`` fields, with NeMo-RL's defaults:

    * ``name``: ``gdpo`` (the only value this estimator computes).
    * ``use_leave_one_out_baseline`` (true): a rollout's baseline is the mean of the other
      rollouts of its prompt and its scale their unbiased std; where those others are all
      equal (always for 2 rollouts per prompt) the difference is kept undivided.
    * ``normalize_rewards`` (true): divide each reward's centered value by the group (or
      leave-one-out) std plus ``eps``; false only centers. Batch normalization still applies.
    * ``reward_weights`` (null = all 1): a list, one weight per reward in the sorted order of
      the reward names, as NeMo-RL's schema (``list[float] | None``) requires.
    * ``minus_baseline`` belongs to Reinforce++; only its default (true) is accepted.

    This estimator's own keys: ``conditions`` (list of ``{target, gate, threshold, fill}``
    with reward names: ``target`` counts only where ``gate`` >= ``threshold``, else ``fill``);
    ``eps`` (1e-6, NeMo-RL's); ``batch_norm`` (true: normalize the weighted sum over the valid
    rollouts of the step); ``nonfinite`` ("raise" or "mask"). Any other key is an error.

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
    """

    def __init__(self, estimator_config: Any, loss_config: Any = None):
        del loss_config  # GDPO takes nothing from the loss; the argument is NeMo-RL's signature
        fields = _fields(estimator_config)
        unknown = sorted(set(fields) - set(_NEMO_RL_FIELDS) - set(_OWN_FIELDS))
        if unknown:
            raise ValueError(
                f"{CONFIG_PATH}: unknown key(s) {unknown}; NeMo-RL's keys are {list(_NEMO_RL_FIELDS)}, "
                f"this estimator's own {list(_OWN_FIELDS)}"
            )
        name = fields.get("name", "gdpo")
        if name != "gdpo":
            raise ValueError(f"{CONFIG_PATH}.name: the {IMPLEMENTATION} implementation computes GDPO; set name: gdpo "
                             f"(got {name!r})")
        if _flag(fields, "minus_baseline", True) is not True:
            raise ValueError(f"{CONFIG_PATH}.minus_baseline: false applies to NeMo-RL's reinforce_plus_plus "
                             "estimator only; GDPO always subtracts a baseline")
        self.leave_one_out = _flag(fields, "use_leave_one_out_baseline", True)
        self.normalize_rewards = _flag(fields, "normalize_rewards", True)
        self.reward_weights = _parse_weights(fields.get("reward_weights"))
        self.conditions = _parse_conditions(fields.get("conditions"))
        self.eps = _parse_eps(fields.get("eps", NEMO_RL_EPS))
        self.batch_norm = _flag(fields, "batch_norm", True)
        self.nonfinite = fields.get("nonfinite", "raise")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"{CONFIG_PATH}.nonfinite: expected one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
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
            prompt_groups(prompt_ids, batch_size).to(device),
            mask=valid,
            weights=self._weights_for(names),
            batch_norm=self.batch_norm,
            eps=self.eps,
            conditions=self._conditions_for(names),
            nonfinite=self.nonfinite,
            leave_one_out=self.leave_one_out,
            normalize_rewards=self.normalize_rewards,
        )
        self.last_result = result
        self.last_metrics = result.metrics(names)
        dtype = mask.dtype if mask.is_floating_point() else torch.float32
        # A real [B, T] tensor, not an expanded view: NeMo-RL may overwrite token spans in place.
        return result.advantages.to(dtype).unsqueeze(1).expand(mask.shape).contiguous()

    def _weights_for(self, names: list[str]) -> list[float]:
        if self.reward_weights is None:
            return [1.0] * len(names)
        if len(self.reward_weights) != len(names):
            raise ValueError(
                f"{CONFIG_PATH}.reward_weights: {len(self.reward_weights)} weights for {len(names)} rewards; "
                f"give one per reward in sorted name order: {names}"
            )
        return list(self.reward_weights)

    def _conditions_for(self, names: list[str]) -> list[Condition]:
        column = {n: k for k, n in enumerate(names)}
        out = []
        for i, c in enumerate(self.conditions):
            for field in ("target", "gate"):
                if c[field] not in column:
                    raise ValueError(
                        f"{CONFIG_PATH}.conditions[{i}].{field}: {c[field]!r} is not a reward of the batch {names}"
                    )
            out.append(Condition(column[c["target"]], column[c["gate"]], c["threshold"], c["fill"]))
        return out


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
        estimator = GDPOMegatronEstimator(estimator_config, _get(master_config, "loss_fn", None))
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


def prompt_groups(prompt_ids, batch_size: int) -> torch.Tensor:
    """Group index of each rollout: rows of ``prompt_ids`` with identical token ids share one.

    Accepts NeMo-RL's ``[B, S]`` padded prompt token ids, or ``[B]`` / ``[B, 1]`` group ids.
    """
    ids = torch.as_tensor(prompt_ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(1)
    if ids.dim() != 2 or ids.shape[0] != batch_size:
        raise ValueError(
            f"prompt_ids: expected [{batch_size}, S] prompt token ids (one row per rollout), "
            f"got shape {tuple(ids.shape)}"
        )
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"prompt_ids: expected integer token ids, got {ids.dtype}")
    _, inverse = torch.unique(ids, dim=0, return_inverse=True)
    return inverse


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


def _flag(fields: dict, key: str, default: bool) -> bool:
    value = fields.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{CONFIG_PATH}.{key}: expected true or false, got {value!r}")
    return value


def _parse_weights(weights) -> list[float] | None:
    if weights is None:
        return None
    if isinstance(weights, Mapping):
        raise ValueError(
            f"{CONFIG_PATH}.reward_weights: NeMo-RL's schema takes a list (list[float] | None), one weight per "
            f"reward in sorted name order, not a mapping: got {dict(weights)!r}"
        )
    if isinstance(weights, Sequence) and not isinstance(weights, str):
        return [_number(v, f"{CONFIG_PATH}.reward_weights[{i}]") for i, v in enumerate(weights)]
    raise ValueError(f"{CONFIG_PATH}.reward_weights: expected a list of numbers, got {weights!r}")


def _parse_conditions(conditions) -> list[dict]:
    if conditions is None:
        return []
    if not isinstance(conditions, Sequence) or isinstance(conditions, str):
        raise ValueError(
            f"{CONFIG_PATH}.conditions: expected a list of {{target, gate, threshold, fill}}, got {conditions!r}"
        )
    parsed = []
    for i, c in enumerate(conditions):
        where = f"{CONFIG_PATH}.conditions[{i}]"
        if not isinstance(c, Mapping):
            raise ValueError(f"{where}: expected a mapping with keys {_CONDITION_FIELDS}, got {c!r}")
        unknown = sorted(set(c) - set(_CONDITION_FIELDS))
        missing = [k for k in ("target", "gate", "threshold") if k not in c]
        if unknown or missing:
            raise ValueError(f"{where}: keys {_CONDITION_FIELDS} (fill optional); missing {missing}, unknown {unknown}")
        parsed.append(
            {
                "target": str(c["target"]),
                "gate": str(c["gate"]),
                "threshold": _number(c["threshold"], f"{where}.threshold"),
                "fill": _number(c.get("fill", 0.0), f"{where}.fill"),
            }
        )
    return parsed


def _parse_eps(eps) -> float:
    eps = _number(eps, f"{CONFIG_PATH}.eps")
    if eps < 0:
        raise ValueError(f"{CONFIG_PATH}.eps: expected a value >= 0, got {eps}")
    return eps


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(type(value).__name__)
