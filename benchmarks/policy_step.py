"""Policy train-step throughput: TP=1 vs TP=2 (and PP=2) on the CPU; the local spec's core
attention vs megatron's; logits from the first target vs at every position; BF16 vs FP8 MFU
on a GPU.

    OMP_NUM_THREADS=1 python benchmarks/policy_step.py [--repeats 5]   # CPU, tiny model
    OMP_NUM_THREADS=1 python benchmarks/policy_step.py --attention      # CPU, 13.2M model
    OMP_NUM_THREADS=1 python benchmarks/policy_step.py --logits         # CPU, 13.2M + 32K vocab
    python benchmarks/policy_step.py --gpu                                 # needs CUDA + TE

(a) CPU: the tiny model (hidden 128, 2 heads of 64, 2 layers, vocab 512, fp32), one
    `PolicyWorker.train_step` (forward-backward over micro-batches, DDP, Adam) on the same
    batch, at TP=1 in one process and at TP=2 and PP=2 in two gloo processes. Tokens/s counts
    every token of the batch (prompt and completion). Layouts alternate repeat by repeat.
(b) --attention: a 13.2M-parameter Llama (hidden 512, 8 heads, 4 layers, FFN 1376, vocab
    512, fp32), 4 x 1024 tokens in one micro-batch, one process per run: the local spec's core
    attention (torch's scaled_dot_product_attention) against megatron-core's own
    DotProductAttention swapped in, step time and the process's peak RSS.
(c) --logits: the same body with a 32,000-token vocabulary, 4 x 1024 tokens of which the
    first 768 are prompt (a tool-calling shape: tool schemas, then a short call): the update
    computing logits from each micro-batch's first target (what it does) against every
    position, step time and peak RSS, one process per run.
(d) --gpu: a Llama-2-7B-shaped slice (hidden 4096, FFN 11008, 32 heads) with 2 layers, one
    GPU, bf16 vs FP8 (hybrid, delayed scaling) through Transformer Engine. MFU is model
    FLOPs (6 x matmul parameters + 6 x layers x attention width x sequence, per token:
    causal attention, each token against half the sequence on average) over the GPU's
    dense BF16 peak.
Every number is the median of `--repeats` repeats of `--steps` steps, after one warm-up step.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: local worlds, tiny models

import torch

from gdpo_megatron.policy.batch import PolicyBatch
from gdpo_megatron.config.policy import ModelConfig, OptimConfig, ParallelConfig, PolicyConfig, PrecisionConfig
from support.local_world import LocalWorld
from support.placement import this_rank

# Dense BF16 tensor-core peaks (FLOP/s) by device-name fragment.
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def make_batch(model: ModelConfig, batch_size: int, seq_length: int, prompt_share: float = 0.25) -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (batch_size, seq_length), generator=g)
    mask = torch.zeros(batch_size, seq_length, dtype=torch.bool)
    mask[:, int(seq_length * prompt_share):] = True  # the prompt, then the completion
    old = -6.0 + 0.1 * torch.randn(batch_size, seq_length - 1, generator=g)
    return PolicyBatch(ids, mask, torch.randn(batch_size, generator=g), rollout_logprobs=old)


def timed_steps(config: PolicyConfig, batch_size: int, seq_length: int, steps: int,
                prompt_share: float = 0.25) -> float:
    """Median seconds of one train step (run on every rank; rank 0's answer is used)."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    batch = make_batch(config.model, batch_size, seq_length, prompt_share)
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        worker.train_step(batch)  # warm-up
        times = []
        for _ in range(steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            worker.train_step(batch)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_benchmark(args) -> None:
    model = ModelConfig.preset("tiny")
    layouts = {"TP=1": (1, ParallelConfig()), "TP=2": (2, ParallelConfig(tensor_model_parallel_size=2)),
               "PP=2": (2, ParallelConfig(pipeline_model_parallel_size=2))}
    tokens = args.batch_size * args.seq_length
    seconds = {name: [] for name in layouts}
    with LocalWorld(1) as one, LocalWorld(2) as two:
        worlds = {1: one, 2: two}
        for _ in range(args.repeats):
            for name, (size, parallel) in layouts.items():
                config = PolicyConfig(model=model, parallel=parallel, optim=OptimConfig(lr=1e-5),
                                      micro_batch_size=args.micro_batch_size)
                seconds[name].append(worlds[size].run(timed_steps, config, args.batch_size, args.seq_length,
                                                      args.steps)[0])
    print(f"tiny model, batch {args.batch_size} x {args.seq_length} tokens, micro-batch {args.micro_batch_size}, "
          f"median of {args.repeats} x {args.steps} steps")
    base = statistics.median(seconds["TP=1"])
    print(f"{'layout':8} {'processes':>9} {'s/step':>8} {'tokens/s':>10} {'vs TP=1':>8}")
    for name, (size, _) in layouts.items():
        median = statistics.median(seconds[name])
        print(f"{name:8} {size:>9} {median:8.4f} {tokens / median:10.0f} {base / median:8.2f}x")


def swapped_run(swap: str | None, config: PolicyConfig, batch_size: int, seq_length: int, steps: int,
                prompt_share: float) -> tuple[float, float]:
    """Median step seconds and peak RSS (GiB) of this process, with one piece of the update
    swapped for the alternative it is measured against: megatron's core attention into the
    local spec (``"megatron attention"``), or logits at every position (``"every position"``)."""
    if swap == "megatron attention":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from gdpo_megatron.policy import model

        model.SDPAttention = DotProductAttention
    elif swap == "every position":
        from gdpo_megatron.policy.worker import PolicyWorker

        PolicyWorker._logits_starts = lambda self, micro_batches: [0] * len(micro_batches)
    seconds = timed_steps(config, batch_size, seq_length, steps, prompt_share)
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def side_by_side(title: str, runs: dict[str, str | None], vocab_size: int, prompt_share: float, args) -> None:
    """The 13.2M body with each of ``runs`` (name -> swap), a fresh process per run, alternating."""
    model = ModelConfig(vocab_size=vocab_size, hidden_size=512, ffn_hidden_size=1376, num_layers=4,
                        num_attention_heads=8, max_position_embeddings=max(2048, args.seq_length))
    config = PolicyConfig(model=model, optim=OptimConfig(lr=1e-5), micro_batch_size=args.batch_size)
    results = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, swap in runs.items():
            with LocalWorld(1) as world:  # a fresh process: the peak RSS is this run's
                results[name].append(world.run(swapped_run, swap, config, args.batch_size, args.seq_length,
                                               args.steps, prompt_share)[0])
    print(f"13.2M body, vocab {vocab_size}, batch {args.batch_size} x {args.seq_length} tokens "
          f"({prompt_share:.0%} prompt), one micro-batch, median of {args.repeats} x {args.steps} steps")
    print(f"{title:30} {'s/step':>8} {'peak RSS GiB':>13}")
    for name, values in results.items():
        print(f"{name:30} {statistics.median(v[0] for v in values):8.3f} "
              f"{statistics.median(v[1] for v in values):13.2f}")


def matmul_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of a causal decoder over ``seq_length`` tokens: 6 x matmul
    parameters (forward 2, backward 4), and attention's scores and weighted values, 4 x width
    FLOPs per attended position forward, 12 with the backward, against half the sequence on
    average: 6 x layers x width x sequence (width: heads x head_dim). Counting every position
    (as for bidirectional attention) would double that term."""
    h, f, L = model.hidden_size, model.ffn_hidden_size, model.num_layers
    width = model.num_attention_heads * model.head_dim
    qkv = h * (model.num_attention_heads + 2 * model.num_query_groups) * model.head_dim
    per_layer = qkv + width * h + 3 * h * f
    params = L * per_layer + h * model.vocab_size  # + the output layer
    return 6 * params + 6 * L * width * seq_length


def gpu_benchmark(args) -> None:
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    model = ModelConfig.preset("llama2-7b", num_layers=2)
    tokens = args.batch_size * args.seq_length
    flops = matmul_flops_per_token(model, args.seq_length) * tokens
    seconds = {"bf16": [], "fp8": []}
    with LocalWorld(1, backend="nccl") as world:
        for _ in range(args.repeats):
            for label, fp8 in (("bf16", None), ("fp8", "hybrid")):
                config = PolicyConfig(model=model, precision=PrecisionConfig(dtype="bf16", fp8=fp8),
                                      optim=OptimConfig(lr=1e-6), micro_batch_size=args.micro_batch_size)
                seconds[label].append(world.run(timed_steps, config, args.batch_size, args.seq_length,
                                                 args.steps)[0])
    print(f"{name}: llama2-7b shape, 2 layers, batch {args.batch_size} x {args.seq_length}, "
          f"micro-batch {args.micro_batch_size}")
    print(f"{'precision':10} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}")
    for label, values in seconds.items():
        median = statistics.median(values)
        achieved = flops / median
        mfu = f"{achieved / peak:6.1%}" if peak else "   n/a"
        print(f"{label:10} {median:8.4f} {tokens / median:10.0f} {achieved / 1e12:8.1f} {mfu}")
    print(f"FP8 speed-up over BF16: {statistics.median(seconds['bf16']) / statistics.median(seconds['fp8']):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="BF16 vs FP8 on one GPU instead of the CPU layouts")
    parser.add_argument("--attention", action="store_true",
                        help="the local spec's core attention vs megatron's instead of the CPU layouts")
    parser.add_argument("--logits", action="store_true",
                        help="logits from the first target vs at every position instead of the CPU layouts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (CPU 8, --attention and --logits 4, GPU 8)")
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (CPU 128, --attention and --logits 1024, GPU 2048)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="(CPU 4, GPU 1; --attention, --logits: the whole batch)")
    args = parser.parse_args()
    defaults = (8, 2048, 1) if args.gpu else (4, 1024, 4) if args.attention or args.logits else (8, 128, 4)
    for field, default in zip(("batch_size", "seq_length", "micro_batch_size"), defaults):
        if getattr(args, field) is None:
            setattr(args, field, default)
    if args.gpu:
        gpu_benchmark(args)
    elif args.attention:
        side_by_side("core attention", {"sdpa (this project)": None, "megatron DotProductAttention":
                                        "megatron attention"}, 512, 0.25, args)
    elif args.logits:
        side_by_side("logits", {"from the first target": None, "at every position": "every position"},
                     32000, 0.75, args)
    else:
        cpu_benchmark(args)


if __name__ == "__main__":
    main()
