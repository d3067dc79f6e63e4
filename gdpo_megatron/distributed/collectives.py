"""The collectives a training step is stitched with: sums of a few numbers, a verdict every
rank shares, and a value the first rank of a group hands the others.

Each takes the process group it reduces over (None: the whole world) and puts its small
tensors on ``device`` (the rank's device: NCCL reduces CUDA tensors only).
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def all_reduce_sums(values: Sequence[float] | torch.Tensor, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> list[float]:
    """The element-wise sums of ``values`` over the ranks of ``group``, in float64."""
    sums = torch.as_tensor(values, dtype=torch.float64).to(device)
    dist.all_reduce(sums, group=group)
    return sums.tolist()


def any_rank(flag: bool, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of ``group`` if ``flag`` is true on any of them."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


class PeerFailed(RuntimeError):
    """Another rank failed in work this rank did too; its own error is in its log."""


def fail_together(fn: Callable[[], T], device: torch.device, group: dist.ProcessGroup | None = None) -> T:
    """``fn()`` on every rank of ``group``; if it raises on any rank, every rank raises (the
    failing ones their own error, the others :class:`PeerFailed`), so none is left waiting in a
    later collective for a rank that has given up."""
    try:
        value, error = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        value, error = None, e
    failed_elsewhere = any_rank(error is not None, device, group)
    if error is not None:
        raise error
    if failed_elsewhere:
        raise PeerFailed("another rank failed in this step (its error is in its log)")
    return value


def leader_broadcast(obj: T, group: dist.ProcessGroup | None) -> T:
    """``obj`` from the first rank of ``group`` on every rank of it (``group=None``: no-op)."""
    if group is None:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=dist.get_process_group_ranks(group)[0], group=group)
    return holder[0]
