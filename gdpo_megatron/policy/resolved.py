"""What a policy worker is built from: the policy section with every machine-dependent value
decided, the data-parallel size and how a step's rows split into micro-batches.

:func:`gdpo_megatron.resolve.resolve_policy` makes it (for a run, :func:`~gdpo_megatron.resolve.resolve`);
:class:`~gdpo_megatron.policy.worker.PolicyWorker` takes it as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gdpo_megatron.config.policy import PolicyConfig


@dataclass(frozen=True)
class MicroBatches:
    """How a step's rows split into micro-batches: ``policy.micro_batch_size`` and
    ``policy.micro_batch_tokens`` decoded."""

    rows: int  # micro_batch_size: the rows of a micro-batch, or with "auto" the budget's width in rows
    tokens: Optional[int]  # a fixed budget of tokens (micro_batch_size unused)
    by_tokens: bool  # split by a budget of tokens (fixed or "auto"), rows sorted by length

    def budget(self, seq_length: int) -> Optional[int]:
        """The tokens of a micro-batch of a batch ``seq_length`` wide, or None for micro-batches
        of ``rows`` rows. "auto" is ``rows`` rows as wide as the step's longest, so no
        micro-batch holds more tokens than ``rows`` rows would."""
        if not self.by_tokens:
            return None
        return self.tokens if self.tokens is not None else self.rows * seq_length

    @property
    def fewest_rows(self) -> int:
        """The fewest rows a full micro-batch holds: one under a fixed budget (a longer row goes alone)."""
        return 1 if self.tokens is not None else self.rows


@dataclass(frozen=True)
class ResolvedPolicy:
    """What the policy worker builds: every machine-dependent value of ``config`` decided for
    the machine it runs on, and the world it is split over."""

    config: PolicyConfig  # model: the shape trained
    data_parallel_size: int
    micro_batches: MicroBatches
