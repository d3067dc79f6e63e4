"""One trajectory's environment in its own process, with a time limit per step.

The rank that generates a trajectory holds its :class:`EnvironmentHost`: the environment
object lives in a child process forked from the process's multiprocessing "forkserver" (the
reward stage's too, with the same preload, :mod:`gdpo_megatron.rewards`, which imports the
environments: a child starts in milliseconds and never inherits the trainer's threads, CUDA
context or engine), and every method call (``reset``, ``start_turn``, ``tools``, ``step``)
waits for the child at most ``step_timeout_s``.

Why a process and not a thread: a Python thread cannot be stopped, so an environment stuck in
a loop would keep a core (and the GIL) for the rest of the run, and might go on changing the
state that is later read. A process is killed, and takes its state with it.

The contract (what a trajectory's rollout can rely on):

* a call that raises inside ``Environment.call`` is an error result the model reads (the
  step goes on; :meth:`Environment.step`);
* anything else the environment raises (in ``reset``, ``start_turn``, ``tools``), a step past
  ``step_timeout_s``, a result that cannot be sent back, or the child dying raises
  :class:`EnvironmentFailed` here; the host is closed by then, and the trajectory is recorded
  with that ``failure`` (:class:`~gdpo_megatron.environments.trajectory.Trajectory`): every
  reward of it fails and is counted, the training step goes on;
* the child never outlives the process that holds its host, however that one ends (a lost
  peer's ``os._exit``, SIGKILL, NCCL's SIGABRT): it exits without a word as soon as the host's
  end of the pipe closes, also in the middle of a call (a thread of its own waits for that).

As with any multiprocessing code, a script that builds a host needs an
``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import select
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Sequence

from gdpo_megatron.environments.calls import Call
from gdpo_megatron.environments.environment import StepResult

_CONTEXT = None
_START_TIMEOUT_S = 120.0  # the first child also starts the forkserver


class EnvironmentFailed(RuntimeError):
    """The environment failed its trajectory; the message says why."""


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # one forkserver per process: the same preload as the reward stage's, whichever starts it
        _CONTEXT.set_forkserver_preload(["gdpo_megatron.rewards"])
    return _CONTEXT


def _child_main(conn: Connection, ref: str) -> None:
    """Build the environment, then answer (method, args) requests until the pipe closes; the
    host's process gone (its end of the pipe closed) ends it quietly, whatever it is doing."""
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
    """Build the environment, then answer requests; an error ends it (the host closes it)."""
    from gdpo_megatron.environments.registry import make_environment

    try:
        environment = make_environment(ref)
    except BaseException as e:  # a user's file or class: anything may come out of it
        conn.send(("error", f"building environment {ref!r}: {_describe(e)}"))
        return
    conn.send(("ready", None))
    while True:
        method, args = conn.recv()
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


class EnvironmentHost:
    """The environment ``ref`` (see :mod:`gdpo_megatron.environments.registry`) for one trajectory."""

    def __init__(self, ref: str, step_timeout_s: float):
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: expected > 0 seconds, got {step_timeout_s}")
        self.ref, self.step_timeout_s = ref, float(step_timeout_s)
        context = _context()
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child, ref), daemon=True)
        self._process.start()
        child.close()
        self._receive("start", _START_TIMEOUT_S)

    def reset(self, config: dict) -> str:
        return self._request("reset", config)

    def start_turn(self, index: int) -> str:
        return self._request("start_turn", index)

    def tools(self) -> list[dict]:
        return self._request("tools")

    def step(self, calls: Sequence[Call]) -> StepResult:
        return self._request("step", list(calls))

    def close(self) -> None:
        """End the child (idempotent)."""
        if self._process is None:
            return
        self._conn.close()
        self._process.kill()
        self._process.join()
        self._process.close()
        self._process = None

    def __enter__(self) -> "EnvironmentHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, *args: Any) -> Any:
        if self._process is None:
            raise EnvironmentFailed(f"environment {self.ref!r} is closed")
        try:
            self._conn.send((method, args))
        except (OSError, ValueError) as e:
            self._fail(f"{method}: the environment's process is gone ({e})")
        return self._receive(method, self.step_timeout_s)

    def _receive(self, method: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self._fail(f"{method} ran past the time limit of {timeout_s:g} s")
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._fail(f"{method}: the environment's process died (exit code {self._process.exitcode})")
        if kind == "error":
            self._fail(value)
        return value

    def _fail(self, why: str) -> None:
        self.close()
        raise EnvironmentFailed(f"environment {self.ref!r}: {why}")
