"""``gdpo-train --config FILE [key.sub=value ...]``: train under torchrun, srun or alone.

Every check that needs no model runs first (:func:`~gdpo_megatron.preflight.validation.check_training`),
before the process group, the policy or vLLM exist. A run directory whose run is finished says
so and stops there; otherwise one line says whether the run starts or resumes. Then each rank
joins the launcher's process group, checks its machine against the pins and the config
(:func:`~gdpo_megatron.preflight.doctor.preflight`), and runs the
:class:`~gdpo_megatron.trainer.Trainer`. The run ends with a summary: reward means and where
its checkpoint, export, metrics and plots are.

Exit statuses beyond :mod:`.console`'s: :data:`EXIT_REQUEUE` after SIGUSR1/SIGTERM (a
checkpoint was saved; a Slurm script requeues the job on it), :data:`EXIT_CTRL_C` after Ctrl-C.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from gdpo_megatron.commands.console import EXIT_CTRL_C, ArgumentParser, console_entry, launch_rank, quiet_defaults
from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc

EXIT_REQUEUE = 75  # EX_TEMPFAIL: "try again later"


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
    from gdpo_megatron.preflight.validation import check_training, launch_world_size

    config = load_config(TrainConfig, args.config, args.overrides)
    inputs = check_training(config, launch_world_size())
    if inputs.resume_step >= config.steps:
        say(f"gdpo-train: {config.run_dir} has finished step {inputs.resume_step} of {config.steps}: nothing to "
            "train (raise steps to train on)")
        return 0
    say(f"gdpo-train: resuming {config.run_dir} from step {inputs.resume_step} of {config.steps}" if inputs.resume_step
        else f"gdpo-train: a new run in {config.run_dir}, {config.steps} steps")
    try:
        outcome = run(config, inputs)
    except KeyboardInterrupt:
        say("gdpo-train: stopped at once by a second Ctrl-C; rerun the same command to resume from the last "
            "checkpoint")
        return EXIT_CTRL_C
    return finish(config, outcome)


def program() -> int:
    """The ``gdpo-train`` program: :func:`main` on ``sys.argv``, in a process whose host
    allocator is set up for CPU training (:mod:`gdpo_megatron.commands.cpu_malloc`)."""
    reexec_with_tcmalloc()
    return main()


def run(config, inputs) -> str:
    """Join the launcher's process group (torchrun, srun, or a single process), check this
    machine, train, clean up; what :meth:`Trainer.train` returned."""
    import torch.distributed as dist

    from gdpo_megatron.distributed.launch import init_distributed
    from gdpo_megatron.preflight.doctor import preflight
    from gdpo_megatron.trainer import Trainer

    init_distributed()
    # Libraries against the pins, GPU, precision, NCCL, memory plan: gdpo-doctor's checks, on
    # every rank, with the device set and the model that base_model holds.
    preflight(dataclasses.replace(config, policy=dataclasses.replace(config.policy, model=inputs.model)),
              dist.get_world_size())
    trainer = Trainer(config, inputs)
    try:
        return trainer.train()
    finally:
        trainer.close()


def finish(config, outcome: str) -> int:
    """Rank 0 plots the run and prints how it ended and where its outputs are; the exit status."""
    from gdpo_megatron.trainer import DONE, PREEMPTED

    if launch_rank() == 0:
        from gdpo_megatron.plot import plot_runs
        from gdpo_megatron.run_dir import summary

        plots = plot_runs([config.run_dir], config.run_dir)
        how = {DONE: "finished", PREEMPTED: "stopped by the scheduler; requeue the job or rerun the same command "
                                            "to resume"}.get(outcome, "stopped by Ctrl-C; rerun the same command to "
                                                                      "resume")
        print(f"gdpo-train: {how}\n{summary(config.run_dir, config.rewards.names, plots)}", flush=True)
    return {DONE: 0, PREEMPTED: EXIT_REQUEUE}.get(outcome, EXIT_CTRL_C)


def say(line: str) -> None:
    """One line on rank 0 (every rank runs the same checks)."""
    if launch_rank() == 0:
        print(line, file=sys.stderr, flush=True)
