"""Console entry points: ``gdpo-train`` and ``gdpo-plot`` (``python -m gdpo_megatron.cli train|plot``).

Errors and exit statuses follow :mod:`gdpo_megatron.errors`: a user error is one line on
rank 0 and status 2, before anything heavy starts.
"""
from __future__ import annotations

import os
import sys

from gdpo_megatron.cpu_malloc import reexec_with_tcmalloc
from gdpo_megatron.errors import ArgumentParser, UsageError, console_entry

# Exit status of a run stopped by SIGUSR1/SIGTERM after saving a checkpoint: EX_TEMPFAIL,
# "try again later" (a Slurm script requeues the job on it).
EXIT_INTERRUPTED = 75


@console_entry
def train_main(argv: list[str]) -> int:
    """``gdpo-train --config FILE [key.sub=value ...]``: train under torchrun, srun or alone."""
    parser = ArgumentParser(prog="gdpo-train", description="Multi-reward RL with GDPO on Megatron-core.")
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of the config")
    args = parser.parse_args(argv)
    quiet_defaults()

    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.validation import check_training, launch_world_size

    # Every check that needs no model, before the process group, the policy or vLLM exist.
    config = load_config(TrainConfig, args.config, args.overrides)
    inputs = check_training(config, launch_world_size())

    from gdpo_megatron.trainer import run

    return EXIT_INTERRUPTED if run(config, inputs) == "interrupted" else 0


def train_program() -> int:
    """The ``gdpo-train`` program: :func:`train_main` on ``sys.argv``, in a process whose host
    allocator is set up for CPU training (:mod:`gdpo_megatron.cpu_malloc`)."""
    reexec_with_tcmalloc()
    return train_main()


def quiet_defaults() -> None:
    """Terse vLLM logs. (Threads: each rank uses its share of the host's cores, see
    :mod:`gdpo_megatron.distributed.threads`; ``OMP_NUM_THREADS`` overrides it.)"""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@console_entry
def plot_main(argv: list[str]) -> int:
    """``gdpo-plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A B ...] [--smooth N]``.

    Runs given the same label (e.g. the seeds of one mode) are drawn as their mean with a
    min-max band."""
    parser = ArgumentParser(prog="gdpo-plot", description="Plot rewards and advantage diagnostics of runs.")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default=None, help="output directory (default: the first run's)")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="legend labels, one per run; runs sharing a label are drawn as mean and band")
    parser.add_argument("--smooth", type=int, default=1, help="draw each run's trailing mean over N steps")
    args = parser.parse_args(argv)

    from gdpo_megatron.plot import DIAGNOSTICS_PNG, REWARDS_PNG, plot_runs
    from gdpo_megatron.validation import check_output_dir, check_output_file

    key = "--out" if args.out else "RUN_DIR"
    out = check_output_dir(args.out or args.run_dirs[0], key)
    for name in (REWARDS_PNG, DIAGNOSTICS_PNG):
        check_output_file(out / name, key)
    for path in plot_runs(args.run_dirs, out, args.labels, smooth=args.smooth):
        print(path)
    return 0


COMMANDS = {"train": train_main, "plot": plot_main}


@console_entry
def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "nothing"
        raise UsageError(f"python -m gdpo_megatron.cli: expected a command, one of {', '.join(COMMANDS)}; got {got}")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    reexec_with_tcmalloc()
    sys.exit(main())
