"""Run megatron-core on a machine without CUDA (fp32, gloo). Nothing changes on a CUDA machine.

megatron-core assumes a GPU in a handful of places; this module is the only one that knows
about them. :func:`install` is called once per process, explicitly, by whatever launches it
(``gdpo-train`` and ``gdpo-convert`` right after ``init_distributed``; a test's process after
its process group), with the machine that launch decided on; nothing installs it implicitly.
On a CPU machine it patches, for the whole process, the functions that a CPU-only torch build
cannot answer:

* ``torch.cuda.current_device()`` -> the CPU device (``device=torch.cuda.current_device()``
  appears at ~100 sites, e.g. the global memory buffer);
* ``torch.cuda.synchronize()`` -> no-op (p2p communication, checkpoint writers);
* ``torch.cuda.current_stream()`` -> an inert stream (DDP buffers in megatron-core 0.19);
* megatron's CUDA RNG tracker -> :class:`CpuRNGStatesTracker`, forking the CPU generator.

Everything that megatron-core creates with a literal ``"cuda"`` device (pipeline schedules,
gradient clipping, optimizer scalars, ``.cuda()`` copies) or checks with
``tensor.type() == "torch.cuda.FloatTensor"`` is handled by :func:`device_scope`, a torch
function mode to enter around model building, forward-backward and optimizer steps. It is
scoped rather than global because it adds Python work to every torch call; it needs
:func:`install` first, and is a no-op on a CUDA machine.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core.tensor_parallel import random as mpu_random
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from torch.overrides import TorchFunctionMode

from gdpo_megatron.device import Machine

_installed_for: Machine | None = None  # the machine install() was called with


class CpuRNGStatesTracker(CudaRNGStatesTracker):
    """Megatron's RNG-states tracker, keeping CPU generator states instead of CUDA ones."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _InertStream:
    """Stands in for a CUDA stream: every method is a no-op."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class _CudaOnCpuMode(TorchFunctionMode):
    """Maps ``device="cuda"`` to the CPU, makes ``.cuda()`` a no-op, and reports
    ``tensor.type()`` with CUDA type names (what megatron's optimizer checks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def install(machine: Machine) -> None:
    """Make megatron-core runnable in this process on ``machine``: on the CPU, patch
    ``torch.cuda`` and megatron's RNG tracker (see the module docstring); with CUDA, nothing.
    Called once per process, at launch; calling it again with the same machine does nothing."""
    global _installed_for
    if _installed_for is not None:
        if _installed_for != machine:
            raise RuntimeError(f"cpu_compat.install({machine.kind!r}): already installed for {_installed_for.kind!r}")
        return
    if not machine.cuda:
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_stream = lambda *args, **kwargs: _InertStream()
        mpu_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _installed_for = machine


@contextlib.contextmanager
def device_scope() -> Iterator[None]:
    """Context for megatron-core calls: on the CPU, maps CUDA device literals to the CPU and
    runs megatron's ``torch.compile``d fusions eagerly (inductor would build C++ kernels for
    seconds at each first call, more than they save at CPU sizes). A no-op with CUDA."""
    if _installed_for is None:
        raise RuntimeError("cpu_compat.install(machine) has not been called in this process (the launch calls "
                           "it once, after init_distributed)")
    if _installed_for.cuda:
        yield
        return
    with _CudaOnCpuMode(), torch.compiler.set_stance("force_eager"):
        yield
