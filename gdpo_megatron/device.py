"""The one place that decides where this process computes, and what follows from it.

Everything that differs between a CUDA machine and a CPU-only one asks here: the device of a
rank, the parameter dtype an ``"auto"`` setting stands for, the vLLM engine's dtype and memory
mode, the collective backend, the distributed optimizer's default. :data:`CUDA` and
:data:`CPU` describe the two kinds of machine; :func:`this_machine` says which one this is.

The decision is taken once per process, where it is launched: a command asks
:func:`this_machine` (``gdpo-plan`` plans for :data:`CUDA` from anywhere),
``distributed.launch.init_distributed`` turns it into this rank's :class:`Placement`
(:func:`place_rank`), and the builders (policy worker, model, rollout engine, trainer) take
the machine or the placement as an argument instead of asking again.

The few CUDA calls the rest of the package needs (memory figures, the cache, the RNG state,
the GPU's name and compute capability) are the small functions at the end of this module
(:func:`runs_fp8_recipe` says whether an FP8 recipe runs on a capability); no other module calls
``torch.cuda`` (the CPU shim, ``policy.cpu_compat``, replaces some of it). Torch is imported
only by the functions that need it, so a process can ask :func:`nvidia_driver` before torch
is loaded.
"""
from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gdpo_megatron.config.loader import ConfigError
from gdpo_megatron.config.policy import PrecisionConfig

if TYPE_CHECKING:
    import torch

# For each of megatron-core's FP8 recipes, the Transformer Engine function that says whether this
# GPU, CUDA and cuBLAS run the TE recipe megatron-core builds for it: delayed -> DelayedScaling
# and tensorwise -> Float8CurrentScaling (is_fp8_available), blockwise -> Float8BlockScaling,
# mxfp8 -> MXFP8BlockScaling.
FP8_RECIPE_SUPPORT = {
    "delayed": "is_fp8_available",
    "tensorwise": "is_fp8_available",
    "blockwise": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
}

# The compute capability each recipe needs, as Transformer Engine 2.11 checks it
# (transformer_engine/pytorch/quantization.py, ``_compute_*_support``): FP8 GEMMs from Ada
# (sm_89; Hopper is sm_90) on, FP8 block scaling from Hopper on, MXFP8 on Blackwell from sm_100
# up to (not including) sm_120. (lowest, first refused or None)
FP8_RECIPE_CAPABILITY: dict[str, tuple[tuple[int, int], tuple[int, int] | None]] = {
    "delayed": ((8, 9), None),
    "tensorwise": ((8, 9), None),
    "blockwise": ((9, 0), None),
    "mxfp8": ((10, 0), (12, 0)),
}


def fp8_capability_needed(recipe: str) -> str:
    """The compute capabilities that run FP8 ``recipe``, in words ("8.9 or higher")."""
    lowest, refused = FP8_RECIPE_CAPABILITY[recipe]
    return f"{lowest[0]}.{lowest[1]} or higher" + (f", below {refused[0]}.{refused[1]}" if refused else "")


def runs_fp8_recipe(recipe: str, capability: tuple[int, int]) -> bool:
    """Whether a GPU of compute ``capability`` (major, minor) runs FP8 ``recipe``."""
    lowest, refused = FP8_RECIPE_CAPABILITY[recipe]
    return lowest <= tuple(capability) and (refused is None or tuple(capability) < refused)


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

    def transformer_engine(self, setting: bool | None) -> bool:
        """``precision.transformer_engine``: None means TE's layer spec wherever CUDA and TE are present."""
        if setting is not None:
            return setting
        return self.cuda and transformer_engine_available()

    def distributed_optimizer(self, setting: bool | None) -> bool:
        """``optim.use_distributed_optimizer``: None means the sharded optimizer on CUDA only."""
        return self.cuda if setting is None else setting

    @property
    def vllm_dtype(self) -> str:
        """The rollout engine's dtype: the checkpoint's on CUDA, fp32 on the CPU (as the policy)."""
        return "auto" if self.cuda else "float32"

    @property
    def chunked_prefill(self) -> bool:
        """Whether the rollout engine may split a prompt's prefill over steps. Not on the CPU:
        vLLM's CPU sampler cannot rewind a seeded request's generator after a partial prefill
        ("CPU Generator does not use offset"), and every rollout is seeded."""
        return self.cuda

    @property
    def backend(self) -> str:
        """The torch.distributed backend."""
        return "nccl" if self.cuda else "gloo"


CUDA, CPU = Machine("cuda"), Machine("cpu")


def this_machine() -> Machine:
    """:data:`CUDA` when torch sees a CUDA device, else :data:`CPU`. Asked once, by the command
    that launches the process; everything after takes the answer as an argument."""
    import torch

    return CUDA if torch.cuda.is_available() else CPU


@dataclass(frozen=True)
class Placement:
    """Where one rank computes: the kind of machine and the torch device its tensors live on."""

    machine: Machine
    device: "torch.device"


def place_rank(machine: Machine, local_rank: int) -> Placement:
    """The placement of the rank with ``local_rank`` on its node. With CUDA the device is
    :func:`cuda_device_for` the local rank, made torch's current device here; on the CPU it is
    the CPU, whatever the rank."""
    import torch

    if not machine.cuda:
        return Placement(machine, torch.device("cpu"))
    index = cuda_device_for(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return Placement(machine, torch.device("cuda", index))


def cuda_device_for(local_rank: int, device_count: int) -> int:
    """The CUDA device of a local rank.

    All of a node's GPUs visible (``--gpus-per-node``): device ``local_rank``. One GPU bound
    to each task (``--gpus-per-task=1``): device 0.
    """
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this task sees {device_count} CUDA devices; "
            "launch at most one task per GPU on each node (tasks per node = GPUs per node)"
        )
    return local_rank


def transformer_engine_available() -> bool:
    """Whether Transformer Engine is installed (never imported on CPU-only machines)."""
    return importlib.util.find_spec("transformer_engine") is not None


def fp8_recipe_support(recipe: str) -> tuple[bool, str]:
    """Transformer Engine's own answer whether this machine runs ``recipe``: (ok, reason).

    Imports Transformer Engine, so call it only where CUDA and TE are present.
    """
    import transformer_engine.pytorch as te

    return getattr(te, FP8_RECIPE_SUPPORT[recipe])(return_reason=True)


def check_precision(precision: PrecisionConfig, machine: Machine) -> None:
    """Raise ConfigError if ``machine`` (this one) cannot run ``precision`` (resolved): the
    Transformer Engine spec without CUDA or TE, FP8 without a GPU, TE and bf16 that run the recipe."""
    key = "policy.precision"
    cuda = machine.cuda
    if precision.transformer_engine:
        if not cuda:
            raise ConfigError(f"{key}.transformer_engine: the Transformer Engine spec needs CUDA")
        if not transformer_engine_available():
            raise ConfigError(f"{key}.transformer_engine: transformer_engine is not installed")
    if precision.fp8 is None:
        return
    fp8 = f"{key}.fp8={precision.fp8!r}"
    if not cuda:
        raise ConfigError(f"{fp8}: FP8 needs a CUDA GPU; use fp8: null on CPU")
    if not transformer_engine_available():
        raise ConfigError(f"{fp8}: FP8 needs Transformer Engine (pip install transformer-engine[pytorch])")
    if not precision.transformer_engine:
        raise ConfigError(f"{fp8}: FP8 needs transformer_engine: true")
    if precision.dtype != "bf16":
        raise ConfigError(f"{fp8}: FP8 training expects dtype bf16, got {precision.dtype!r}")
    supported, reason = fp8_recipe_support(precision.fp8_recipe)
    if not supported:
        import torch

        major, minor = current_gpu().capability
        raise ConfigError(f"{key}.fp8_recipe={precision.fp8_recipe!r}: Transformer Engine cannot run it on this "
                          f"GPU (compute capability {major}.{minor}, CUDA {torch.version.cuda}): {reason}")


# ---- the CUDA calls the package needs (call them only on a CUDA machine) ------------------


def cuda_device_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count()


@dataclass(frozen=True)
class GPU:
    """What the current CUDA device is: its name, compute capability and memory in bytes."""

    name: str
    capability: tuple[int, int]
    memory: int


def current_gpu() -> GPU:
    """The current CUDA device."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return GPU(props.name, (props.major, props.minor), props.total_memory)


def gpu_memory() -> tuple[int, int]:
    """The current GPU's free and total memory in bytes, as the driver counts them."""
    import torch

    return torch.cuda.mem_get_info()


def release_cached_memory() -> None:
    """Hand the blocks torch's CUDA allocator caches back to the driver (for another library
    in the process, such as a colocated rollout engine, to allocate)."""
    import torch

    torch.cuda.empty_cache()


def nccl_version() -> tuple[int, int, int]:
    """The NCCL torch loaded."""
    import torch

    return tuple(torch.cuda.nccl.version()[:3])


def cuda_rng_state() -> "torch.Tensor":
    """The current CUDA device's RNG state."""
    import torch

    return torch.cuda.get_rng_state()


def set_cuda_rng_state(state: "torch.Tensor") -> None:
    """Restore what :func:`cuda_rng_state` returned."""
    import torch

    torch.cuda.set_rng_state(state)
