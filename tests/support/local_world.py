"""A pool of local processes joined in one torch.distributed world (gloo on loopback).

Used by the multi-process tests and benchmarks: the workers are started once (importing
torch and megatron-core costs seconds per process) and then run any number of functions.
Each function runs on every rank as ``fn(*args)`` inside an initialized process group;
its return value comes back pickled to bytes (tensors through a multiprocessing queue
are handed off via shared memory, which is fragile across process exits).
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from gdpo_megatron.distributed.launch import free_port

_STOP = b"stop"


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, tasks, results) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except Exception:
        results.put((rank, False, traceback.format_exc().encode()))
        return
    results.put((rank, True, pickle.dumps(None)))
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        try:
            fn, args, kwargs = pickle.loads(task)
            payload = (rank, True, pickle.dumps(fn(*args, **kwargs)))
        except BaseException:  # report everything, including SystemExit from the function
            payload = (rank, False, traceback.format_exc().encode())
        results.put(payload)
    if dist.is_initialized():  # a function may have ended the group itself (vLLM's shutdown does)
        dist.destroy_process_group()


class WorkerError(RuntimeError):
    """A function raised on at least one rank (the message holds each rank's traceback)."""


class LocalWorld:
    """``world_size`` spawned processes with an initialized default process group.

    >>> with LocalWorld(2) as world:
    ...     ranks = world.run(torch.distributed.get_rank)   # [0, 1]
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 300.0):
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._procs: list[mp.Process] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self.backend, self.timeout_s, self._tasks[r], self._results),
                daemon=False,  # workers may start process pools of their own (e.g. the reward stage)
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        atexit.register(self.close)  # not daemons: make sure they go when the parent does
        self._collect("start-up")

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if not self._procs:
            self._start()  # a previous failure closed the world: start a fresh one
        task = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put(task)
        return self._collect(getattr(fn, "__name__", repr(fn)))

    def _collect(self, what: str) -> list[Any]:
        deadline = time.monotonic() + self.timeout_s
        results: dict[int, bytes] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < self.world_size:
            wait = deadline - time.monotonic()
            if errors:  # the other ranks may be blocked in a collective: wait briefly
                wait = min(wait, 10.0)
            try:
                rank, ok, payload = self._results.get(timeout=max(wait, 0.01))
            except queue.Empty:
                break
            if ok:
                results[rank] = payload
            else:
                errors[rank] = payload.decode()
        for r in set(range(self.world_size)) - results.keys() - errors.keys():
            errors[r] = "no answer (timed out, died, or blocked in a collective)"
        if errors:
            self.close()
            detail = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise WorkerError(f"{what} failed on rank(s) {sorted(errors)}:\n{detail}")
        return [pickle.loads(results[r]) for r in range(self.world_size)]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(_STOP)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        atexit.unregister(self.close)

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_local(fn: Callable[..., Any], world_size: int, *args, **kwargs) -> list[Any]:
    """Start a world, run ``fn`` once on every rank, and shut the world down."""
    with LocalWorld(world_size) as world:
        return world.run(fn, *args, **kwargs)
