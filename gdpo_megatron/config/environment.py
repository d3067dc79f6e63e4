"""The environment a multi-turn family's rollouts step through."""
from __future__ import annotations

from typing import Optional

from gdpo_megatron.config.loader import require, require_path, section


@section
class EnvironmentConfig:
    """Which environment, and how long one of its steps may take.

    ``name`` is a built-in environment (``bfcl``) or, with ``file``, the
    ``gdpo_megatron.environments.Environment`` subclass of that name defined in the Python file
    ``file`` (a user's own); null: the data family's environment (none for a single-turn family).
    A step (and each other request to the environment) running past ``step_timeout_s`` fails its
    trajectory, as does an environment that raises outside a call (docs/training.md). A user
    turn ends when the model answers without a call, or after ``max_steps_per_turn`` messages
    of the model in it; ``rollout.max_model_len`` is each trajectory's token budget.
    """

    name: Optional[str] = None
    file: Optional[str] = None
    step_timeout_s: float = 10.0
    max_steps_per_turn: int = 8

    def __post_init__(self):
        if self.file is not None:
            require_path(self.file, "environment.file")
            require(bool(self.name), "environment.name", "the name of the environment class defined in "
                    "environment.file", self.name)
        require(self.max_steps_per_turn >= 1, "environment.max_steps_per_turn", ">= 1", self.max_steps_per_turn)
        require(self.step_timeout_s > 0, "environment.step_timeout_s", "> 0 seconds", self.step_timeout_s)
