"""The CPU compatibility module: megatron's RNG tracker on the CPU generator, device mapping."""
import pytest
import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from gdpo_megatron.policy import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is off with CUDA")


def test_rng_tracker_forks_its_own_stream_and_restores_the_outer_one():
    cpu_compat.install()
    cpu_compat.install()  # idempotent
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
    with cpu_compat.device_scope():
        made = torch.zeros(2, device="cuda")
        moved = made.cuda()
        kind = made.type()
    assert made.device.type == "cpu" and moved is made
    assert kind == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"  # outside the scope nothing changes
    assert torch.cuda.current_device() == torch.device("cpu")
