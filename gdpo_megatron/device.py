"""The one place that decides where this process computes, and what follows from it.

Everything that differs between a CUDA machine and a CPU-only one asks here: the device of a
rank, the parameter dtype an ``"auto"`` setting stands for, the vLLM engine's dtype and memory
mode, the collective backend, the distributed optimizer's default. :data:`CUDA` and
:data:`CPU` describe the two kinds of machine; :func:`this_machine` says which one this is
(``gdpo-plan`` plans for :data:`CUDA` from anywhere). Torch is imported only by the functions
that need it, so a process can ask :func:`nvidia_driver` before torch is loaded.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal


def nvidia_driver() -> ctypes.CDLL | None:
    """The NVIDIA driver library (``libcuda.so.1``), or None on a machine without one."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@dataclass(frozen=True)
class Machine:
    """A kind of machine: ``"cuda"`` (NVIDIA GPUs) or ``"cpu"``."""

    kind: Literal["cuda", "cpu"]

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    def param_dtype(self, setting: str) -> str:
        """``precision.dtype``: ``"auto"`` is bf16 on CUDA and fp32 on the CPU."""
        if setting != "auto":
            return setting
        return "bf16" if self.cuda else "fp32"

    def distributed_optimizer(self, setting: bool | None) -> bool:
        """``optim.use_distributed_optimizer``: None means the sharded optimizer on CUDA only."""
        return self.cuda if setting is None else setting

    @property
    def vllm_dtype(self) -> str:
        """The rollout engine's dtype: the checkpoint's on CUDA, fp32 on the CPU (as the policy)."""
        return "auto" if self.cuda else "float32"

    @property
    def backend(self) -> str:
        """The torch.distributed backend."""
        return "nccl" if self.cuda else "gloo"


CUDA, CPU = Machine("cuda"), Machine("cpu")


def this_machine() -> Machine:
    """:data:`CUDA` when torch sees a CUDA device, else :data:`CPU`."""
    import torch

    return CUDA if torch.cuda.is_available() else CPU
