"""The reward stage: score this rank's rollouts with K named rewards in a process pool.

Each data-parallel rank scores only its own rollouts, so nothing crosses ranks here. Work is
sent one rollout at a time (all its rewards, in config order, so rewards that share work,
like ``code_pass`` and ``code_no_bug``, can share it in the worker); every reward call has
its own timeout. A call that raises, returns a non-finite or non-numeric value or one outside
the reward's declared bounds, runs past its timeout, or takes its worker down scores the
reward's failure score (:func:`~gdpo_megatron.rewards.registry.failure_score`: its lowest value unless the config sets
``failure_value``), so failing is never paid more than an honest wrong answer, and is counted
in ``reward/<name>/failures`` (timeouts also in ``reward/<name>/timeouts``). Each batch logs one
warning per failing reward: its name, how many of the batch's rollouts failed, and the first
failure's sample and reason (what it returned, or what it raised with its innermost frames). A
call whose code sandbox failed for its own reasons (``SandboxError``) is such a failure too,
never scored as the program's result. A worker that times out is killed and replaced; the sandboxed programs it
started and their working directories go with it. A worker that may have been damaged by a
completion (its sandbox failed, or a sandboxed process outlived its run) is replaced too,
after the call; the rewards of the rollout it had not scored yet go to another worker.

Rollouts can also arrive one by one while the caller works on (``begin`` / ``submit`` /
``collect``, see :class:`RewardBatch`): the trainer scores each completion as soon as the
rollout engine finishes it.

Workers are forked from a multiprocessing "forkserver", so (as with any multiprocessing
code) a script that builds the stage needs an ``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import numbers
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Sequence

import torch

from gdpo_megatron import worker_processes
from gdpo_megatron.rewards import sandbox
from gdpo_megatron.config.rewards import RewardSpec, RewardsConfig
from gdpo_megatron.rewards.registry import failure_score, get_reward, load_reward_file, reward_bounds

log = logging.getLogger(__name__)

_READY, _VALUE, _ERROR, _FATAL, _DAMAGED = "ready", "value", "error", "fatal", "damaged"
_MAX_START_FAILURES = 3  # consecutive workers dying before they are ready: give up
_START_TIMEOUT_S = 300.0


def _worker_main(conn: Connection, specs: Sequence[RewardSpec], reward_files: Sequence[str],
                 allow_weaker_sandbox: bool, sandbox_python: str | None) -> None:
    """Worker loop: receive (rollout, completion, num_tokens, metadata, reward indices),
    send one message per reward. A trainer that died (its end of the pipe closed) ends it quietly."""
    try:
        import gdpo_megatron.rewards  # noqa: F401  (registers the built-in rewards)

        sandbox.allow_weaker(allow_weaker_sandbox)
        sandbox.use_python(sandbox_python)

        for path in reward_files:
            load_reward_file(path)
        fns = [get_reward(spec.name) for spec in specs]
        bounds = [reward_bounds(spec.name) for spec in specs]
    except BaseException:
        conn.send((_FATAL, traceback.format_exc()))
        return
    conn.send((_READY,))
    try:
        _score(conn, specs, fns, bounds)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the trainer is gone (its end of the pipe closed): nobody to score for


def _score(conn: Connection, specs: Sequence[RewardSpec], fns, bounds) -> None:
    """The worker's loop, until it is told to stop or its sandbox is damaged."""
    while (task := conn.recv()) is not None:
        rollout, completion, num_tokens, metadata, indices = task
        for k in indices:
            damage = None
            try:
                value = fns[k](completion, num_tokens, metadata, **specs[k].kwargs)
            except (Exception, SystemExit) as e:
                conn.send((_ERROR, rollout, k, _raised(e)))
                if isinstance(e, sandbox.SandboxError):
                    damage = f"its code sandbox failed: {e}"
            else:
                wrong = _wrong_value(value, bounds[k])
                conn.send((_ERROR, rollout, k, wrong) if wrong else (_VALUE, rollout, k, float(value)))
            damage = damage or sandbox.damage()
            if damage is not None:
                conn.send((_DAMAGED, damage))
                return


def _raised(error: BaseException) -> str:
    """Why a reward call failed by raising: ``raised ValueError: ...``, then the innermost frames
    (at most three) of the reward's code."""
    frames = traceback.extract_tb(error.__traceback__)[1:]  # not _worker_main's own frame
    where = "".join(traceback.format_list(frames[-3:]))
    return f"raised {''.join(traceback.format_exception_only(error)).strip()}" + (f"\n{where.rstrip()}" if where else "")


def _wrong_value(value, bounds: tuple[float, float] | None) -> str | None:
    """Why a returned value cannot be a score (None if it can)."""
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return f"returned {value!r}, expected a finite number"
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        return f"returned {value!r}, outside its declared bounds [{bounds[0]:g}, {bounds[1]:g}]"
    return None


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    rollout: int | None = None  # what it is scoring now
    indices: deque = field(default_factory=deque)  # rewards of that rollout still to come
    started: float = 0.0  # when the current reward call began


class RewardStage:
    """``score`` returns ``[n, K]`` float32 rewards in config order plus per-reward metrics.

    >>> with RewardStage([RewardSpec("math_correctness"), RewardSpec("length", kwargs={"max_tokens": 512})]) as stage:
    ...     rewards, metrics = stage.score(completions, num_tokens, ground_truths)
    """

    @classmethod
    def from_config(cls, config: RewardsConfig) -> "RewardStage":
        """The stage a config's ``rewards`` section describes."""
        return cls(config.rewards, config.num_workers, config.timeout_s, config.reward_files,
                   config.allow_weaker_sandbox, config.sandbox_python)

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        num_workers: int = 2,
        timeout_s: float = 30.0,
        reward_files: Sequence[str | Path] = (),
        allow_weaker_sandbox: bool = False,
        sandbox_python: str | None = None,
    ):
        """``allow_weaker_sandbox``: code rewards may run at the sandbox's basic level where
        bubblewrap cannot run (else such a call fails with the reason). ``sandbox_python``: the
        interpreter sandboxed programs run with (``sandbox.use_python``; ``None``: the default)."""
        self.allow_weaker_sandbox, self.sandbox_python = allow_weaker_sandbox, sandbox_python
        self.reward_files = [str(Path(p).resolve()) for p in reward_files]
        for path in self.reward_files:
            load_reward_file(path)
        self.specs = list(specs)
        self.timeouts = [spec.timeout_s or timeout_s for spec in self.specs]
        self.failure_scores = [failure_score(spec) for spec in self.specs]
        # Workers fork from a server that imported the rewards once, so a replacement for a
        # killed worker does not import them again.
        self._ctx = worker_processes.context()
        self._start_failures = 0
        self._workers = [self._start_worker() for _ in range(num_workers)]

    @property
    def names(self) -> list[str]:
        """Reward names in config order (the columns of the reward tensor)."""
        return [spec.name for spec in self.specs]

    def score(
        self, completions: Sequence[str], num_tokens: Sequence[int], metadata: Sequence[dict]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards ``[n, K]`` for ``n`` rollouts, and ``reward/<name>/{mean,std,failures,timeouts}``."""
        n = len(completions)
        if len(num_tokens) != n or len(metadata) != n:
            raise ValueError(
                f"reward stage: got {n} completions, {len(num_tokens)} token counts and "
                f"{len(metadata)} metadata dicts; expected one of each per rollout"
            )
        batch = self.begin(n)
        for i in range(n):
            batch.submit(i, completions[i], num_tokens[i], metadata[i])
        return batch.collect()

    def begin(self, n: int) -> "RewardBatch":
        """Start scoring ``n`` rollouts that arrive one by one (e.g. as generation finishes them).

        >>> batch = stage.begin(len(rollouts))
        >>> batch.submit(i, completion, num_tokens, ground_truth)   # as each rollout is ready
        >>> rewards, metrics = batch.collect()                      # what score() returns
        """
        if not self._workers:
            raise RuntimeError("reward stage: begin() called after close()")
        return RewardBatch(self, n)

    def advance(self, batch: "RewardBatch", block: bool = False) -> None:
        """Take in the workers' replies, hand waiting rollouts of ``batch`` to idle workers, and
        replace workers whose call ran past its time limit. With ``block``, first wait for a
        reply: until the next running call times out, or while none runs, up to the workers'
        start timeout."""
        self._dispatch(batch)
        self._receive(batch, block)
        self._dispatch(batch)  # to the workers that just answered
        self._expire(batch)

    def complete(self, batch: "RewardBatch") -> None:
        """Wait until every reward of every rollout submitted to ``batch`` is in."""
        while batch.waiting() or self._busy():
            self.advance(batch, block=True)

    def _dispatch(self, batch: "RewardBatch") -> None:
        """Send waiting rollouts to idle workers."""
        for w in list(self._workers):
            if w.ready and w.rollout is None and batch.waiting():
                i, indices = batch.next_waiting()
                try:
                    w.conn.send(batch.task(i, indices))
                except OSError:  # it died while idle: the rollout waits for the next worker
                    batch.put_back(i, indices)
                    self._replace(w, batch, "worker process died")
                    continue
                w.rollout, w.indices, w.started = i, indices, time.monotonic()

    def _busy(self) -> bool:
        return any(w.rollout is not None for w in self._workers)

    def close(self, at_once: bool = False) -> None:
        """End the workers: each is asked to stop and given 5 s, or with ``at_once`` killed."""
        for w in self._workers:
            if w.process.is_alive() and not at_once:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        for w in self._workers:
            w.process.join(timeout=0 if at_once else 5)
            if w.process.is_alive():
                self._kill(w)
            w.conn.close()
        self._workers = []

    def __enter__(self) -> "RewardStage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _receive(self, batch: "RewardBatch", block: bool) -> None:
        """Handle the workers' messages, after waiting for one with ``block`` (see :meth:`advance`)."""
        running = [w.started + self.timeouts[w.indices[0]] for w in self._workers if w.rollout is not None]
        timeout = max(0.0, min(running) - time.monotonic()) if running else _START_TIMEOUT_S
        ready = wait([w.conn for w in self._workers], timeout=timeout if block else 0)
        if block and not ready and not running:
            self.close()
            raise RuntimeError(f"reward stage: no worker became ready within {_START_TIMEOUT_S} s")
        for conn in ready:
            worker = next(w for w in self._workers if w.conn is conn)
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                message = None
            if message is None or message[0] == _FATAL:
                if not worker.ready:
                    self._on_start_failure(message)
                self._replace(worker, batch, "worker process died")
            elif message[0] == _READY:
                worker.ready = True
                self._start_failures = 0
            elif message[0] == _DAMAGED:
                log.warning("reward stage: replacing a worker: %s", message[1])
                self._replace(worker, batch, message[1], fail_current=False)
            else:
                kind, i, k, payload = message
                if kind == _VALUE:
                    batch.record(i, k, payload)
                else:
                    batch.fail(i, k, payload)
                worker.indices.popleft()
                worker.started = time.monotonic()
                if not worker.indices:
                    worker.rollout = None

    def _expire(self, batch: "RewardBatch") -> None:
        """Replace every worker whose current call has run past its timeout."""
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.rollout is not None:
                limit = self.timeouts[worker.indices[0]]
                if now >= worker.started + limit:
                    self._replace(worker, batch, f"timed out after {limit:g} s", timed_out=True)

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self.specs, self.reward_files,
                                                               self.allow_weaker_sandbox, self.sandbox_python),
                                   daemon=True)
        process.start()
        child.close()  # so that the worker's death reads as EOF here
        return _Worker(process, parent)

    def _on_start_failure(self, message) -> None:
        """A worker died before it was ready: an import error is final, a crash may be retried."""
        self._start_failures += 1
        if message is not None or self._start_failures >= _MAX_START_FAILURES:
            self.close()
            detail = message[1] if message is not None else "it exited before it was ready"
            raise RuntimeError(f"reward stage: a worker could not start:\n{detail}")

    def _replace(self, worker: _Worker, batch: "RewardBatch", why: str, timed_out: bool = False,
                 fail_current: bool = True) -> None:
        """Kill ``worker``, fail its current reward call (unless ``fail_current`` is False: it
        was answered), requeue the rest, start a new one."""
        if worker.rollout is not None:
            if fail_current:
                batch.fail(worker.rollout, worker.indices.popleft(), why, timed_out)
            if worker.indices:
                batch.put_back(worker.rollout, worker.indices)
        self._kill(worker)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start_worker()

    @staticmethod
    def _kill(worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join()
        sandbox.clean_up_after(worker.process.pid)


class RewardBatch:
    """Rollouts of one batch being scored by a :class:`RewardStage` (see :meth:`RewardStage.begin`).

    ``submit`` never blocks: it hands the rollout to an idle worker if there is one and takes
    in the replies that have already arrived, so the workers score while the caller goes on
    (e.g. generating). An error of the stage itself (workers that cannot start) is raised by
    ``collect``, never in the middle of the caller's work.

    The batch holds what its rollouts are, which of them wait for a worker (each with the
    rewards still to compute, in config order), and the scores so far; the stage takes work
    from it and gives values and failures back through the methods below ``collect``.
    """

    def __init__(self, stage: RewardStage, n: int):
        self.n = n
        self._stage = stage
        K = len(stage.specs)
        self._inputs: dict[int, tuple[str, int, dict]] = {}
        self._waiting: deque[tuple[int, deque[int]]] = deque()
        self._values = [[math.nan] * K for _ in range(n)]
        self._sample_ids: dict[int, str] = {}
        self._failures, self._timeouts = [0] * K, [0] * K
        self._first_error: list[tuple[int, str] | None] = [None] * K  # (rollout, why) per reward
        self._error: BaseException | None = None

    def submit(self, i: int, completion: str, num_tokens: int, metadata: dict, sample_id: str | None = None) -> None:
        """Rollout ``i`` (in ``[0, n)``, each once) is ready to be scored; ``sample_id``: the id
        of its prompt, which a failure's message names."""
        if not 0 <= i < self.n or i in self._inputs:
            raise ValueError(f"reward stage: rollout {i} is out of [0, {self.n}) or was submitted twice")
        self._inputs[i] = (completion, num_tokens, metadata)
        if sample_id is not None:
            self._sample_ids[i] = sample_id
        self._waiting.append((i, deque(range(len(self._stage.specs)))))
        if self._error is not None:
            return
        try:
            self._stage.advance(self)
        except Exception as e:  # raised again by collect()
            self._error = e

    def collect(self) -> tuple[torch.Tensor, dict[str, float]]:
        """Wait for every reward of every rollout; ``[n, K]`` rewards and
        ``reward/<name>/{mean,std,failures,timeouts}``."""
        if self._error is not None:
            raise self._error
        if len(self._inputs) != self.n:
            raise ValueError(f"reward stage: collect() after {len(self._inputs)} of {self.n} rollouts were submitted")
        self._stage.complete(self)
        names = self._stage.names
        for k, first in enumerate(self._first_error):
            if first is not None:
                log.warning(self._failure_report(k, *first))
        rewards = torch.tensor(self._values, dtype=torch.float32).reshape(self.n, len(names))
        metrics = {}
        for k, name in enumerate(names):
            column = rewards[:, k].to(torch.float64)
            metrics[f"reward/{name}/mean"] = column.mean().item() if column.numel() else 0.0
            metrics[f"reward/{name}/std"] = column.std(correction=0).item() if column.numel() else 0.0
            metrics[f"reward/{name}/failures"] = float(self._failures[k])
            metrics[f"reward/{name}/timeouts"] = float(self._timeouts[k])
        return rewards, metrics

    # ---- the stage's side

    def waiting(self) -> bool:
        """Whether a rollout waits for a worker."""
        return bool(self._waiting)

    def next_waiting(self) -> tuple[int, deque[int]]:
        """The rollout that has waited longest, and the rewards (indices) it still needs."""
        return self._waiting.popleft()

    def put_back(self, i: int, indices: deque[int]) -> None:
        """Rollout ``i``'s ``indices`` go to the next worker, before any other rollout."""
        self._waiting.appendleft((i, indices))

    def task(self, i: int, indices: deque[int]) -> tuple:
        """What a worker receives to compute rewards ``indices`` of rollout ``i``."""
        return (i, *self._inputs[i], list(indices))

    def record(self, i: int, k: int, value: float) -> None:
        """Reward ``k`` of rollout ``i`` is ``value``."""
        self._values[i][k] = value

    def fail(self, i: int, k: int, why: str, timed_out: bool = False) -> None:
        """Reward ``k`` of rollout ``i`` failed (``why``): it scores the reward's failure score."""
        self._values[i][k] = self._stage.failure_scores[k]
        self._failures[k] += 1
        self._timeouts[k] += timed_out
        self._first_error[k] = self._first_error[k] or (i, why)

    def _failure_report(self, k: int, i: int, why: str) -> str:
        """``reward 'name' failed on F of N rollouts (...); the first, of sample 'id': <why>``."""
        stage = self._stage
        timeouts = f", {self._timeouts[k]} timed out" if self._timeouts[k] else ""
        sample = f"sample {self._sample_ids[i]!r} (rollout {i})" if i in self._sample_ids else f"rollout {i}"
        return (f"reward {stage.names[k]!r} failed on {self._failures[k]} of {self.n} rollouts{timeouts}, each "
                f"scoring its failure value {stage.failure_scores[k]:g}; the first, {sample}: {why}")
