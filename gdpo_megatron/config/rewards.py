"""The rewards of a run (in the column order of the reward tensor) and the pool that scores them."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from gdpo_megatron.config.loader import require, section


@section(frozen=True)
class RewardSpec:
    """One configured reward: which function, its weight, and how a failure scores.

    ``failure_value`` is what the reward is when its function raises, returns a non-finite
    or non-numeric value or one outside its declared bounds, or runs past ``timeout_s``
    (``None``: the stage's default); ``None`` means the lowest value the reward declares (0
    for a reward that declares no bounds). ``kwargs`` go to the function, e.g.
    ``{"max_tokens": 512}`` for ``length``.
    """

    name: str
    weight: float = 1.0
    failure_value: Optional[float] = None
    timeout_s: Optional[float] = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        require(bool(self.name), "name", "a reward name", self.name)
        require(self.timeout_s is None or self.timeout_s > 0, "timeout_s", "> 0 seconds or null", self.timeout_s)


@section
class RewardsConfig:
    """The rewards and the process pool that scores them."""

    rewards: list[RewardSpec] = dataclasses.field(default_factory=list)
    num_workers: int = 2
    timeout_s: float = 30.0
    reward_files: list[str] = dataclasses.field(default_factory=list)  # Python files registering rewards
    # Rewards that run model-written code may run it in the sandbox's weaker "basic" level where
    # bubblewrap cannot run (docs/rewards.md says what that level does not hold); by default such
    # a config is refused there.
    allow_weaker_sandbox: bool = False
    # The Python interpreter sandboxed programs run with, e.g. a virtual environment's with the
    # packages programs may import (docs/rewards.md); null: the default (this interpreter, or
    # as root one other users may run, often the system's with the standard library only).
    sandbox_python: Optional[str] = None

    def __post_init__(self):
        require(len(self.rewards) > 0, "rewards.rewards", "at least one reward", self.rewards)
        require(len(set(self.names)) == len(self.names), "rewards.rewards", "unique names", self.names)
        require(self.num_workers >= 1, "rewards.num_workers", ">= 1 (reward worker processes)", self.num_workers)
        require(self.timeout_s > 0, "rewards.timeout_s", "> 0 seconds", self.timeout_s)
        require(self.sandbox_python is None or os.path.isabs(self.sandbox_python), "rewards.sandbox_python",
                "the absolute path of a Python interpreter, or null", self.sandbox_python)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @property
    def weights(self) -> list[float]:
        return [r.weight for r in self.rewards]
