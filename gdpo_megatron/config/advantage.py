"""How rewards become advantages: the mode, its normalizations, and reward gates.

Each mode is three switches that :func:`gdpo_megatron.advantages.compute_advantages` reads; a
new mode is a new entry in :data:`MODE_RULES` (and its name in :data:`AdvantageMode`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional, get_args

from gdpo_megatron.config.loader import require, section

AdvantageMode = Literal["gdpo", "grpo", "grpo_no_std"]
NonfinitePolicy = Literal["raise", "mask"]


@dataclass(frozen=True)
class ModeRules:
    """What a mode does with a group's rewards."""

    each_reward: bool  # normalize every reward inside its group, then sum (GDPO); else sum, then normalize
    divide_by_std: bool  # divide by the group's std (plus eps); False only centers
    batch_norm: bool  # by default, normalize the summed advantage over the whole batch


MODE_RULES: dict[str, ModeRules] = {
    "gdpo": ModeRules(each_reward=True, divide_by_std=True, batch_norm=True),
    "grpo": ModeRules(each_reward=False, divide_by_std=True, batch_norm=False),
    "grpo_no_std": ModeRules(each_reward=False, divide_by_std=False, batch_norm=False),
}
MODES = get_args(AdvantageMode)


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
    batch_norm: Optional[bool] = None  # null: the mode's default (on for gdpo, off for the GRPO modes)
    eps: float = 1e-4  # added to every std before dividing
    leave_one_out: bool = False  # baseline and std of a rollout from its group's other rollouts
    normalize_rewards: bool = True  # false: center inside the group without dividing by the std
    conditions: list[ConditionConfig] = dataclasses.field(default_factory=list)
    nonfinite: NonfinitePolicy = "raise"  # "mask": drop rollouts with a NaN/inf reward and count them

    def __post_init__(self):
        require(self.eps >= 0, "eps", "a finite value >= 0", self.eps)

    @property
    def rules(self) -> ModeRules:
        """The mode's rules, with ``batch_norm`` as configured."""
        rules = MODE_RULES[self.mode]
        if self.batch_norm is not None:
            rules = dataclasses.replace(rules, batch_norm=self.batch_norm)
        if not self.normalize_rewards:
            rules = dataclasses.replace(rules, divide_by_std=False)
        return rules
