"""``gdpo-convert``: Hugging Face directory <-> Megatron checkpoint.

    gdpo-convert hf-to-megatron HF_DIR CHECKPOINT_ROOT [--tp N --pp N --dtype fp32|bf16]
    gdpo-convert megatron-to-hf CHECKPOINT_ROOT OUT_DIR [--step N --tokenizer DIR --dtype ...]

``hf-to-megatron`` writes ``CHECKPOINT_ROOT/step_0`` in the training-checkpoint format (the
model only), with the model config and the Hugging Face ``config.json`` in its state, so any
TP/PP can load it. ``megatron-to-hf`` reads a converted or a training checkpoint (default:
the newest). One process is enough; under ``torchrun`` the work is split over TP/PP ranks.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch.distributed as dist

from gdpo_megatron.policy.config import DTYPES, ModelConfig, ParallelConfig, PrecisionConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdpo-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
        p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="parameter dtype (default: bf16 with CUDA, fp32 without)")

    to_megatron = sub.add_parser("hf-to-megatron", help="Hugging Face directory -> Megatron checkpoint")
    to_megatron.add_argument("hf_dir", type=Path)
    to_megatron.add_argument("checkpoint_root", type=Path)
    common(to_megatron)

    to_hf = sub.add_parser("megatron-to-hf", help="Megatron checkpoint -> Hugging Face directory")
    to_hf.add_argument("checkpoint_root", type=Path)
    to_hf.add_argument("out_dir", type=Path)
    to_hf.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    to_hf.add_argument("--tokenizer", type=Path, default=None,
                       help="directory whose tokenizer files to copy (default: the imported model's, if it exists)")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (default 5)")
    common(to_hf)
    return parser


def model_config_of(config: dict, where: str) -> ModelConfig:
    """The model section of a checkpoint's config (``model`` or ``policy.model``)."""
    section = config.get("model") or config.get("policy", {}).get("model")
    if not isinstance(section, dict):
        raise ValueError(f"{where}: config has no 'model' or 'policy.model' section")
    return ModelConfig(**section)


def _hf_to_megatron(args, parallel: ParallelConfig, precision: PrecisionConfig) -> None:
    from gdpo_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from gdpo_megatron.checkpoint.hf_io import load_hf_weights
    from gdpo_megatron.checkpoint.manager import CheckpointManager
    from gdpo_megatron.policy.model import build_model

    hf_config = read_hf_config(args.hf_dir)
    config = model_config_from_hf(hf_config)
    model = build_model(config, parallel, precision)
    load_hf_weights(model, config, args.hf_dir, progress=True)
    state = {"model": dataclasses.asdict(config), "hf_config": hf_config, "hf_dir": str(args.hf_dir.resolve())}
    path = CheckpointManager(args.checkpoint_root, keep_last=None).save(0, model, config=state)
    if dist.get_rank() == 0:
        print(f"wrote {path}")


def _megatron_to_hf(args, parallel: ParallelConfig, precision: PrecisionConfig) -> None:
    from gdpo_megatron.checkpoint.hf_io import save_hf_checkpoint
    from gdpo_megatron.checkpoint.manager import CheckpointManager, read_training_state
    from gdpo_megatron.policy.model import build_model

    manager = CheckpointManager(args.checkpoint_root, keep_last=None)
    step = manager.latest_step() if args.step is None else args.step
    if step is None:
        raise FileNotFoundError(f"{args.checkpoint_root}: no complete checkpoint (expected step_<N> directories)")
    saved = read_training_state(manager.step_dir(step)).config
    config = model_config_of(saved, str(manager.step_dir(step)))
    model = build_model(config, parallel, precision)
    manager.load(model, step=step, restore_rng=False)
    tokenizer = args.tokenizer or (Path(saved["hf_dir"]) if "hf_dir" in saved else None)
    if tokenizer is not None and not tokenizer.is_dir():
        tokenizer = None
    path = save_hf_checkpoint(model, config, args.out_dir, base_hf_config=saved.get("hf_config"),
                              tokenizer_dir=tokenizer, max_shard_bytes=int(args.max_shard_gb * 2**30),
                              progress=True)
    if dist.get_rank() == 0:
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    """Entry point; uses the process group if one exists, else starts one from the launcher env."""
    from gdpo_megatron.distributed.launch import init_distributed
    from gdpo_megatron.policy.model import destroy_model_parallel, initialize_model_parallel

    args = _parser().parse_args(argv)
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    precision = PrecisionConfig(dtype=args.dtype or "auto")
    started = not dist.is_initialized()
    if started:
        init_distributed()
    initialize_model_parallel(parallel)
    try:
        (_hf_to_megatron if args.command == "hf-to-megatron" else _megatron_to_hf)(args, parallel, precision)
    finally:
        destroy_model_parallel()
        if started:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
