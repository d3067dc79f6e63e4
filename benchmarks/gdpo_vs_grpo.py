"""GDPO vs GRPO vs GRPO without std on the bundled tool-calling task, several seeds each.

    python benchmarks/gdpo_vs_grpo.py [--seeds 3] [--steps 40] [--out runs/gdpo_vs_grpo]

Every run starts from the same base model (``configs/tiny_cpu.yaml``'s, written once), gets
the same budget (steps x prompts x group size) and differs only in ``advantage.mode`` and
the seed. Prints each reward's mean over the last 5 steps (mean +- std over seeds) and writes
one overlay plot per mode set (``rewards.png``, ``diagnostics.png`` in ``--out``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.metrics import read_metrics
from gdpo_megatron.plot import plot_runs

CONFIG = "configs/tiny_cpu.yaml"
MODES = ("gdpo", "grpo", "grpo_no_std")
TAIL = 5  # final value = mean over the last TAIL steps


def run(mode: str, seed: int, steps: int, run_dir: Path) -> None:
    if (run_dir / "hf").is_dir():
        return  # finished earlier: reuse
    cmd = [sys.executable, "-m", "gdpo_megatron.cli", "train", "--config", CONFIG, f"advantage.mode={mode}",
           f"seed={seed}", f"steps={steps}", f"run_dir={run_dir}", "logging.progress_bar=false",
           "checkpoint.save_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)


def final_means(run_dir: Path, names: list[str]) -> dict[str, float]:
    records = read_metrics(run_dir)[-TAIL:]
    return {n: statistics.fmean(r[f"reward/{n}/mean"] for r in records) for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/gdpo_vs_grpo")
    args = parser.parse_args()
    config = load_config(TrainConfig, CONFIG)
    names = config.rewards.names
    if not Path(config.base_model, "config.json").is_file():
        from gdpo_megatron.demo.warmup import make_base_model

        make_base_model(config.base_model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, list[Path]] = {m: [] for m in MODES}
    for seed in range(args.seeds):  # seeds outermost: machine drift hits every mode alike
        for mode in MODES:
            run_dir = out / f"{mode}_seed{seed}"
            print(f"running {run_dir.name} ...", flush=True)
            run(mode, seed, args.steps, run_dir)
            runs[mode].append(run_dir)

    header = "| mode | " + " | ".join(names) + " |"
    print(f"\nreward means over the last {TAIL} of {args.steps} steps, mean +- std over {args.seeds} seeds\n")
    print(header)
    print("|" + "---|" * (len(names) + 1))
    for mode in MODES:
        finals = [final_means(d, names) for d in runs[mode]]
        cells = []
        for n in names:
            values = [f[n] for f in finals]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.fmean(values):.3f} +- {spread:.3f}")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    first = [runs[m][0] for m in MODES]
    for png in plot_runs(first, out, labels=[f"{m} (seed 0)" for m in MODES]):
        print(f"plot: {png}")


if __name__ == "__main__":
    main()
