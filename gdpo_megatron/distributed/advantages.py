"""The all-reduce :class:`~gdpo_megatron.advantages.Reduction`: advantages over rollouts split
across data-parallel ranks, exact for any split.

``compute_advantages(rewards, group_ids, ..., reduction=AllReduce(group))`` runs the math of
:mod:`gdpo_megatron.advantages` on every rank of ``group`` (each gets its own rollouts'
advantages; statistics and diagnostics are global). Every rank must call it, also one holding
no rollout (``[0, K]`` rewards). Communication is O(prompts x rewards) per call, never
O(rollouts); only the distinct-advantage diagnostic sends each rank's distinct values.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class AllReduce:
    """A :class:`~gdpo_megatron.advantages.Reduction` over a torch.distributed group.

    Group ids must be global prompt ids in ``[0, P)`` for this step, the same numbering
    on every rank; P is found with one all-reduce.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def index_groups(self, group_ids):
        local = torch.tensor(
            [group_ids.max().item() if group_ids.numel() else -1, -group_ids.min().item() if group_ids.numel() else 0],
            dtype=torch.int64,
            device=group_ids.device,
        )
        largest, neg_smallest = self.max(local).tolist()
        if neg_smallest > 0:
            raise ValueError(
                f"group_ids: expected global prompt ids >= 0 on every rank, found {-neg_smallest}"
            )
        return group_ids, torch.arange(largest + 1, device=group_ids.device)

    def sum(self, t):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def max(self, t):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def concat(self, t):
        world = dist.get_world_size(self.group)
        rows = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
        sizes = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(sizes, rows, group=self.group)
        sizes = [int(s.item()) for s in sizes]
        padded = t.new_zeros((max(sizes), *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

