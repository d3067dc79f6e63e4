"""``gdpo-plan --config FILE --gpus-per-node N --gpu-memory GIB [--nodes N] [key.sub=value ...]``.

Prints the per-GPU memory of the fullest pipeline stage, with and without the distributed
optimizer (:mod:`gdpo_megatron.preflight.plan`), and exits 0 when the configured layout fits
(1 when not, 2 on bad input).
"""
from __future__ import annotations

import argparse

from gdpo_megatron.commands.console import ArgumentParser, console_entry
from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.preflight.plan import DEFAULT_OVERHEAD_GIB, ENGINE_RUNTIME_GIB, Cluster, format_plan, plan_memory


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    parser = ArgumentParser(
        prog="gdpo-plan", description="Per-GPU memory of a training config, and whether it fits, before submitting.")
    parser.add_argument("--config", required=True, help="training YAML (see configs/)")
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--gpu-memory", type=float, required=True, metavar="GIB",
                        help="memory of one GPU in GiB (an '80 GB' A100/H100 reports 79.6)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--overhead", type=float, default=DEFAULT_OVERHEAD_GIB, metavar="GIB",
                        help="per-GPU allowance for the CUDA context, NCCL and fragmentation")
    parser.add_argument("--vllm-runtime", type=float, default=ENGINE_RUNTIME_GIB, metavar="GIB",
                        help="per-GPU allowance for what vLLM holds besides weights and KV cache (CUDA graphs, "
                             "NCCL, activations), awake or asleep; the engine sizes its start-up with the default")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of the config")
    return parser.parse_args(argv)


@console_entry
def main(argv: list[str]) -> int:
    args = parse(argv)
    cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_memory, args.overhead, args.vllm_runtime)
    plan = plan_memory(load_config(TrainConfig, args.config, args.overrides), cluster)
    print(format_plan(plan))
    return 0 if plan.fits(plan.distributed_optimizer) else 1
