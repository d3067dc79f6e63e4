"""``gdpo-plot RUN_DIR [RUN_DIR ...] [--out DIR] [--labels A B ...] [--smooth N]``.

Runs given the same label (e.g. the seeds of one mode) are drawn as their mean with a min-max band.
"""
from __future__ import annotations

import argparse

from gdpo_megatron.commands.console import ArgumentParser, console_entry


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    parser = ArgumentParser(prog="gdpo-plot", description="Plot rewards and advantage diagnostics of runs.")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default=None, help="output directory (default: the first run's)")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="legend labels, one per run; runs sharing a label are drawn as mean and band")
    parser.add_argument("--smooth", type=int, default=1, help="draw each run's trailing mean over N steps")
    return parser.parse_args(argv)


@console_entry
def main(argv: list[str]) -> int:
    args = parse(argv)

    from gdpo_megatron.plot import DIAGNOSTICS_PNG, REWARDS_PNG, plot_runs
    from gdpo_megatron.preflight.validation import check_output_dir, check_output_file

    key = "--out" if args.out else "RUN_DIR"
    out = check_output_dir(args.out or args.run_dirs[0], key)
    for name in (REWARDS_PNG, DIAGNOSTICS_PNG):
        check_output_file(out / name, key)
    for path in plot_runs(args.run_dirs, out, args.labels, smooth=args.smooth):
        print(path)
    return 0
