"""What a checkpoint root holds, read without megatron-core: its complete ``step_<N>``
directories and each one's ``trainer_state.json``.

:mod:`.manager` writes and loads checkpoints; the checks before a run or a conversion
(:mod:`gdpo_megatron.preflight.validation`) read these cheap parts with this module alone.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gdpo_megatron.errors import UserError

STEP_DIR = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp-"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"  # file name -> size and CRC32 of every other file of the checkpoint
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


def step_dir(root: Path, step: int) -> Path:
    """Where step ``step``'s checkpoint lives under ``root`` (a name :data:`STEP_DIR` matches)."""
    return Path(root) / f"step_{step}"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupted (the message names the file)."""


@dataclass
class TrainingState:
    """What a resumed run needs besides the model and optimizer."""

    step: int
    data_position: Any = None  # JSON value from the data loader (e.g. samples consumed)
    config: dict = field(default_factory=dict)
    world_size: int = 1  # ranks that saved it
    layout: dict | None = None  # the TP and PP sizes it was saved under
    # The distributed optimizer's format; None for a plain optimizer or none saved.
    optimizer_sharding: str | None = None


def read_json(path: Path, missing: str = "missing") -> Any:
    """A JSON file of a checkpoint; CheckpointError naming it when it is missing or corrupted."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {missing}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupted ({e})") from None


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint under ``root``, oldest first; warns about half-written ones."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            warnings.warn(f"ignoring incomplete checkpoint {entry} (interrupted while being written)")
        elif entry.is_dir() and (match := STEP_DIR.fullmatch(entry.name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def read_training_state(directory: str | os.PathLike) -> TrainingState:
    """The step, data position, config, world size, layout and optimizer format of a checkpoint."""
    path = Path(directory) / STATE_FILE
    state = read_json(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(state).__name__}")
    fields = ("step", "data_position", "config", "world_size")
    for key in fields:
        if key not in state:
            raise CheckpointError(f"{path}: missing the field {key!r}")
    return TrainingState(**{key: state[key] for key in fields}, layout=state.get("layout"),
                         optimizer_sharding=state.get("optimizer_sharding"))


def check_reshardable(directory: str | os.PathLike, state: TrainingState, layout: dict | None) -> None:
    """Raise unless the distributed optimizer's state saved in ``directory`` loads under ``layout``
    (TP and PP sizes): megatron-core's ``dp_reshardable`` format reloads under another DP size only."""
    if state.optimizer_sharding != "dp_reshardable" or state.layout is None or layout is None:
        return
    changed = [f"{k}={state.layout[k]} -> {layout[k]}" for k in LAYOUT_KEYS if state.layout.get(k) != layout[k]]
    if changed:
        raise CheckpointError(
            f"{directory}: the distributed optimizer's state was saved in megatron-core's dp_reshardable format, "
            f"which reloads under another data-parallel size only, and this run changes {', '.join(changed)}; "
            "resume under the saved layout (then save with checkpoint.optimizer_sharding=fully_reshardable to "
            "change it), or load the weights without the optimizer state")


def model_section(config: dict) -> dict | None:
    """The model shape a checkpoint's config holds: ``model`` (gdpo-convert) or ``policy.model`` (training)."""
    section = config.get("model") or (config.get("policy") or {}).get("model")
    return section if isinstance(section, dict) else None


def check_files(directory: Path) -> dict:
    """The checkpoint's manifest, every file it lists present at its size (no checksums: cheap to run first)."""
    manifest = read_json(directory / MANIFEST, missing="missing (the checkpoint is incomplete)")
    if not (isinstance(manifest, dict)
            and all(isinstance(entry, dict) and isinstance(entry.get("size"), int) for entry in manifest.values())):
        raise CheckpointError(f"{directory / MANIFEST}: corrupted (expected file name -> size and crc32)")
    for name in sorted(manifest):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        size, expected = path.stat().st_size, manifest[name]["size"]
        if size != expected:
            raise CheckpointError(f"{path}: corrupted (size {size}, expected size {expected})")
    return manifest
