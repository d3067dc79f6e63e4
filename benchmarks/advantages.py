"""Advantage computation cost: vectorized vs a per-group loop, and all-reduce vs all-gather.

    python benchmarks/advantages.py [--repeats 7]

(a) One process: `compute_advantages` (segment ops) vs a loop over prompt groups doing the
    same math with torch ops per group, at N = 4,096 and 65,536 rollouts, K = 3, G = 8.
(b) gloo processes on this machine: the all-reduce implementation vs gathering every
    rank's rewards to every rank and computing locally. Bytes are what one rank receives
    per call with ring collectives. The variants run in the same processes, interleaved.
Every time is the median of `--repeats` runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: local worlds, tiny models

import torch
import torch.distributed as dist

from gdpo_megatron.advantages import compute_advantages
from gdpo_megatron.distributed.advantages import AllReduce
from support.local_world import LocalWorld
from timing import median_time

K, G = 3, 8


def make_batch(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = torch.arange(n // G).repeat_interleave(G)[torch.randperm(n, generator=gen)]
    rewards = torch.randint(0, 2, (n, K), generator=gen).float() + 0.1 * torch.rand(n, K, generator=gen)
    return rewards, groups


def per_group_loop(rewards, groups, eps=1e-4):
    """GDPO the straightforward way: a Python loop over prompt groups."""
    order = torch.argsort(groups, stable=True)
    counts = torch.bincount(groups).tolist()
    adv = torch.zeros(rewards.shape[0])
    for idx in torch.split(order, counts):
        r = rewards[idx]
        if r.shape[0] < 2:
            continue
        std = r.std(dim=0)
        z = (r - r.mean(dim=0)) / (std + eps)
        z[:, std == 0] = 0.0
        adv[idx] = z.sum(dim=1)
    return (adv - adv.mean()) / (adv.std() + eps)


def bench_single_process(repeats: int) -> list[str]:
    rows = ["| N | per-group loop (ms) | vectorized (ms) | speed-up |", "|---|---|---|---|"]
    for n in (4096, 65536):
        rewards, groups = make_batch(n)
        want = per_group_loop(rewards, groups)
        got = compute_advantages(rewards, groups).advantages
        assert torch.allclose(got, want, atol=1e-4), "the two implementations disagree"
        t_loop = median_time(lambda: per_group_loop(rewards, groups), repeats)
        t_vec = median_time(lambda: compute_advantages(rewards, groups), repeats)
        rows.append(f"| {n:,} | {t_loop * 1e3:.1f} | {t_vec * 1e3:.1f} | {t_loop / t_vec:.1f}x |")
    return rows


def ring_bytes(op: str, payload_bytes: int, world: int) -> int:
    """Bytes one rank receives for a collective done with the ring algorithm (NCCL's bus accounting)."""
    if op == "all_reduce":
        return 2 * (world - 1) * payload_bytes // world
    return (world - 1) * payload_bytes  # all_gather of equal parts of payload_bytes


class CountingAllReduce(AllReduce):
    """AllReduce that tallies the bytes this rank receives over the wire."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def _count(self, op, t):
        self.bytes += ring_bytes(op, t.numel() * t.element_size(), dist.get_world_size())

    def index_groups(self, group_ids):
        self._count("all_reduce", torch.zeros(2, dtype=torch.int64))
        return super().index_groups(group_ids)

    def sum(self, t):
        self._count("all_reduce", t)
        return super().sum(t)

    def max(self, t):
        self._count("all_reduce", t)
        return super().max(t)

    def concat(self, t):
        self._count("all_gather", torch.zeros(1, dtype=torch.int64))
        self._count("all_gather", t)
        return super().concat(t)


def gather_then_compute(rewards, groups):
    """The baseline: every rank receives every reward, computes all, keeps its own rows."""
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rewards.shape[0]]))
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    packed = torch.zeros(longest, K + 1, dtype=torch.float64)
    packed[: rewards.shape[0], :K] = rewards
    packed[: rewards.shape[0], K] = groups
    parts = [torch.zeros_like(packed) for _ in range(world)]
    dist.all_gather(parts, packed)
    everything = torch.cat([p[:s] for p, s in zip(parts, sizes)])
    res = compute_advantages(everything[:, :K].to(rewards.dtype), everything[:, K].long())
    start = sum(sizes[: dist.get_rank()])
    received = ring_bytes("all_gather", 8, world) + ring_bytes("all_gather", packed.numel() * 8, world)
    return res.advantages[start : start + rewards.shape[0]], received


def _rank_bench(n_total: int, repeats: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    rewards, groups = make_batch(n_total)
    mine = slice(rank * n_total // world, (rank + 1) * n_total // world)  # groups straddle ranks
    r, g = rewards[mine], groups[mine]

    counting = CountingAllReduce()
    ours = compute_advantages(r, g, reduction=counting).advantages
    core = CountingAllReduce()
    compute_advantages(r, g, reduction=core, count_distinct=False)
    theirs, gather_bytes = gather_then_compute(r, g)
    assert torch.allclose(ours, theirs, atol=1e-5), "all-reduce and gather disagree"

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    t_ours, t_core, t_gather = [], [], []
    for _ in range(repeats):  # interleaved, so machine noise hits all variants alike
        t_ours.append(timed(lambda: compute_advantages(r, g, reduction=AllReduce())))
        t_core.append(timed(lambda: compute_advantages(r, g, reduction=AllReduce(), count_distinct=False)))
        t_gather.append(timed(lambda: gather_then_compute(r, g)))
    return dict(
        ours=statistics.median(t_ours),
        core=statistics.median(t_core),
        gather=statistics.median(t_gather),
        ours_bytes=counting.bytes,
        core_bytes=core.bytes,
        gather_bytes=gather_bytes,
    )


def bench_distributed(repeats: int) -> list[str]:
    rows = [
        "| ranks | N | all-gather (ms, bytes/rank) | all-reduce (ms, bytes/rank) "
        "| all-reduce w/o distinct-values diagnostic (ms, bytes/rank) | time ratio gather/all-reduce |",
        "|---|---|---|---|---|---|",
    ]
    for world_size in (1, 2, 4):
        with LocalWorld(world_size) as world:
            for n in (4096, 65536):
                res = world.run(_rank_bench, n, repeats)[0]
                rows.append(
                    f"| {world_size} | {n:,} | {res['gather'] * 1e3:.1f}, {res['gather_bytes']:,} "
                    f"| {res['ours'] * 1e3:.1f}, {res['ours_bytes']:,} "
                    f"| {res['core'] * 1e3:.1f}, {res['core_bytes']:,} | {res['gather'] / res['ours']:.2f}x |"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"K = {K} rewards, G = {G} rollouts per prompt, median of {args.repeats} runs, 1 thread per process\n")
    print("\n".join(bench_single_process(args.repeats)))
    print()
    print("\n".join(bench_distributed(args.repeats)))


if __name__ == "__main__":
    main()
