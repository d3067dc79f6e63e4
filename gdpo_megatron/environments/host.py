"""Environments in worker processes, one trajectory at a time each, with a time limit per request.

The rank that generates trajectories holds an :class:`EnvironmentPool`: worker processes forked
from the process's multiprocessing "forkserver" (the reward stage's too, with the same preload,
:mod:`gdpo_megatron.rewards`, which imports the environments: a worker never inherits the
trainer's threads, CUDA context or engine). The pool starts them lazily, all it needs at once
(without waiting for one before starting the next), and keeps them across trajectories and
steps: it grows to the most trajectories open at the same time. Each trajectory gets an
:class:`EnvironmentHost` from it: a worker it has alone until it closes, holding a fresh
environment object (built for it, then ``reset`` from its config). Every request (``reset``,
``start_turn``, ``tools``, ``step``) waits for the worker at most ``step_timeout_s``; a
request can be sent (:meth:`EnvironmentHost.send`) and its answer read later
(:meth:`EnvironmentHost.receive`), so a caller steps many trajectories' environments at once.

Why processes and not threads: a Python thread cannot be stopped, so an environment stuck in
a loop would keep a core (and the GIL) for the rest of the run, and might go on changing the
state that is later read. A process is killed, and takes its state with it.

The contract (what a trajectory's rollout can rely on):

* a call that raises inside ``Environment.call`` is an error result the model reads (the
  step goes on; :meth:`Environment.step`);
* anything else the environment raises (building it, ``reset``, ``start_turn``, ``tools``), a
  request past ``step_timeout_s``, a result that cannot be sent back, or the worker dying
  raises :class:`EnvironmentFailed` here; the host is closed by then and its worker killed (the
  pool starts another when it needs one), and the trajectory is recorded with that ``failure``
  (:class:`~gdpo_megatron.environments.trajectory.Trajectory`): every reward of it fails and is
  counted, the training step goes on;
* a trajectory sees nothing of the one before it on its worker: its environment is a new
  object; only what an environment keeps outside its object (a module's globals) outlives
  it, which an environment deterministic from its config does not read;
* closing a host returns its worker to the pool (killed instead while a request is still
  unanswered); closing the pool kills its workers;
* a worker never outlives the process that holds its pool, however that one ends (a lost
  peer's ``os._exit``, SIGKILL, NCCL's SIGABRT): it exits without a word as soon as the pool's
  end of its pipe closes, also in the middle of a call (a thread of its own waits for that).

As with any multiprocessing code, a script that builds a pool needs an
``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import os
import select
import threading
import time
import traceback
from multiprocessing.connection import Connection
from collections import deque
from typing import Any, Sequence

from gdpo_megatron import worker_processes
from gdpo_megatron.environments.calls import Call
from gdpo_megatron.environments.environment import StepResult

_OPEN_TIMEOUT_S = 120.0  # a new worker's first environment: the first also starts the forkserver


class EnvironmentFailed(RuntimeError):
    """The environment failed its trajectory; the message says why."""


def _worker_main(conn: Connection, ref: str) -> None:
    """Answer requests until the pipe closes; the pool's process gone (its end of the pipe
    closed) ends it quietly, whatever it is doing."""
    threading.Thread(target=_exit_when_closed, args=(conn.fileno(),), daemon=True).start()
    try:
        _serve(conn, ref)
    except (EOFError, OSError):  # the pipe's: nobody left to answer
        pass


def _exit_when_closed(fd: int) -> None:
    """Exit the process once the other end of the pipe ``fd`` closes, even while a call runs.
    (Its parent, the forkserver, cannot tell: every child it forked keeps it alive.)"""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    poller.poll()
    os._exit(0)


def _serve(conn: Connection, ref: str) -> None:
    """``("open", ())`` builds a new environment (the previous one goes); other requests are
    its methods'. An error is answered and ends the worker (the pool kills it anyway)."""
    from gdpo_megatron.environments.registry import make_environment

    environment = None
    while True:
        method, args = conn.recv()
        if method == "open":
            environment = None
            try:
                environment = make_environment(ref)
            except BaseException as e:  # a user's file or class: anything may come out of it
                conn.send(("error", f"building environment {ref!r}: {_describe(e)}"))
                return
            conn.send(("ok", None))
            continue
        try:
            value = getattr(environment, method)(*args)
        except BaseException as e:
            conn.send(("error", f"{method} raised {_describe(e)}"))
            return
        try:
            conn.send(("ok", value))
        except Exception as e:  # a result that does not pickle
            conn.send(("error", f"the result of {method} cannot be sent back: {_describe(e)}"))
            return


def _describe(e: BaseException) -> str:
    frames = traceback.format_exception_only(type(e), e)
    return "".join(frames).strip().splitlines()[-1]


class _Worker:
    """One worker process and the pool's end of its pipe."""

    def __init__(self, ref: str):
        context = worker_processes.context()
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, ref), daemon=True)
        self.process.start()
        child.close()

    def kill(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.join()
        self.process.close()


class EnvironmentPool:
    """Worker processes for the environment ``ref`` (see
    :mod:`gdpo_megatron.environments.registry`), each request waiting at most ``step_timeout_s``."""

    def __init__(self, ref: str, step_timeout_s: float):
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: expected > 0 seconds, got {step_timeout_s}")
        self.ref, self.step_timeout_s = ref, float(step_timeout_s)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()

    @property
    def workers(self) -> int:
        """Worker processes alive or not yet reaped: idle and held."""
        return len(self._idle) + len(self._busy)

    def hosts(self, count: int) -> list[EnvironmentHost]:
        """``count`` hosts, each with a worker of its own and a new environment in it (being
        built: a failure to build it comes with the host's first answer). Idle workers serve
        first (a dead one is dropped); the missing ones start all at once."""
        alive = []
        for worker in self._idle:
            if worker.process.is_alive():
                alive.append(worker)
            else:
                worker.kill()
        taken, self._idle = alive[:count], alive[count:]
        taken += [_Worker(self.ref) for _ in range(count - len(taken))]
        self._busy.update(taken)
        hosts = [EnvironmentHost(self, w) for w in taken]
        for host in hosts:
            host.send("open", timeout_s=_OPEN_TIMEOUT_S)
        return hosts

    def host(self) -> EnvironmentHost:
        """One host (:meth:`hosts`)."""
        return self.hosts(1)[0]

    def close(self) -> None:
        """Kill every worker, idle or held (their hosts fail from now on); idempotent. A pool
        used again starts new ones."""
        for worker in [*self._idle, *self._busy]:
            worker.kill()
        self._idle, self._busy = [], set()

    def __enter__(self) -> "EnvironmentPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _release(self, worker: _Worker, reusable: bool) -> None:
        if worker not in self._busy:
            return  # the pool closed under its host: already killed
        self._busy.discard(worker)
        if reusable:
            self._idle.append(worker)
        else:
            worker.kill()


class EnvironmentHost:
    """One trajectory's environment, in a worker of its own (from :meth:`EnvironmentPool.hosts`).

    Requests are answered in the order they were sent; each answer is due ``step_timeout_s``
    after the request was sent or the one before it answered, whichever is later."""

    def __init__(self, pool: EnvironmentPool, worker: _Worker):
        self.ref, self.step_timeout_s = pool.ref, pool.step_timeout_s
        self._pool, self._worker = pool, worker
        self._unanswered: deque[tuple[str, float, float]] = deque()  # (method, sent at, time limit)
        self._lost: str | None = None  # why a request could not be sent

    def reset(self, config: dict) -> str:
        return self._request("reset", config)

    def start_turn(self, index: int) -> str:
        return self._request("start_turn", index)

    def tools(self) -> list[dict]:
        return self._request("tools")

    def step(self, calls: Sequence[Call]) -> StepResult:
        return self._request("step", list(calls))

    def send(self, method: str, *args: Any, timeout_s: float | None = None) -> None:
        """Send the request ``method(*args)`` without waiting (:meth:`receive` reads its answer)."""
        if self._worker is None:
            raise EnvironmentFailed(f"environment {self.ref!r} is closed")
        self._unanswered.append((method, time.monotonic(), timeout_s or self.step_timeout_s))
        if self._lost is None:
            try:
                self._worker.conn.send((method, args))
            except (OSError, ValueError) as e:
                self._lost = f"{method}: the environment's process is gone ({e})"

    def receive(self) -> Any:
        """The answer to the last request sent, after those of the ones before it."""
        if self._worker is None:
            raise EnvironmentFailed(f"environment {self.ref!r} is closed")
        if self._lost is not None:
            self._fail(self._lost)
        answered_at, value = 0.0, None
        while self._unanswered:
            method, sent_at, timeout_s = self._unanswered[0]
            wait = max(sent_at, answered_at) + timeout_s - time.monotonic()
            if not self._worker.conn.poll(max(wait, 0.0)):
                self._fail(f"{method} ran past the time limit of {timeout_s:g} s")
            try:
                kind, value = self._worker.conn.recv()
            except (EOFError, OSError):
                self._worker.process.join(1.0)
                self._fail(f"{method}: the environment's process died (exit code {self._worker.process.exitcode})")
            answered_at = time.monotonic()
            self._unanswered.popleft()
            if kind == "error":
                self._fail(value)
        return value

    def close(self) -> None:
        """Give the worker back to the pool (idempotent); killed instead with a request unanswered."""
        if self._worker is None:
            return
        worker, self._worker = self._worker, None
        self._pool._release(worker, reusable=not self._unanswered and self._lost is None)

    def __enter__(self) -> "EnvironmentHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, *args: Any) -> Any:
        self.send(method, *args)
        return self.receive()

    def _fail(self, why: str) -> None:
        self._lost = why  # the worker is not given back
        self.close()
        raise EnvironmentFailed(f"environment {self.ref!r}: {why}")
