"""How rewards become advantages: the mode, its normalizations, the group filter, and reward gates.

The names a mode or filter takes are listed here, once (:data:`AdvantageMode`,
:data:`GroupFilter`); what each one computes is registered under its name in
:mod:`gdpo_megatron.advantages` (``GROUP_NORMALIZERS``, ``GROUP_FILTERS``).
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional, get_args

from gdpo_megatron.config.loader import require, section

AdvantageMode = Literal["gdpo", "grpo", "grpo_no_std"]
MODES = get_args(AdvantageMode)
GroupFilter = Literal["none", "informative_groups"]  # informative_groups: dynamic sampling
FILTERS = get_args(GroupFilter)
NonfinitePolicy = Literal["raise", "mask"]


@section
class ConditionConfig:
    """Reward ``reward`` counts only where reward ``gate`` is >= ``threshold`` (else ``fill``).

    (The key is not ``on``: YAML 1.1 reads a bare ``on`` as ``true``.)
    """

    reward: str
    gate: str
    threshold: float = 1.0
    fill: float = 0.0

    def __post_init__(self):
        require(self.reward != self.gate, "gate", f"another reward than {self.reward!r}", self.gate)


@section
class AdvantageConfig:
    """The advantage estimator's settings. Reward weights live with the rewards; conditions name
    rewards (:func:`gdpo_megatron.advantages.conditions_by_column` turns them into columns)."""

    mode: AdvantageMode = "gdpo"
    filter: GroupFilter = "none"  # informative_groups: drop (not refill) groups in which no reward has any spread
    batch_norm: Optional[bool] = None  # null: the mode's default (on for gdpo, off for the GRPO modes)
    eps: float = 1e-4  # added to every std before dividing
    leave_one_out: bool = False  # baseline and std of a rollout from its group's other rollouts
    normalize_rewards: bool = True  # false: center inside the group without dividing by the std
    conditions: list[ConditionConfig] = dataclasses.field(default_factory=list)
    nonfinite: NonfinitePolicy = "raise"  # "mask": drop rollouts with a NaN/inf reward and count them

    def __post_init__(self):
        require(self.mode in MODES, "mode", f"one of {MODES}", self.mode)
        require(self.filter in FILTERS, "filter", f"one of {FILTERS}", self.filter)
        require(self.eps >= 0, "eps", "a finite value >= 0", self.eps)
