"""The batch format of a policy update, its validation, and its split into micro-batches.

One row per rollout: prompt and completion token ids right-padded to a common length ``T``.
Log-probabilities are aligned to the *targets* ``input_ids[:, 1:]``, hence ``T - 1`` columns:
``rollout_logprobs[i, t]`` is log p(input_ids[i, t + 1] | input_ids[i, :t + 1]).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass
class PolicyBatch:
    """A data-parallel rank's rollouts for one update.

    Attributes:
        input_ids: ``[B, T]`` int64 token ids (prompt, completion, padding).
        loss_mask: ``[B, T]`` bool, True on completion tokens (False on prompt and padding;
            position 0 is never a target and must be False).
        advantages: ``[B]`` one advantage per rollout (the GDPO output).
        rollout_logprobs: ``[B, T - 1]`` log-probabilities of the targets as the rollout engine
            sampled them, or None.
        old_logprobs: ``[B, T - 1]`` the PPO ratio's old-policy log-probabilities (filled in
            by the worker: the policy's own, or ``rollout_logprobs``; see
            ``PolicyConfig.old_logprobs``).
        ref_logprobs: ``[B, T - 1]`` log-probabilities under the frozen reference model
            (filled in by the worker when the KL penalty is on).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def target_mask(self) -> torch.Tensor:
        """``[B, T - 1]`` True where the target token counts in the loss."""
        return self.loss_mask[:, 1:]

    def validate(self, vocab_size: int) -> None:
        """Raise a ValueError naming the first field that does not fit the format."""
        if self.input_ids.dim() != 2 or self.input_ids.dtype != torch.long or self.seq_length < 2:
            raise ValueError(f"batch.input_ids: expected int64 [B, T] with T >= 2, got "
                             f"{self.input_ids.dtype} {tuple(self.input_ids.shape)}")
        if self.size == 0:
            raise ValueError("batch.input_ids: the batch is empty")
        low, high = int(self.input_ids.min()), int(self.input_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"batch.input_ids: token ids must be in [0, {vocab_size}), got [{low}, {high}]")
        shape, targets = tuple(self.input_ids.shape), (self.size, self.seq_length - 1)
        if self.loss_mask.dtype != torch.bool or tuple(self.loss_mask.shape) != shape:
            raise ValueError(f"batch.loss_mask: expected bool {shape}, got "
                             f"{self.loss_mask.dtype} {tuple(self.loss_mask.shape)}")
        if bool(self.loss_mask[:, 0].any()):
            raise ValueError("batch.loss_mask: position 0 has no logprob and must be False")
        if tuple(self.advantages.shape) != (self.size,):
            raise ValueError(f"batch.advantages: expected shape ({self.size},), got {tuple(self.advantages.shape)}")
        if not torch.isfinite(self.advantages).all():
            raise ValueError("batch.advantages: contains NaN or inf")
        for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != targets:
                raise ValueError(f"batch.{name}: expected shape {targets}, got {tuple(value.shape)}")

    def micro_batches(self, micro_batch_size: int) -> list["PolicyBatch"]:
        """Consecutive slices of ``micro_batch_size`` rows (which must divide the batch)."""
        if self.size % micro_batch_size:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must divide the batch size {self.size}")
        return [self.slice(start, start + micro_batch_size) for start in range(0, self.size, micro_batch_size)]

    def slice(self, start: int, stop: int) -> "PolicyBatch":
        """Rows ``start:stop``."""
        return self._map(lambda t: t[start:stop])

    def to(self, device) -> "PolicyBatch":
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> "PolicyBatch":
        return PolicyBatch(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                              for f in fields(self)})
