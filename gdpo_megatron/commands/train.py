"""``gdpo-train --config FILE [key.sub=value ...]``: train under torchrun, srun or alone.

Every check that needs no model runs first (:func:`~gdpo_megatron.preflight.validation.check_training`),
before the process group, the policy or vLLM exist. A run directory whose run is finished says
so and stops there; otherwise one line says whether the run starts or resumes. Then each rank
joins the launcher's process group, checks its machine against the pins and the config
(:func:`~gdpo_megatron.preflight.doctor.preflight`), and runs the
:class:`~gdpo_megatron.trainer.Trainer`. The run ends with a summary: reward means, each reward's
failures (with a warning for a reward that mostly failed) and where its checkpoint, export,
metrics and plots are.

Exit statuses beyond :mod:`.console`'s: :data:`EXIT_REQUEUE` after SIGUSR1/SIGTERM (a
checkpoint was saved; a Slurm script requeues the job on it), :data:`EXIT_CTRL_C` after Ctrl-C,
:data:`EXIT_PEER_LOST` when a peer rank was lost (its host died, or stopped answering for
``distributed.timeout_s``): each rank left prints one line, ``error: rank R (HOST) lost rank P
(host H) in step S (WHERE): REASON; the last complete checkpoint is ...``, ends its reward
workers and exits at once (:func:`run`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import signal
import sys
import traceback
import warnings
from pathlib import Path

from gdpo_megatron.commands.console import (EXIT_CTRL_C, ArgumentParser, console_entry, launch_rank,
                                            quiet_defaults, say)
from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc
from gdpo_megatron.exit_status import EXIT_PEER_LOST, EXIT_REQUEUE



def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    parser = ArgumentParser(prog="gdpo-train", description="Multi-reward RL with GDPO on Megatron-core.")
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of the config")
    return parser.parse_args(argv)


@console_entry
def main(argv: list[str]) -> int:
    args = parse(argv)
    quiet_defaults()

    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.device import this_machine
    from gdpo_megatron.preflight.validation import check_training, launch_world_size

    config = load_config(TrainConfig, args.config, args.overrides)
    machine = this_machine()
    inputs = check_training(config, machine, launch_world_size())
    if inputs.resume_step >= config.steps:
        say(f"gdpo-train: {config.run_dir} has finished step {inputs.resume_step} of {config.steps}: nothing to "
            "train (raise steps to train on)")
        return 0
    # A Ctrl-C from the moment the run is announced stops it as one in start-up does, also where the
    # process was started with SIGINT ignored (a background job of a script): the trainer acts on it
    # later in any case.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        say(f"gdpo-train: resuming {config.run_dir} from step {inputs.resume_step} of {config.steps}"
            if inputs.resume_step else f"gdpo-train: a new run in {config.run_dir}, {config.steps} steps")
        outcome = run(config, inputs, machine)
    except KeyboardInterrupt as e:
        say(_stopped_by_ctrl_c(e, inputs.resume_step))
        return EXIT_CTRL_C
    return finish(config, outcome)


def _stopped_by_ctrl_c(interrupt: KeyboardInterrupt, resume_step: int) -> str:
    """What a Ctrl-C that ended :func:`run` did: a second one stopped the run where it was (the
    trainer raises ``StoppedAtOnce``); a single one before the trainer took over the signals
    stopped the start-up."""
    trainer = sys.modules.get("gdpo_megatron.trainer")  # not loaded: the interrupt cannot be its
    if trainer is not None and isinstance(interrupt, trainer.StoppedAtOnce):
        return ("gdpo-train: stopped at once by a second Ctrl-C; rerun the same command to resume from the last "
                "checkpoint")
    rerun = f"resume from step {resume_step}" if resume_step else "start the run"
    return f"gdpo-train: stopped by Ctrl-C during start-up, before any step; rerun the same command to {rerun}"


def program() -> int:
    """The ``gdpo-train`` program: :func:`main` on ``sys.argv``, in a process whose host
    allocator is set up for CPU training (:mod:`gdpo_megatron.commands.cpu_malloc`)."""
    reexec_with_tcmalloc()
    return main()


def run(config, inputs, machine) -> str:
    """Place this rank on ``machine`` and join the launcher's process group (torchrun, srun, or a
    single process), install the CPU shim there, check this machine, train, clean up; what
    :meth:`Trainer.train` returned.

    A rank that lost a peer prints its line, ends what would outlive it (:meth:`Trainer.abandon`)
    and exits with :data:`EXIT_PEER_LOST` at once: nothing it holds is saved any more (the last
    complete checkpoint is on disk), and the rest of the clean-up, vLLM's shutdown and the
    teardown of the process groups at exit, waits on the lost peer or on a full garbage
    collection of the process (seconds to tens of seconds under load), while Slurm's grace for
    the step's other tasks runs."""
    import torch.distributed as dist

    from gdpo_megatron.distributed.launch import init_distributed
    from gdpo_megatron.distributed.peers import Peers, is_lost_peer
    from gdpo_megatron.policy import cpu_compat
    from gdpo_megatron.preflight.doctor import preflight
    from gdpo_megatron.trainer import Trainer

    peers = trainer = None
    try:
        _, placement = init_distributed(machine, timeout=config.distributed.timeout)
        cpu_compat.install(machine)
        peers = Peers.gather()
        # Libraries against the pins, GPU, precision, NCCL, memory plan: gdpo-doctor's checks, on
        # every rank, with the device set and the model that base_model holds.
        preflight(dataclasses.replace(config, policy=dataclasses.replace(config.policy, model=inputs.model)),
                  dist.get_world_size())
        trainer = Trainer(config, inputs, placement)
        return trainer.train()
    except Exception as e:
        if not is_lost_peer(e):
            raise
        line = _lost_peer_line(e, peers, config, trainer.step_started if trainer else None)
        # Now, on every rank left (rank 0 may be the lost one).
        print(f"error: {line}", file=sys.stderr, flush=True)
        if trainer is not None:
            trainer.abandon()
        sys.stdout.flush()
        os._exit(EXIT_PEER_LOST)
    finally:
        if trainer is not None:
            trainer.close()


def finish(config, outcome: str) -> int:
    """Rank 0 plots the run and prints how it ended and where its outputs are; the exit status."""
    from gdpo_megatron.trainer import DONE, PREEMPTED, STOPPED

    how, status = {
        DONE: ("finished", 0),
        PREEMPTED: ("stopped by the scheduler; requeue the job or rerun the same command to resume", EXIT_REQUEUE),
        STOPPED: ("stopped by Ctrl-C; rerun the same command to resume", EXIT_CTRL_C),
    }[outcome]
    if launch_rank() == 0:
        from gdpo_megatron.metrics import read_metrics
        from gdpo_megatron.plot import plot_runs
        from gdpo_megatron.run_dir import summary

        # Nothing to plot when a stop during start-up came before the run's first step.
        plots = plot_runs([config.run_dir], config.run_dir) if read_metrics(config.run_dir) else []
        print(f"gdpo-train: {how}\n{summary(config.run_dir, config.rewards.names, plots)}", flush=True)
    return status


def _lost_peer_line(error: BaseException, peers, config, step: int | None) -> str:
    """Who lost whom, where (``step``: the trainer's step in progress, 0-based), why, and what a
    rerun resumes from."""
    from gdpo_megatron.checkpoint.state import complete_steps
    from gdpo_megatron.distributed.peers import LostPeer, describe, reason
    from gdpo_megatron.run_dir import CHECKPOINT_DIR

    lost = peers.lost(error) if peers else LostPeer((), (), reason(str(error)))
    me = f"rank {peers.rank} ({socket.gethostname()})" if peers else socket.gethostname()
    root = Path(config.run_dir) / CHECKPOINT_DIR
    with warnings.catch_warnings():  # not about one this failure left half-written
        warnings.simplefilter("ignore")
        steps = complete_steps(root)
    resume = f"the last complete checkpoint is step {steps[-1]} in {root}" if steps else f"no checkpoint yet in {root}"
    return f"{me} lost {describe(lost)} {_where(error, step)}: {lost.reason}; {resume}"


def _where(error: BaseException, step: int | None) -> str:
    """``in step 4 (Trainer.step > fail_together)``: the step (``step`` + 1; None: the loop had
    not started), the trainer's innermost method in the traceback and the function of the
    package it called."""
    import gdpo_megatron
    from gdpo_megatron import trainer

    package = str(Path(gdpo_megatron.__file__).parent)
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    in_trainer = [i for i, f in enumerate(frames) if f.f_code.co_filename == trainer.__file__]
    if not in_trainer:
        return "at start-up"
    innermost = in_trainer[-1]
    path = [frames[innermost].f_code.co_qualname]
    below = [f for f in frames[innermost + 1:] if f.f_code.co_filename.startswith(package)]
    if below:
        path.append(below[0].f_code.co_qualname)
    where = " > ".join(path)
    return f"in step {step + 1} ({where})" if step is not None else f"in {where}"
