"""Rewards of a multi-turn trajectory, judged against the question's reference calls.

Each takes the :class:`~gdpo_megatron.environments.trajectory.Trajectory` as its completion
and the ground truth ``{"environment_config": ..., "reference_calls": [[call, ...] per user
turn]}`` (the ``bfcl_multi_turn`` family's), and reads one
:func:`~gdpo_megatron.environments.judge.judge` of it (shared by the rewards of one rollout):

* ``multi_turn_format`` (0..1): the mean over the turns in which the model attempts calls or
  the reference makes them of the share of the turn's attempts that were accepted, a call
  message that does not parse counting as one refused attempt; a graded turn without an
  attempt scores 0 (1 with no such turn);
* ``multi_turn_state`` (0..1): the share of graded turns in which the model made a call and
  after which its environment matches the reference's (BFCL's empty-turn and state checks);
* ``multi_turn_response`` (0..1): the share of graded turns in which the model made a call and
  every reference result is among its results so far (BFCL's empty-turn and response checks);
* ``multi_turn_accuracy`` (0 or 1): BFCL's verdict, every graded turn passing all three checks;
* ``multi_turn_efficiency`` (0..1): the mean over the turns in which the model or the
  reference makes calls of the turn's reference calls over the model's (accepted and
  refused), capped at 1, 0 where only one side makes calls (1 with no such turn); meant to be
  gated on the state reward (``advantage.conditions``), so that few calls pay only where they
  did the job.

A graded turn (the reference makes calls in it) that the model never attempted, or never
reached (its token budget or its environment ended the trajectory first), fails every check
and pays nothing, as BFCL fails an empty turn: stopping early or never calling is not cheap.

A trajectory whose environment failed (``failure`` set) makes every one of them raise: the
reward stage scores each its failure value and counts it.
"""
from __future__ import annotations

import json
from functools import lru_cache

from gdpo_megatron.environments.judge import Judgement, judge
from gdpo_megatron.environments.trajectory import Trajectory
from gdpo_megatron.rewards.registry import register_reward


class TrajectoryFailed(RuntimeError):
    """The trajectory's environment failed; its rewards are failures."""


def _judgement(completion: Trajectory, ground_truth: dict) -> Judgement:
    if not isinstance(completion, Trajectory):
        raise TypeError(f"multi-turn rewards take a Trajectory, got {type(completion).__name__}")
    if completion.failure is not None:
        raise TrajectoryFailed(completion.failure)
    return _judged(completion, json.dumps(ground_truth["environment_config"], sort_keys=True),
                   json.dumps(ground_truth["reference_calls"]))


@lru_cache(maxsize=64)  # the rewards of one rollout share its replay
def _judged(trajectory: Trajectory, config: str, reference: str) -> Judgement:
    return judge(trajectory, json.loads(config), json.loads(reference))


@register_reward("multi_turn_format", bounds=(0.0, 1.0))
def multi_turn_format(completion: Trajectory, num_tokens: int, ground_truth: dict) -> float:
    shares = [t.calls_run / attempts if attempts else 0.0
              for t in _judgement(completion, ground_truth).turns
              for attempts in [t.made + t.unparsed] if attempts or t.graded]
    return sum(shares) / len(shares) if shares else 1.0


@register_reward("multi_turn_state", bounds=(0.0, 1.0))
def multi_turn_state(completion: Trajectory, num_tokens: int, ground_truth: dict) -> float:
    graded = _judgement(completion, ground_truth).graded
    return sum(t.calls and t.state for t in graded) / len(graded) if graded else 1.0


@register_reward("multi_turn_response", bounds=(0.0, 1.0))
def multi_turn_response(completion: Trajectory, num_tokens: int, ground_truth: dict) -> float:
    graded = _judgement(completion, ground_truth).graded
    return sum(t.calls and t.response for t in graded) / len(graded) if graded else 1.0


@register_reward("multi_turn_accuracy", bounds=(0.0, 1.0))
def multi_turn_accuracy(completion: Trajectory, num_tokens: int, ground_truth: dict) -> float:
    return float(_judgement(completion, ground_truth).valid)


@register_reward("multi_turn_efficiency", bounds=(0.0, 1.0))
def multi_turn_efficiency(completion: Trajectory, num_tokens: int, ground_truth: dict) -> float:
    shares = [min(1.0, t.reference_calls / t.made) if t.made else 0.0
              for t in _judgement(completion, ground_truth).turns if t.made or t.graded]
    return sum(shares) / len(shares) if shares else 1.0
