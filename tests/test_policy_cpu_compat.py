"""The CPU compatibility module: installed explicitly, megatron's RNG tracker on the CPU
generator, device mapping."""
import subprocess
import sys

import pytest
import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from gdpo_megatron.device import CPU
from gdpo_megatron.policy import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is off with CUDA")


def test_nothing_is_patched_until_the_launch_installs_the_shim():
    """A fresh process: importing the module changes nothing, megatron calls outside an
    installed shim are refused, and one process is never installed for two machines."""
    script = """
import torch
from gdpo_megatron.device import CPU, CUDA
from gdpo_megatron.policy import cpu_compat
try:
    torch.cuda.current_device()
except (AssertionError, RuntimeError):
    print("cuda untouched")
try:
    with cpu_compat.device_scope():
        pass
except RuntimeError as e:
    print(e)
cpu_compat.install(CPU)
print(torch.cuda.current_device())
try:
    cpu_compat.install(CUDA)
except RuntimeError as e:
    print(e)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "cuda untouched",
        "cpu_compat.install(machine) has not been called in this process (the launch calls it once, "
        "after init_distributed)",
        "cpu",
        "cpu_compat.install('cuda'): already installed for 'cpu'",
    ]


def test_rng_tracker_forks_its_own_stream_and_restores_the_outer_one():
    cpu_compat.install(CPU)
    cpu_compat.install(CPU)  # idempotent
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRNGStatesTracker)
    tracker.reset()
    tracker.add("stream", 7)

    torch.manual_seed(0)
    with tracker.fork("stream"):
        first = torch.rand(3)
    outer = torch.rand(3)
    with tracker.fork("stream"):
        second = torch.rand(3)

    torch.manual_seed(7)
    torch.testing.assert_close(torch.cat([first, second]), torch.rand(6))  # one continued stream
    torch.manual_seed(0)
    torch.testing.assert_close(outer, torch.rand(3))  # the outer generator never moved
    with pytest.raises(ValueError, match="seed 7"):
        tracker.add("other", 7)
    with pytest.raises(KeyError, match="missing"):
        with tracker.fork("missing"):
            pass


def test_device_scope_maps_cuda_requests_to_the_cpu():
    cpu_compat.install(CPU)
    with cpu_compat.device_scope():
        made = torch.zeros(2, device="cuda")
        moved = made.cuda()
        kind = made.type()
    assert made.device.type == "cpu" and moved is made
    assert kind == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"  # outside the scope nothing changes
    assert torch.cuda.current_device() == torch.device("cpu")


def test_megatrons_fused_swiglu_runs_eagerly_and_matches_autograd():
    """The policy uses megatron's SwiGLU autograd function (it saves only its input); in the
    scope its torch.compile'd helpers run eagerly, with autograd's gradients."""
    import torch._dynamo
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    torch.manual_seed(0)
    y = torch.randn(6, 5, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(6, 5, 8, dtype=torch.float64)
    cpu_compat.install(CPU)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with cpu_compat.device_scope():
        fused = bias_swiglu_impl(y, None)
        (fused_grad,) = torch.autograd.grad(fused, y, grad)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled  # nothing was compiled
    gate, linear = y.chunk(2, dim=-1)
    reference = F.silu(gate) * linear
    (reference_grad,) = torch.autograd.grad(reference, y, grad)
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused_grad, reference_grad, rtol=1e-12, atol=1e-12)
