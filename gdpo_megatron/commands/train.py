"""``gdpo-train --config FILE [key.sub=value ...]``: train under torchrun, srun or alone.

Every check that needs no model runs first (:func:`~gdpo_megatron.preflight.validation.check_training`),
before the process group, the policy or vLLM exist; then each rank joins the launcher's process
group, checks its machine against the pins and the config (:func:`~gdpo_megatron.preflight.doctor.preflight`),
and runs the :class:`~gdpo_megatron.trainer.Trainer`.
"""
from __future__ import annotations

import dataclasses

from gdpo_megatron.commands.console import ArgumentParser, console_entry, quiet_defaults
from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc

# Exit status of a run stopped by SIGUSR1/SIGTERM after saving a checkpoint: EX_TEMPFAIL,
# "try again later" (a Slurm script requeues the job on it).
EXIT_INTERRUPTED = 75


@console_entry
def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="gdpo-train", description="Multi-reward RL with GDPO on Megatron-core.")
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of the config")
    args = parser.parse_args(argv)
    quiet_defaults()

    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.preflight.validation import check_training, launch_world_size

    config = load_config(TrainConfig, args.config, args.overrides)
    inputs = check_training(config, launch_world_size())
    return EXIT_INTERRUPTED if run(config, inputs) == "interrupted" else 0


def program() -> int:
    """The ``gdpo-train`` program: :func:`main` on ``sys.argv``, in a process whose host
    allocator is set up for CPU training (:mod:`gdpo_megatron.commands.cpu_malloc`)."""
    reexec_with_tcmalloc()
    return main()


def run(config, inputs) -> str:
    """Join the launcher's process group (torchrun, srun, or a single process), check this
    machine, train, clean up; ``"done"`` or ``"interrupted"``."""
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
