"""The batch format of a policy update, its validation, and its split into micro-batches.

One row per rollout: prompt and completion token ids right-padded to a common length ``T``.
Log-probabilities are aligned to the *targets* ``input_ids[:, 1:]``, hence ``T - 1`` columns:
``rollout_logprobs[i, t]`` is log p(input_ids[i, t + 1] | input_ids[i, :t + 1]).

Micro-batches are either consecutive slices of a fixed number of rows, or formed by a token
budget (:meth:`PolicyBatch.split_by_tokens`): rows sorted by length, each micro-batch cut to
its own longest row. The policy is causal and the loss is a sum over tokens divided by a
global count, so any split gives the same loss and gradients (up to float summation order);
the token budget only removes padding, which matters when completion lengths spread widely.
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
        lengths: ``[B]`` int64 tokens of each row before its padding (None: ``T`` for every
            row); lets token-budget micro-batches drop the padding.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    lengths: Optional[torch.Tensor] = None

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
        if self.lengths is not None:
            if tuple(self.lengths.shape) != (self.size,) or self.lengths.dtype != torch.long:
                raise ValueError(f"batch.lengths: expected int64 ({self.size},), got "
                                 f"{self.lengths.dtype} {tuple(self.lengths.shape)}")
            if bool(((self.lengths < 2) | (self.lengths > self.seq_length)).any()):
                raise ValueError(f"batch.lengths: expected values in [2, {self.seq_length}]")
            past_end = torch.arange(self.seq_length) >= self.lengths.cpu().unsqueeze(1)
            if bool((self.loss_mask.cpu() & past_end).any()):
                raise ValueError("batch.loss_mask: True past a row's length")

    def micro_batches(self, micro_batch_size: int) -> list["PolicyBatch"]:
        """Consecutive slices of ``micro_batch_size`` rows (which must divide the batch)."""
        if self.size % micro_batch_size:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must divide the batch size {self.size}")
        return [self.slice(start, start + micro_batch_size) for start in range(0, self.size, micro_batch_size)]

    def split_by_tokens(self, max_tokens: int, pad_multiple: int = 1) -> tuple[torch.Tensor, list["PolicyBatch"]]:
        """Micro-batches of at most ``max_tokens`` tokens, padding included.

        Rows are sorted by length, longest first (a stable sort, so every rank that holds the
        batch splits it the same way), and taken in that order while ``rows x width`` fits the
        budget, where ``width`` is the micro-batch's longest row rounded up to
        ``pad_multiple``; each micro-batch is cut to its width. A row longer than the budget
        is a micro-batch of its own. Returns the row order (``order[k]`` is the batch row at
        position ``k`` of the concatenated micro-batches) and the micro-batches.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
        lengths = self.lengths.cpu() if self.lengths is not None else torch.full((self.size,), self.seq_length)
        sorted_lengths, order = torch.sort(lengths, descending=True, stable=True)
        widths = [min(-(-n // pad_multiple) * pad_multiple, self.seq_length) for n in sorted_lengths.tolist()]
        bounds, start = [], 0
        for k in range(1, self.size + 1):
            if k == self.size or (k + 1 - start) * widths[start] > max_tokens:
                bounds.append((start, k))
                start = k
        sorted_batch = self._map(lambda t: t[order.to(t.device)])
        micro = [sorted_batch.slice(a, b).trim(widths[a]) for a, b in bounds]
        return order, micro

    def first_target(self) -> torch.Tensor:
        """The first target column that any row trains on (0 when none does), a 0-d tensor on
        the batch's device (reading it waits for the device)."""
        return self.target_mask.any(0).to(torch.int32).argmax()

    def trim(self, width: int) -> "PolicyBatch":
        """The first ``width`` token positions of every row (``width - 1`` target columns)."""
        return self._positions(0, width)

    def from_position(self, start: int) -> "PolicyBatch":
        """Token positions ``start`` on of every row (target columns ``start`` on). With
        ``start <= first_target()`` every target is kept."""
        return self._positions(start, self.seq_length)

    def _positions(self, start: int, stop: int) -> "PolicyBatch":
        per_position, per_target = ("input_ids", "loss_mask"), ("rollout_logprobs", "old_logprobs", "ref_logprobs")
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name in per_position:
                value = value[:, start:stop]
            elif value is not None and f.name in per_target:
                value = value[:, start : stop - 1]
            elif value is not None and f.name == "lengths":
                value = value.clamp(start, stop) - start
            values[f.name] = value
        return PolicyBatch(**values)

    def slice(self, start: int, stop: int) -> "PolicyBatch":
        """Rows ``start:stop``."""
        return self._map(lambda t: t[start:stop])

    def to(self, device) -> "PolicyBatch":
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> "PolicyBatch":
        return PolicyBatch(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                              for f in fields(self)})


def merge_rows(order: torch.Tensor, parts: list[torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """Per-target values of the whole batch from those of its token-budget micro-batches.

    ``parts`` are ``[rows_i, width_i - 1]`` in the order of :meth:`PolicyBatch.split_by_tokens`;
    the result is ``shape`` (``[B, T - 1]``) in batch row order, 0 past each micro-batch's width
    (the padding of the row).
    """
    out = parts[0].new_zeros(shape)
    start = 0
    for part in parts:
        rows = order[start : start + part.shape[0]].to(part.device)
        out[rows, : part.shape[1]] = part
        start += part.shape[0]
    return out
