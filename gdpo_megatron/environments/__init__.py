"""Multi-turn environments: what a model's calls act on between its turns.

:mod:`.environment` is the interface (reset from a question's config, step on parsed calls,
state), :mod:`.calls` parses a model's calls as data, :mod:`.bfcl` puts BFCL's multi-turn
backends behind the interface, :mod:`.registry` resolves built-in and user environments,
:mod:`.host` runs trajectories' environments in a pool of worker processes (one trajectory
at a time each) with a time limit per request, :mod:`.episode` decides what each of a
trajectory's model messages means and what follows it, :mod:`.trajectory` is what the multi-turn
rewards receive and :mod:`.judge` replays it against a question's reference calls as BFCL's
checker does.
"""
from gdpo_megatron.environments.calls import Call, CallRefused, call_block, parse_calls
from gdpo_megatron.environments.environment import CallResult, Environment, StepResult
from gdpo_megatron.environments.registry import (configured_reference, environment_class, environment_reference,
                                                 make_environment)
from gdpo_megatron.environments.trajectory import Message, Trajectory

__all__ = [
    "Call", "CallRefused", "CallResult", "Environment", "Message", "StepResult", "Trajectory", "call_block",
    "configured_reference",
    "environment_class", "environment_reference", "make_environment", "parse_calls",
]
