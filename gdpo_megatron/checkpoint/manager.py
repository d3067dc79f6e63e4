"""Training checkpoints: save, find and resume, safe against crashes and topology changes.

Layout under the checkpoint root::

    step_<N>/
        dist/                megatron-core dist_checkpointing: model, optimizer, scheduler
        rng/rank_<r>.pt      python / numpy / torch (and megatron tracker) RNG states per rank
        trainer_state.json   step, data-loader position, config, world layout
        manifest.json        size and CRC32 of every file above (written last)
    latest                   name of the newest complete step directory
    .tmp-step_<N>/           a checkpoint being written (or left by a crash): ignored

Every rank calls :meth:`CheckpointManager.save` / :meth:`CheckpointManager.load` (collective).
A checkpoint is written under a temporary name and renamed to ``step_<N>`` when every rank has
finished, so a ``step_<N>`` directory is always complete; resume takes the newest one.

Layouts. The model and optimizer are stored by megatron-core's ``dist_checkpointing``. The
model's weights, and the plain optimizer's state (kept per model parameter), load under any
tensor/pipeline/data-parallel layout. The distributed optimizer's state is stored in one of
megatron-core's formats (``optimizer_sharding``): ``dp_reshardable`` (its own bucket layout,
written by every rank without communication) reloads under another data-parallel size only;
``fully_reshardable`` (per-parameter tensors) reloads under any layout. It is saved through
megatron-core's memory-efficient variant: the state is gathered over gloo to data-parallel
rank 0, which writes it (12 bytes per parameter of a TP x PP shard in its host memory); the
default variant would all-gather it with NCCL through GPU buffers into every rank's host
memory, next to a colocated vLLM. Loading it reads the whole shard's state on every rank (12
bytes per parameter of host memory each). A checkpoint records its format and TP/PP sizes,
and loading the distributed optimizer under another TP/PP from ``dp_reshardable`` is a clear
error before anything is read.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from gdpo_megatron.checkpoint.state import (
    MANIFEST, STATE_FILE, TMP_PREFIX, CheckpointError, TrainingState, check_files, check_reshardable,
    complete_steps, read_training_state, step_dir,
)
from gdpo_megatron.checkpoint.weight_stream import unwrap
from gdpo_megatron.device import cuda_rng_state, set_cuda_rng_state
from gdpo_megatron.policy import cpu_compat

LATEST = "latest"
DIST_DIR = "dist"
RNG_DIR = "rng"
FORMAT_VERSION = 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files_of(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def _checksums(directory: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Size and CRC32 of ``names``, each rank reading its share; the union on every rank."""
    mine = {n: {"size": (directory / n).stat().st_size, "crc32": _crc32(directory / n)}
            for i, n in enumerate(names) if i % _world_size() == _rank()}
    if not dist.is_initialized():
        return mine
    parts: list[dict] = [None] * _world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def on_cuda(model) -> bool:
    """Whether ``model`` (this rank's stage, wrapped or not) lives on a CUDA device."""
    return next(unwrap(model).parameters()).is_cuda


def rng_state(cuda: bool) -> dict:
    """The RNG states of this process: python, numpy, torch, megatron's tracker and, with
    ``cuda``, the current CUDA device's."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if cuda:
        state["cuda"] = cuda_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if tracker.is_initialized():
        state["tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict, cuda: bool) -> None:
    """Restore what :func:`rng_state` returned (the CUDA device's state with ``cuda``)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda:
        set_cuda_rng_state(state["cuda"])
    if "tracker" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` format, written synchronously by the calling process.

    megatron-core's own writer starts a multiprocessing manager and forks a writer per save;
    those cannot start in daemonic processes and outlive a SIGKILLed trainer. The files are
    the same PyTorch distributed-checkpoint format, read back by megatron-core's loader.
    """

    def __init__(self):
        super().__init__("torch_dist", 1)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica)
        dcp.save(
            mcore_to_pyt_state_dict(sharded_state_dict, False),
            storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
            planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False),
        )


def _is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` (possibly megatron's chain of optimizers) shards its state over DP."""
    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _layout() -> dict | None:
    if not parallel_state.model_parallel_is_initialized():
        return None
    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size()}


def optimizer_metadata(optimizer_sharding: str) -> dict:
    """megatron-core's metadata for the distributed optimizer's format (``fully_reshardable``:
    its memory-efficient variant, see the module docstring)."""
    return {"distrib_optim_sharding_type": optimizer_sharding,
            "distrib_optim_fully_reshardable_mem_efficient": optimizer_sharding == "fully_reshardable"}


def _sharded_state_dict(model, optimizer, optimizer_sharding: str, is_loading: bool) -> dict:
    model_sd = unwrap(model).sharded_state_dict()
    state = {"model": model_sd}
    if optimizer is not None:
        try:
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=optimizer_metadata(optimizer_sharding)
            )
        except AssertionError as e:  # megatron-core's torch-Adam path of the distributed optimizer
            raise CheckpointError(
                "without Transformer Engine or Apex, megatron-core's distributed optimizer cannot load "
                "a checkpoint before its first step (it reads the Adam step from its own state); "
                "use optim.use_distributed_optimizer=false on such machines"
            ) from e
    return state


class CheckpointManager:
    """Saves ``step_<N>`` checkpoints under ``root``, keeps the last ``keep_last``, resumes."""

    def __init__(self, root: str | os.PathLike, keep_last: int | None = 3,
                 optimizer_sharding: str = "dp_reshardable"):
        """``optimizer_sharding``: the distributed optimizer's format for saving (loading reads
        the format a checkpoint was saved in)."""
        self.root = Path(root)
        self.keep_last = keep_last
        self.optimizer_sharding = optimizer_sharding

    def step_dir(self, step: int) -> Path:
        return step_dir(self.root, step)

    # --- finding checkpoints ---------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first; warns about half-written ones."""
        return complete_steps(self.root)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    # --- saving ----------------------------------------------------------------------------

    def save(self, step: int, model, optimizer=None, scheduler=None, *, data_position: Any = None,
             config: dict | None = None) -> Path:
        """Write ``step_<step>`` (collective); return its path once it is complete."""
        final = self.step_dir(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        state = {"format_version": FORMAT_VERSION, "step": step, "data_position": data_position,
                 "config": config or {}, "world_size": _world_size(), "layout": _layout(),
                 "optimizer_sharding": self.optimizer_sharding if _is_distributed(optimizer) else None}
        try:
            state_text = json.dumps(state, indent=2, sort_keys=True)
        except TypeError as e:
            raise TypeError(f"checkpoint data_position / config must be JSON values: {e}") from None
        if final.exists():
            raise FileExistsError(f"{final}: a checkpoint of step {step} exists already")
        if _rank() == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a crash
            (tmp / DIST_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()
        _barrier()

        with cpu_compat.device_scope():
            sharded = _sharded_state_dict(model, optimizer, self.optimizer_sharding, is_loading=False)
            if scheduler is not None:
                sharded["scheduler"] = scheduler.state_dict()
            dist_checkpointing.save(sharded, str(tmp / DIST_DIR), sharded_strategy=InProcessTorchDistSave())
        torch.save(rng_state(on_cuda(model)), tmp / RNG_DIR / f"rank_{_rank()}.pt")
        if _rank() == 0:
            (tmp / STATE_FILE).write_text(state_text + "\n")
        _barrier()

        manifest = _checksums(tmp, _files_of(tmp))
        if _rank() == 0:
            _write_json_atomic(tmp / MANIFEST, manifest)
            os.rename(tmp, final)
            (self.root / f"{LATEST}.tmp").write_text(final.name + "\n")
            os.replace(self.root / f"{LATEST}.tmp", self.root / LATEST)
            self._prune(keep=step)
        _barrier()
        return final

    def _prune(self, keep: int) -> None:
        if self.keep_last is None:
            return
        steps = [s for s in self.complete_steps() if s != keep]
        for old in steps[: max(len(steps) - (self.keep_last - 1), 0)]:
            shutil.rmtree(self.step_dir(old))

    # --- loading ---------------------------------------------------------------------------

    def load(self, model, optimizer=None, scheduler=None, *, step: int | None = None,
             restore_rng: bool = True, verify: bool = True) -> TrainingState:
        """Load ``step`` (default: the newest complete) into the given objects (collective).

        ``model`` may be built under another TP/PP layout than the one saved, and so may a
        plain optimizer or a distributed one saved ``fully_reshardable``. RNG states are
        restored when the world size matches the saved one (else a warning).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"{self.root}: no complete checkpoint (expected step_<N> directories)")
        directory = self.step_dir(step)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such checkpoint")
        if verify:
            self.verify(directory)
        state = read_training_state(directory)
        sharding = state.optimizer_sharding or self.optimizer_sharding
        if optimizer is not None and _is_distributed(optimizer):
            check_reshardable(directory, state, _layout())

        with cpu_compat.device_scope():
            sharded = _sharded_state_dict(model, optimizer, sharding, is_loading=True)
            try:
                loaded = dist_checkpointing.load(sharded, str(directory / DIST_DIR))
            except (Exception, dcp.api.CheckpointException) as e:  # the latter is a BaseException
                raise CheckpointError(f"{directory / DIST_DIR}: cannot load the distributed checkpoint: {e}") from e
            unwrap(model).load_state_dict(loaded["model"])
            if optimizer is not None:
                with torch.no_grad():  # fp32 optimizers copy into leaf parameters
                    optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None:  # saved in the common (replicated) state, returned with it
            if "scheduler" not in loaded:
                raise CheckpointError(f"{directory / DIST_DIR}: saved without a scheduler state")
            scheduler.load_state_dict(loaded["scheduler"])
        if restore_rng:
            self._restore_rng(directory, state.world_size, on_cuda(model))
        return state

    def _restore_rng(self, directory: Path, saved_world_size: int, cuda: bool) -> None:
        if saved_world_size != _world_size():
            warnings.warn(f"{directory}: RNG states not restored (saved by {saved_world_size} ranks, "
                          f"loading on {_world_size()})")
            return
        path = directory / RNG_DIR / f"rank_{_rank()}.pt"
        try:
            set_rng_state(torch.load(path, weights_only=False), cuda)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read the RNG states: {e}") from e

    def verify(self, directory: Path) -> None:
        """Raise :class:`CheckpointError` naming the first missing, extra-short or corrupted file."""
        manifest = check_files(directory)
        actual = _checksums(directory, sorted(manifest))
        for name in sorted(manifest):
            if actual[name] != manifest[name]:
                raise CheckpointError(
                    f"{directory / name}: corrupted (size {actual[name]['size']}, crc32 {actual[name]['crc32']}; "
                    f"expected size {manifest[name]['size']}, crc32 {manifest[name]['crc32']})"
                )
