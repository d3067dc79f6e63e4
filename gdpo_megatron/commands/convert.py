"""``gdpo-convert``: Hugging Face directory <-> Megatron checkpoint.

    gdpo-convert hf-to-megatron HF_DIR CHECKPOINT_ROOT [--tp N --pp N --dtype fp32|bf16]
    gdpo-convert megatron-to-hf CHECKPOINT_ROOT OUT_DIR [--step N --tokenizer DIR --dtype ...]

``hf-to-megatron`` writes ``CHECKPOINT_ROOT/step_0`` in the training-checkpoint format (the
model only), with the model config and the Hugging Face ``config.json`` in its state, so any
TP/PP can load it. ``megatron-to-hf`` reads a converted or a training checkpoint (default:
the newest); from a training checkpoint it also writes how the run prompted and sampled
(:mod:`gdpo_megatron.checkpoint.trained_with`), as gdpo-train's export does. One process is
enough; under ``torchrun`` the work is split over TP/PP ranks.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from gdpo_megatron.checkpoint.hf_files import TOKENIZER_FILES
from gdpo_megatron.checkpoint.state import check_files, complete_steps, model_section, read_training_state, step_dir
from gdpo_megatron.checkpoint.trained_with import TrainedWith, trained_with, write_trained_with
from gdpo_megatron.commands.console import (ArgumentParser, console_entry, positive_float, positive_int,
                                            quiet_defaults)
from gdpo_megatron.errors import InputError, UsageError
from gdpo_megatron.config.policy import DTYPES, ModelConfig, ParallelConfig, PrecisionConfig
from gdpo_megatron.device import this_machine
from gdpo_megatron.resolve import resolve_precision
from gdpo_megatron.preflight.validation import (check_layout, check_output_dir, check_weights, launch_world_size,
                                                model_shape, read_model_config)


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="gdpo-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
        p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (default 1)")
        p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="parameter dtype (default: bf16 with CUDA, fp32 without)")

    to_megatron = sub.add_parser("hf-to-megatron", help="Hugging Face directory -> Megatron checkpoint")
    to_megatron.add_argument("hf_dir", type=Path)
    to_megatron.add_argument("checkpoint_root", type=Path, help="a new or empty directory")
    common(to_megatron)

    to_hf = sub.add_parser("megatron-to-hf", help="Megatron checkpoint -> Hugging Face directory")
    to_hf.add_argument("checkpoint_root", type=Path)
    to_hf.add_argument("out_dir", type=Path, help="a new or empty directory")
    to_hf.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    to_hf.add_argument("--tokenizer", type=Path, default=None,
                       help="directory whose tokenizer files to copy (default: the imported model's, if it exists)")
    to_hf.add_argument("--max-shard-gb", type=positive_float, default=5.0,
                       help="safetensors shard size (default 5)")
    common(to_hf)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    return _parser().parse_args(argv)


def model_config_of(config: dict, where: str) -> ModelConfig:
    """The model section of a checkpoint's config (``model`` or ``policy.model``)."""
    section = model_section(config)
    if section is None:
        raise InputError(f"{where}: config has no 'model' or 'policy.model' section")
    try:
        return ModelConfig(**section)
    except (TypeError, ValueError) as e:
        raise InputError(f"{where}: config's model section: {e}") from None


@dataclasses.dataclass
class Plan:
    """What a conversion reads and writes, every input checked (see :func:`check`)."""

    model: ModelConfig
    hf_config: Optional[dict]  # the Hugging Face config.json read or stored with the checkpoint
    step: int = 0  # megatron-to-hf: the checkpoint to read
    tokenizer: Optional[Path] = None  # megatron-to-hf: where the tokenizer files come from
    trained: Optional[TrainedWith] = None  # megatron-to-hf of a training checkpoint: how the run prompted


def check(args, parallel: ParallelConfig, world_size: int) -> Plan:
    """Every input of the conversion, before a process group or a model exists; nothing is written."""
    layout = "--tp/--pp"
    if args.command == "hf-to-megatron":
        check_output_dir(args.checkpoint_root, "CHECKPOINT_ROOT", empty=True)
        hf_config = read_model_config(args.hf_dir, "HF_DIR")
        model = model_shape(hf_config, "HF_DIR")
        check_layout(model, parallel, world_size, layout)
        check_weights(args.hf_dir, "HF_DIR", model)
        return Plan(model, hf_config)

    check_output_dir(args.out_dir, "OUT_DIR", empty=True)
    tokenizer = args.tokenizer
    if tokenizer is not None and not tokenizer.is_dir():
        raise UsageError(f"--tokenizer: {tokenizer} is not a directory")
    if tokenizer is not None and not any((tokenizer / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"--tokenizer: {tokenizer} holds no tokenizer files (expected some of "
                         f"{', '.join(TOKENIZER_FILES)})")

    if not args.checkpoint_root.is_dir():
        raise InputError(f"CHECKPOINT_ROOT: {args.checkpoint_root} is not a directory")
    steps = complete_steps(args.checkpoint_root)
    if not steps:
        raise InputError(f"CHECKPOINT_ROOT: {args.checkpoint_root} holds no complete checkpoint "
                         "(expected step_<N> directories)")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise UsageError(f"--step: no step {step} in {args.checkpoint_root}; steps: {', '.join(map(str, steps))}")
    directory = step_dir(args.checkpoint_root, step)
    saved = read_training_state(directory).config
    model = model_config_of(saved, str(directory))
    check_files(directory)
    check_layout(model, parallel, world_size, layout)
    if tokenizer is None and "hf_dir" in saved and Path(saved["hf_dir"]).is_dir():
        tokenizer = Path(saved["hf_dir"])  # the imported model's, when it is still there
    trained = trained_with(saved) if {"data", "rollout"} <= saved.keys() else None
    return Plan(model, saved.get("hf_config"), step, tokenizer, trained)


def _hf_to_megatron(args, plan: Plan, placement, parallel: ParallelConfig, precision: PrecisionConfig) -> None:
    from gdpo_megatron.checkpoint.hf_io import load_hf_weights
    from gdpo_megatron.checkpoint.manager import CheckpointManager
    from gdpo_megatron.policy.model import build_model

    model = build_model(plan.model, placement, parallel, precision)
    load_hf_weights(model, plan.model, args.hf_dir, progress=True)
    state = {"model": dataclasses.asdict(plan.model), "hf_config": plan.hf_config, "hf_dir": str(args.hf_dir.resolve())}
    path = CheckpointManager(args.checkpoint_root, keep_last=None).save(0, model, config=state)
    if dist.get_rank() == 0:
        print(f"wrote {path}")


def _megatron_to_hf(args, plan: Plan, placement, parallel: ParallelConfig, precision: PrecisionConfig) -> None:
    from gdpo_megatron.checkpoint.hf_io import save_hf_checkpoint
    from gdpo_megatron.checkpoint.manager import CheckpointManager
    from gdpo_megatron.policy.model import build_model

    model = build_model(plan.model, placement, parallel, precision)
    CheckpointManager(args.checkpoint_root, keep_last=None).load(model, step=plan.step, restore_rng=False)
    path = save_hf_checkpoint(model, plan.model, args.out_dir, base_hf_config=plan.hf_config,
                              tokenizer_dir=plan.tokenizer, max_shard_bytes=int(args.max_shard_gb * 2**30),
                              progress=True)
    if dist.get_rank() == 0:
        if plan.trained is not None:
            write_trained_with(path, plan.trained)
        print(f"wrote {path}")


@console_entry
def main(argv: list[str]) -> int:
    """Entry point; uses the process group if one exists, else starts one from the launcher env."""
    args = parse(argv)
    quiet_defaults()
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    machine = this_machine()
    precision = resolve_precision(PrecisionConfig(dtype=args.dtype or "auto"), machine)
    started = not dist.is_initialized()
    plan = check(args, parallel, launch_world_size() if started else dist.get_world_size())

    from gdpo_megatron.device import place_rank
    from gdpo_megatron.distributed.launch import init_distributed, resolve_launch_env
    from gdpo_megatron.policy import cpu_compat
    from gdpo_megatron.policy.model import destroy_model_parallel, initialize_model_parallel

    if started:
        _, placement = init_distributed(machine)
    else:
        placement = place_rank(machine, resolve_launch_env().local_rank)
    cpu_compat.install(machine)
    initialize_model_parallel(parallel)
    try:
        convert = _hf_to_megatron if args.command == "hf-to-megatron" else _megatron_to_hf
        convert(args, plan, placement, parallel, precision)
    finally:
        destroy_model_parallel()
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
