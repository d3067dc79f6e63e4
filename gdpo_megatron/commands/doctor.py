"""``gdpo-doctor [--config FILE [key.sub=value ...]] [--nodes N] [--only CHECK]``: one table.

The checks are :mod:`gdpo_megatron.preflight.doctor`'s. Exit status: 0 when nothing
mismatches (checks that cannot run here do not fail), 1 on a mismatch, 2 on bad input.
"""
from __future__ import annotations

import argparse
import sys

import torch

from gdpo_megatron.commands.console import ArgumentParser, console_entry, positive_int, quiet_defaults
from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.device import cuda_device_count
from gdpo_megatron.preflight.doctor import CHECKS, SKIP_ENV, Target, format_table, mismatches, run_checks
from gdpo_megatron.preflight.pins import PIN_FILE, read_pins


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    parser = ArgumentParser(
        prog="gdpo-doctor",
        description="Check this machine's libraries, GPU, NCCL and memory against the pins and a config. "
                    f"{SKIP_ENV}=CHECK[,CHECK...] skips checks (e.g. memory, where gdpo-plan's estimate is wrong).")
    parser.add_argument("--config", help="training YAML: also check its precision and memory plan here")
    parser.add_argument("--nodes", type=positive_int, default=1, help="nodes of the job (for the memory plan)")
    parser.add_argument("--only", action="append", choices=list(CHECKS), metavar="CHECK",
                        help=f"run only this check (repeatable): {', '.join(CHECKS)}")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of the config")
    args = parser.parse_args(argv)
    if args.overrides and not args.config:
        parser.error("overrides need --config")
    return args


@console_entry
def main(argv: list[str]) -> int:
    args = parse(argv)
    quiet_defaults()
    config = load_config(TrainConfig, args.config, args.overrides) if args.config else None
    pins = read_pins()
    world_size = args.nodes * max(cuda_device_count(), 1)
    rows = run_checks(Target(pins, config, world_size), args.only)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    print(f"gdpo-doctor: pins {PIN_FILE}; torch {torch.__version__} ({build} build); "
          f"Python {sys.version.split()[0]}; world size {world_size}")
    print(format_table(rows))
    failed = mismatches(rows)
    print(f"gdpo-doctor: {len(failed)} mismatch(es): {', '.join(r.name for r in failed)}" if failed
          else "gdpo-doctor: no mismatch")
    return 1 if failed else 0
