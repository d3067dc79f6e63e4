"""The GDPO training loop: rollouts -> rewards -> advantages -> update -> weight sync.

Every rank runs :class:`Trainer` inside an initialized ``torch.distributed`` world. Ranks of
one model-parallel group (one data-parallel replica) train on the same batch: the replica's
first rank is its *leader*, whose rollouts and rewards the others receive. Per step:

1. each data-parallel replica takes its share of the step's prompts and samples ``G``
   completions per prompt with its colocated vLLM engine (every rank calls ``generate``:
   ranks of one vLLM tensor-parallel group must); a multi-turn family's rollouts are
   trajectories through its environment (:mod:`gdpo_megatron.trajectories`);
2. the leader scores them in its reward process pool as they finish;
3. advantages come from :func:`gdpo_megatron.advantages.compute_advantages` all-reduced over
   the data-parallel group (exact GDPO over the whole step, whatever the split);
4. the engine sleeps, the Megatron policy takes its update, gives its memory back (see
   :meth:`PolicyWorker.release_memory`), and the new weights stream into the engine as Hugging
   Face-named tensors before its KV cache returns;
5. metrics go to ``run_dir/metrics.jsonl`` (and wandb), checkpoints to ``run_dir/checkpoints``.

SIGUSR1 / SIGTERM (Slurm's warning before the time limit, or a preemption) and Ctrl-C make the
loop finish the step in progress, save a checkpoint and return; a rerun resumes from it. One
that arrives during start-up (once the Trainer exists) makes ``train`` return before the first
step, with nothing to save. A second Ctrl-C stops at once (:class:`StoppedAtOnce`). SIGTERM
bounds the wait: unless the step has finished within ``checkpoint.stop_timeout_s`` (or at a
second SIGTERM), the process ends its reward workers and exits with the status that resumes it
from its last checkpoint, saving nothing new; a checkpoint being written is finished first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tqdm import tqdm

from gdpo_megatron.checkpoint.hf_io import load_hf_weights, save_hf_checkpoint
from gdpo_megatron.checkpoint.manager import CheckpointManager
from gdpo_megatron.checkpoint.state import complete_steps
from gdpo_megatron.checkpoint.trained_with import trained_with, write_trained_with
from gdpo_megatron.checkpoint.weight_stream import iter_hf_weights
from gdpo_megatron.config import TrainConfig, to_dict
from gdpo_megatron.data.chat import encode_prompt
from gdpo_megatron.advantages import compute_advantages
from gdpo_megatron.distributed.advantages import AllReduce
from gdpo_megatron.distributed.threads import use_rank_threads
from gdpo_megatron.distributed.collectives import all_reduce_sums, any_rank, fail_together, leader_broadcast
from gdpo_megatron.exit_status import EXIT_REQUEUE
from gdpo_megatron.experience import PromptSchedule, Rollouts, reward_submitter, to_policy_batch, trajectory_submitter
from gdpo_megatron.inputs import TrainingInputs
from gdpo_megatron.metrics import MetricsLogger
from gdpo_megatron.config.policy import SHAPE_FIELDS
from gdpo_megatron.device import Placement
from gdpo_megatron.policy.worker import PolicyWorker
from gdpo_megatron.progress import Progress
from gdpo_megatron.rewards.stage import RewardStage
from gdpo_megatron.rollout.engine import RolloutEngine, SamplingConfig, derive_seed
from gdpo_megatron.rollout.factory import build_engine
from gdpo_megatron.trajectories import TrajectoryRollouts, trajectory_metrics
from gdpo_megatron.run_dir import CHECKPOINT_DIR, HF_EXPORT_DIR
from gdpo_megatron import worker_processes

# Signals that stop a run after the step in progress, with a checkpoint: Slurm's time-limit
# warning (SIGUSR1), preemption or scancel (SIGTERM), Ctrl-C (SIGINT; a second one stops at once).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# What Trainer.train returns: the run reached config.steps; it was stopped by Ctrl-C; it was
# stopped by the scheduler (a job to requeue).
DONE, STOPPED, PREEMPTED = "done", "stopped", "preempted"


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C: the run stops where it is, without a checkpoint."""


class Trainer:
    """Builds the policy, the engine, the reward stage and the data order; runs the loop.

    ``inputs``: what preflight read, checked and resolved for ``config``
    (:func:`~gdpo_megatron.preflight.validation.check_training`); ``placement``: this rank's
    machine and device, as the launch decided them
    (:func:`~gdpo_megatron.distributed.launch.init_distributed`).
    """

    def __init__(self, config: TrainConfig, inputs: TrainingInputs, placement: Placement):
        if not dist.is_initialized():
            raise RuntimeError("Trainer: torch.distributed is not initialized")
        self.config = config
        self.inputs = inputs
        self.placement = placement
        self.step_started: int | None = None  # the last step train() started (0-based): where a failure happened
        self.run_dir = Path(config.run_dir)
        self.is_rank0 = dist.get_rank() == 0
        # From here on a stop request is remembered, also one that arrives during start-up.
        self._stop_signal: int | None = None
        self._stop_watchdog: threading.Thread | None = None  # started by SIGTERM
        self._writing = threading.RLock()  # held while a checkpoint or the export is written
        self._ended = threading.Event()  # the loop has stopped as asked, or the trainer closed
        self._previous_handlers = {s: signal.signal(s, self._request_stop) for s in STOP_SIGNALS}
        self.worker = self.engine = self.reward_stage = self.logger = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        config, inputs = self.config, self.inputs
        resolved = inputs.resolved
        use_rank_threads()  # before vLLM starts (it pins torch's thread count)
        rewards = config.rewards
        self.reward_names = rewards.names
        self.conditions = inputs.conditions
        self.samples = inputs.samples
        self.schedule = PromptSchedule(len(self.samples), config.data.prompts_per_step, config.data.shuffle_seed)
        self.hf_config, model = inputs.hf_config, inputs.model
        _warn_on_shape_drift(config.policy.model, model, config.base_model)
        self.policy_config = dataclasses.replace(config.policy, model=model)
        self.checkpoints = CheckpointManager(self.run_dir / CHECKPOINT_DIR, keep_last=config.checkpoint.keep_last,
                                             optimizer_sharding=config.checkpoint.optimizer_sharding)
        latest = self.checkpoints.latest_step()  # resume and its data position are checked with the inputs

        self.worker = PolicyWorker(resolved.policy, self.placement, seed=config.seed,
                                   temperature=config.rollout.temperature,
                                   init_weights=lambda m: load_hf_weights(m, model, config.base_model),
                                   timeout=config.distributed.timeout)
        self.device = self.worker.device
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size, self.dp_rank = dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)
        mp_group = parallel_state.get_model_parallel_group()
        self.mp_group = mp_group if dist.get_world_size(mp_group) > 1 else None
        self.is_leader = self.mp_group is None or dist.get_rank(mp_group) == 0
        self.pad_multiple = self.policy_config.sequence_multiple()  # sequence parallelism, FP8

        self.start_step = 0
        if latest is not None:
            state = self.checkpoints.load(self.worker.model, self.worker.optimizer, self.worker.scheduler)
            self.start_step = state.step

        self.trajectories = TrajectoryRollouts.for_run(config)  # None: single-turn rollouts
        self.worker.release_memory()  # before the engine sizes itself from the free memory, and the first rollout
        rollout = dataclasses.replace(config.rollout, kv_cache_gib=resolved.kv_cache_gib)  # sized by preflight
        self.engine: RolloutEngine = build_engine(rollout, config.base_model, self.placement.machine, seed=config.seed)
        self.tokenizer = self.engine.tokenizer
        if self.start_step:
            self._sync_weights()  # the engine started from base_model
        if self.is_leader:
            worker_processes.start_ignoring(STOP_SIGNALS)  # Slurm signals every process of the step
            self.reward_stage = RewardStage.from_config(rewards)
        if self.is_rank0:
            self.logger = MetricsLogger(self.run_dir, to_dict(config), config.logging.wandb_project,
                                        self.run_dir.name, start_step=self.start_step)

    # ---- the loop ---------------------------------------------------------------------

    def train(self) -> str:
        """Run from the resumed step to ``config.steps``: :data:`DONE`, or :data:`STOPPED` /
        :data:`PREEMPTED` when a stop signal ended it after a step, with a checkpoint (or before
        the first step, when it arrived during start-up)."""
        progress = Progress(self.start_step, self.config.steps, self.config.advantage.mode,
                            enabled=self.is_rank0 and self.config.logging.progress_bar)
        outcome = DONE
        if any_rank(self._stop_signal is not None, self.device):  # asked during start-up: no step to finish
            return self._stopped_by()
        try:
            for step in range(self.start_step, self.config.steps):
                self.step_started = step
                metrics = self.step(step)
                if self.logger:
                    self.logger.log(step + 1, metrics)
                progress.step_done(step + 1, {n: metrics[f"reward/{n}/mean"] for n in self.reward_names})
                last = step + 1 == self.config.steps
                if any_rank(self._stop_signal is not None, self.device):  # every rank stops after the same step
                    with self._writing:
                        self.save(step + 1)
                        self._ended.set()
                    outcome = self._stopped_by()
                    break
                every = self.config.checkpoint.save_every
                if last or (every and (step + 1) % every == 0):
                    self.save(step + 1)
            if outcome == DONE and self.config.checkpoint.export_hf:
                self.export_hf(self.run_dir / HF_EXPORT_DIR)
        finally:
            progress.close()
        return outcome

    def step(self, step: int) -> dict[str, float]:
        """One GDPO step; returns the global metrics (on every rank)."""
        cfg, G = self.config, self.config.rollout.group_size
        times: dict[str, float] = {}
        started = time.perf_counter()

        with _timed(times, "rollout"):
            indices = self.schedule.indices(step)[self.dp_rank :: self.dp_size]
            samples = [self.samples[i] for i in indices]
            global_ids = list(range(self.dp_rank, cfg.data.prompts_per_step, self.dp_size))
            multi_turn = self.trajectories is not None
            prompt_ids = [] if multi_turn else fail_together(lambda: self._encode(samples), self.device)
            sampling = SamplingConfig(  # a trajectory's keys name its prompt within the step: one seed for all ranks
                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
                seed=derive_seed(cfg.seed, step) if multi_turn else derive_seed(cfg.seed, step, self.dp_rank))
            # The leader scores each completion (trajectory) as soon as it is finished.
            scoring = self.reward_stage.begin(len(samples) * G) if self.is_leader else None
            cached_before = self.engine.prefix_cache
            with _timed(times, "generate"):
                if multi_turn:
                    completions = self.trajectories.roll_out(
                        self.engine, samples, G, sampling, global_ids, self.is_leader,
                        share=lambda obj: leader_broadcast(obj, self.mp_group),
                        on_finished=scoring and trajectory_submitter(scoring, samples, G))
                else:
                    groups = self.engine.generate(prompt_ids, G, sampling,
                                                  on_completion=scoring and reward_submitter(scoring, samples, G))
                    completions = leader_broadcast([c for group in groups for c in group], self.mp_group)
            prefix_cache = self.engine.prefix_cache - cached_before
            group_ids = torch.tensor(global_ids, device=self.device).repeat_interleave(G)
            rollouts = Rollouts(prompt_ids, group_ids, completions)

        with _timed(times, "reward"):  # what is left to score once generation is done
            scored = fail_together(lambda: scoring.collect() if self.is_leader else None, self.device)
            rewards, stage_metrics = leader_broadcast(scored, self.mp_group)
            rewards = rewards.to(self.device)

        with _timed(times, "advantage"):
            result = self._advantages(rewards, rollouts.group_ids)

        self.engine.sleep()
        with _timed(times, "train"):
            batch = to_policy_batch(rollouts, G, result.advantages.cpu(), result.mask.cpu(),
                                    self.tokenizer.pad_token_id or 0, self.pad_multiple)
            # Every rollout of the step can be out (a group filter, NaN rewards): no update then.
            train_metrics = self.worker.train_step(batch) if result.group_count.sum() > 0 else {"skipped": 1.0}
            mismatch = train_metrics.pop("logprob_mismatch", math.nan)  # measured before the update
        with _timed(times, "sync"):
            self.worker.release_memory()  # the update's memory goes back before vLLM wakes its weights
            self._sync_weights()
            self.worker.release_memory()  # and the sync's before its KV cache returns
            self.engine.wake_up()
        times["step"] = time.perf_counter() - started

        metrics = self._reward_metrics(rewards, stage_metrics)
        for c in self.conditions:  # what the advantages saw for a gated reward
            name = self.reward_names[c.reward]
            metrics[f"reward/{name}/gated_mean"] = self._global_mean(result.rewards[result.mask, c.reward])
        metrics.update(result.metrics(self.reward_names))
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        metrics.update(self._rollout_metrics(rollouts, prefix_cache, times["step"]))
        if self.trajectories is not None:
            metrics.update(trajectory_metrics(rollouts.completions,
                                              lambda sums: all_reduce_sums(sums, self.device, self.dp_group)))
        metrics["rollout/logprob_mismatch"] = mismatch
        metrics.update({f"time/{k}": v for k, v in times.items()})
        return metrics

    # ---- pieces of a step ---------------------------------------------------------------

    def _encode(self, samples) -> list[list[int]]:
        """The prompts' token ids (preflight checked that each fits ``data.max_prompt_tokens``)."""
        return [encode_prompt(self.tokenizer, s.messages) for s in samples]

    def _advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor):
        """The step's advantages over every data-parallel replica's rollouts, after the group filter."""
        return compute_advantages(rewards, group_ids, config=self.config.advantage, weights=self.config.rewards.weights,
                                  conditions=self.conditions, reduction=AllReduce(self.dp_group))

    def _sync_weights(self) -> None:
        self.engine.update_weights(iter_hf_weights(self.worker.gpt_model, self.policy_config.model))

    def _reward_metrics(self, rewards: torch.Tensor, stage_metrics: dict) -> dict[str, float]:
        """Per reward mean / std over the whole step, and failures / timeouts summed over replicas."""
        K = rewards.shape[1]
        counts = [stage_metrics.get(f"reward/{n}/{kind}", 0.0) for kind in ("failures", "timeouts")
                  for n in self.reward_names]
        r = rewards.double()
        sums = all_reduce_sums([*r.sum(0).tolist(), *r.square().sum(0).tolist(), r.shape[0], *counts], self.device,
                               self.dp_group)
        n = sums[2 * K]
        out = {}
        for k, name in enumerate(self.reward_names):
            mean = sums[k] / n
            out[f"reward/{name}/mean"] = mean
            out[f"reward/{name}/std"] = max(sums[K + k] / n - mean * mean, 0.0) ** 0.5
            out[f"reward/{name}/failures"] = sums[2 * K + 1 + k]
            out[f"reward/{name}/timeouts"] = sums[3 * K + 1 + k]
        return out

    def _global_mean(self, values: torch.Tensor) -> float:
        total, count = all_reduce_sums([values.double().sum().item(), values.numel()], self.device, self.dp_group)
        return total / max(count, 1.0)

    def _rollout_metrics(self, rollouts: Rollouts, prefix_cache, step_time: float) -> dict[str, float]:
        """Generated tokens, truncation and the prompt tokens served by vLLM's prefix cache, over the whole step."""
        tokens = rollouts.num_tokens
        truncated = sum(c.finish_reason == "length" for c in rollouts.completions)
        total_tokens, n, truncated, queries, hits = all_reduce_sums(
            [sum(tokens), len(tokens), truncated, prefix_cache.queries, prefix_cache.hits], self.device, self.dp_group)
        return {
            "rollout/count": n,
            "rollout/prefix_cache_hit_frac": hits / max(queries, 1.0),
            "rollout/tokens_generated": total_tokens,
            "rollout/completion_tokens_mean": total_tokens / n,
            "rollout/truncated_fraction": truncated / n,
            "throughput/tokens_per_s": total_tokens / step_time,
            "throughput/completions_per_s": n / step_time,
        }

    # ---- stopping, saving, exporting ------------------------------------------------------

    def _request_stop(self, signum, frame) -> None:
        if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
            raise StoppedAtOnce
        if signum == signal.SIGTERM and self._stop_watchdog is not None:
            self._stop_now("interrupted by a second SIGTERM")
        announce = self._stop_signal is None
        self._stop_signal = self._stop_signal or signum
        then = ("finishing this step, then saving a checkpoint" if self.step_started is not None
                else "stopping once start-up is done, before the first step")
        again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
        if signum == signal.SIGTERM:  # also after SIGUSR1: Slurm's SIGTERM at the time limit
            timeout = self.config.checkpoint.stop_timeout_s
            self._stop_watchdog = threading.Thread(target=self._stop_after, args=(timeout,), daemon=True)
            self._stop_watchdog.start()
            announce, again = True, (f" (if the step finishes within {timeout:g} s, checkpoint.stop_timeout_s; "
                                     "SIGTERM again stops at once)")
        if announce and self.is_rank0:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            tqdm.write(f"gdpo-train: {what}: {then}{again}", file=sys.stderr)

    def _stopped_by(self) -> str:
        """How a run stopped by a signal ended: :data:`STOPPED` by Ctrl-C, else :data:`PREEMPTED`."""
        return STOPPED if self._stop_signal == signal.SIGINT else PREEMPTED

    def _stop_after(self, seconds: float) -> None:
        """SIGTERM's watchdog: unless the run has ended as asked within ``seconds``, stop it at
        once, once a checkpoint being written is complete."""
        if self._ended.wait(seconds):
            return
        with self._writing:
            if not self._ended.is_set():
                self._stop_now(f"not finished within {seconds:g} s (checkpoint.stop_timeout_s)")

    def _stop_now(self, why: str) -> None:
        """End the process at once, saving nothing new, with the status that resumes the run from
        its last checkpoint (:meth:`abandon` ends what would outlive it)."""
        if self.is_rank0:
            where = "start-up" if self.step_started is None else f"step {self.step_started + 1}"
            steps = complete_steps(self.run_dir / CHECKPOINT_DIR)
            resume = f"the last checkpoint, step {steps[-1]}" if steps else "the start (no checkpoint yet)"
            print(f"gdpo-train: SIGTERM: {where} {why}: stopped without saving it; rerun the same command to "
                  f"resume from {resume}", file=sys.stderr, flush=True)
        self.abandon()
        sys.stdout.flush()
        os._exit(EXIT_REQUEUE)

    def save(self, step: int) -> Path:
        """A training checkpoint; its config holds the model actually trained and where it came from."""
        config = {**to_dict(dataclasses.replace(self.config, policy=self.policy_config)),
                  "hf_config": self.hf_config, "hf_dir": str(Path(self.config.base_model).resolve())}
        with self._writing:
            return self.checkpoints.save(step, self.worker.model, self.worker.optimizer, self.worker.scheduler,
                                         data_position=step * self.config.data.prompts_per_step, config=config)

    def export_hf(self, out_dir: Path) -> Path:
        """The current policy as a Hugging Face directory with the base model's tokenizer and
        how it was prompted and sampled (:mod:`~gdpo_megatron.checkpoint.trained_with`).

        An export already there (from an earlier run of this run directory) is replaced only
        once the new one is complete.
        """
        with self._writing:
            return self._export_hf(out_dir)

    def _export_hf(self, out_dir: Path) -> Path:
        new = out_dir.with_name(f"{out_dir.name}.new")
        if self.is_rank0:
            shutil.rmtree(new, ignore_errors=True)  # left by a crash during an export
        dist.barrier()
        save_hf_checkpoint(self.worker.gpt_model, self.policy_config.model, new,
                           base_hf_config=self.hf_config,
                           tokenizer_dir=self.config.base_model)
        if self.is_rank0:
            write_trained_with(new, trained_with(to_dict(self.config)))
            old = out_dir.with_name(f"{out_dir.name}.old")
            if out_dir.exists():
                os.replace(out_dir, old)
            os.replace(new, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return out_dir

    def close(self) -> None:
        """Release whatever was built; vLLM's shutdown also ends the default process group, so it goes last."""
        self._ended.set()
        for part in (self.trajectories, self.reward_stage, self.logger, self.worker, self.engine):
            if part is not None:
                part.close()
        for s, handler in self._previous_handlers.items():
            signal.signal(s, handler)

    def abandon(self) -> None:
        """After a lost peer, before the process exits: end what would outlive it (the reward
        workers and their sandboxes) and close the metrics; vLLM and the process groups, whose
        teardown waits on the peer, go with the process."""
        if self.reward_stage is not None:
            self.reward_stage.close(at_once=True)
        if self.logger is not None:
            self.logger.close()


def _warn_on_shape_drift(planned, actual, base_model: str) -> None:
    """The config's policy.model (what gdpo-plan planned with) should be base_model's shape."""
    differ = [f"{f}={getattr(planned, f)} (base_model: {getattr(actual, f)})" for f in SHAPE_FIELDS
              if getattr(planned, f) != getattr(actual, f)]
    if differ:
        warnings.warn(f"policy.model differs from {base_model}/config.json, which the policy uses: "
                      f"{', '.join(differ)}")


@contextlib.contextmanager
def _timed(times: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start
