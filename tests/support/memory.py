"""The peak of tensor memory while a function runs, beyond what was allocated before it.

On a CUDA device torch's caching allocator keeps the figure (``max_memory_allocated``). On the
CPU the profiler records every allocation and free of torch's CPU allocator with its size;
their running sum, in time order, is the memory live at each moment. Both count tensor bytes
only (no allocator caching, no Python objects), which is what ``gdpo-plan`` estimates.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(fn: Callable[[], None], device: torch.device | str = "cpu") -> int:
    """The most tensor bytes alive at once on ``device`` while ``fn()`` runs, beyond those alive before."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def logprob_step_bytes_per_logit(positions: int, hidden_size: int, vocab_rows: int, vocab_size: int,
                                 device: torch.device | str = "cpu") -> float:
    """Peak tensor bytes per logit element of one row's log-prob step as the policy's update runs
    it: bf16 logits of ``positions`` x ``vocab_rows`` from an output-layer matmul, the logprobs
    of all but the last position (temperature 0.7, rows from ``vocab_size`` on padding), and
    their backward pass into the layer's input."""
    from gdpo_megatron.policy.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, positions, hidden_size, generator=g).to(device, torch.bfloat16).requires_grad_(True)
    output_layer = (torch.randn(vocab_rows, hidden_size, generator=g) / hidden_size**0.5).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab_size, (1, positions - 1), generator=g).to(device)
    weights = torch.randn(1, positions - 1, generator=g).to(device)

    def update():
        logits = hidden @ output_layer.T
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], targets, vocab_size, temperature=0.7)
        (logprobs * weights).sum().backward()

    peak = peak_tensor_bytes(update, device)
    assert hidden.grad is not None
    return peak / (positions * vocab_rows)
