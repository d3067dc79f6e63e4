"""Console entry points: ``gdpo-train`` and ``gdpo-plot`` (``python -m gdpo_megatron.cli train|plot``)."""
from __future__ import annotations

import argparse
import os
import sys

# Exit status of a run stopped by SIGUSR1/SIGTERM after saving a checkpoint: EX_TEMPFAIL,
# "try again later" (a Slurm script requeues the job on it).
EXIT_INTERRUPTED = 75


def train_main(argv: list[str] | None = None) -> int:
    """``gdpo-train --config FILE [key.sub=value ...]``: train under torchrun, srun or alone."""
    parser = argparse.ArgumentParser(prog="gdpo-train", description="Multi-reward RL with GDPO on Megatron-core.")
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of the config")
    args = parser.parse_args(argv)
    quiet_defaults()

    from gdpo_megatron.config import TrainConfig, load_config

    config = load_config(TrainConfig, args.config, args.overrides)  # config errors before any start-up cost

    from gdpo_megatron.trainer import run

    return EXIT_INTERRUPTED if run(config) == "interrupted" else 0


def quiet_defaults() -> None:
    """Terse vLLM logs. (Threads: each rank uses its share of the host's cores, see
    :mod:`gdpo_megatron.distributed.threads`; ``OMP_NUM_THREADS`` overrides it.)"""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def plot_main(argv: list[str] | None = None) -> int:
    """``gdpo-plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A B ...]``."""
    parser = argparse.ArgumentParser(prog="gdpo-plot", description="Plot rewards and advantage diagnostics of runs.")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default=None, help="output directory (default: the first run's)")
    parser.add_argument("--labels", nargs="*", default=None, help="legend labels, one per run")
    args = parser.parse_args(argv)

    from gdpo_megatron.plot import plot_runs

    for path in plot_runs(args.run_dirs, args.out or args.run_dirs[0], args.labels):
        print(path)
    return 0


COMMANDS = {"train": train_main, "plot": plot_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m gdpo_megatron.cli {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
