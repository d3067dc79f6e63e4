"""One step's experience: which prompts, their rollouts, and the policy batch they pack into.

A rollout is a single completion of its prompt, or a multi-turn trajectory
(:class:`~gdpo_megatron.trajectories.TrajectoryRollout`): its prompt, then spans of
tokens, the model's and the environment's or user's in turn. Either way the policy batch
trains on the model's tokens only.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from gdpo_megatron.data.samples import Sample
from gdpo_megatron.policy.batch import PolicyBatch
from gdpo_megatron.rewards.stage import RewardBatch
from gdpo_megatron.rollout.engine import Completion
from gdpo_megatron.trajectories import Span, TrajectoryRollout


class PromptSchedule:
    """Which prompts a step uses: consecutive slices of per-epoch shuffles of the dataset.

    Step ``s`` takes positions ``[s * P, (s + 1) * P)`` of the endless sequence of epochs, so
    the position to resume from is a function of the step alone.
    """

    def __init__(self, num_samples: int, prompts_per_step: int, seed: int):
        if num_samples < 1:
            raise ValueError("data: the dataset is empty")
        self.num_samples = num_samples
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.num_samples))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: steps only move forward
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        """Dataset indices of the step's prompts; position i is global prompt id i."""
        start = step * self.prompts_per_step
        return [self._order(p // self.num_samples)[p % self.num_samples]
                for p in range(start, start + self.prompts_per_step)]


@dataclass
class Rollouts:
    """A replica's rollouts, ``G`` per prompt, grouped by prompt: completions of the prompts
    (``prompt_ids``, one per prompt), or trajectories (each with its own prompt)."""

    prompt_ids: list[list[int]]  # one per prompt
    group_ids: torch.Tensor  # [n] the step's global prompt id of each rollout
    completions: list[Completion | TrajectoryRollout]  # [n]

    def row(self, i: int, group_size: int) -> tuple[list[int], list[Span]]:
        """Rollout ``i``'s prompt and the spans of tokens after it."""
        c = self.completions[i]
        if isinstance(c, TrajectoryRollout):
            return c.prompt_ids, c.spans
        return self.prompt_ids[i // group_size], [Span(c.token_ids, c.logprobs)]

    @property
    def num_tokens(self) -> list[int]:
        """The model's tokens of each rollout."""
        return [c.model_tokens if isinstance(c, TrajectoryRollout) else len(c.token_ids) for c in self.completions]


def to_policy_batch(rollouts: Rollouts, group_size: int, advantages: torch.Tensor, keep: torch.Tensor,
                    pad_id: int, pad_multiple: int = 1) -> PolicyBatch:
    """Prompt + completion (or trajectory) rows, right-padded to a multiple of ``pad_multiple``
    tokens; the loss covers the model's tokens of kept rollouts, never a prompt's, an
    environment's or a user's.

    ``rollout_logprobs`` are the engine's sampling logprobs placed at their targets' positions
    (0 elsewhere).
    """
    rows = [rollouts.row(i, group_size) for i in range(len(rollouts.completions))]
    lengths = [len(prompt) + sum(len(s.token_ids) for s in spans) for prompt, spans in rows]
    width = -(-max(lengths) // pad_multiple) * pad_multiple
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(n, width, dtype=torch.bool)
    rollout_logprobs = torch.zeros(n, width - 1, dtype=torch.float32)
    for i, (prompt, spans) in enumerate(rows):
        input_ids[i, :len(prompt)] = torch.tensor(prompt)
        start = len(prompt)
        for span in spans:
            stop = start + len(span.token_ids)
            input_ids[i, start:stop] = torch.tensor(span.token_ids, dtype=torch.long)
            if span.is_model:
                loss_mask[i, start:stop] = bool(keep[i])
                rollout_logprobs[i, start - 1 : stop - 1] = torch.tensor(span.logprobs, dtype=torch.float32)
            start = stop
    return PolicyBatch(input_ids=input_ids, loss_mask=loss_mask, advantages=advantages.float(),
                       rollout_logprobs=rollout_logprobs, lengths=torch.tensor(lengths, dtype=torch.long))


def reward_submitter(batch: RewardBatch, samples: Sequence[Sample], group_size: int):
    """An ``on_completion`` callback for the rollout engine: completion ``j`` of prompt ``i``
    goes to the reward batch as rollout ``i * group_size + j`` as soon as it is finished."""
    truths = [s.reward_truth() for s in samples]

    def submit(i: int, j: int, completion: Completion) -> None:
        batch.submit(i * group_size + j, completion.text, len(completion.token_ids), truths[i], samples[i].id)

    return submit


def trajectory_submitter(batch: RewardBatch, samples: Sequence[Sample], group_size: int):
    """The ``on_finished`` callback of :meth:`TrajectoryRollouts.roll_out
    <gdpo_megatron.trajectories.TrajectoryRollouts.roll_out>`: trajectory ``k`` goes to
    the reward batch as rollout ``k``, its :class:`~gdpo_megatron.environments.Trajectory` as
    the completion (what the multi-turn rewards judge) and its model tokens as its length."""
    truths = [s.reward_truth() for s in samples]

    def submit(k: int, rollout: TrajectoryRollout) -> None:
        batch.submit(k, rollout.trajectory, rollout.model_tokens, truths[k // group_size])

    return submit
