"""What a checkpoint root holds, read without megatron-core: its complete ``step_<N>``
directories and each one's ``trainer_state.json``.

:mod:`.manager` writes and loads checkpoints; the checks before a run or a conversion
(:mod:`gdpo_megatron.validation`) read these cheap parts with this module alone.
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


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupted (the message names the file)."""


@dataclass
class TrainingState:
    """What a resumed run needs besides the model and optimizer."""

    step: int
    data_position: Any = None  # JSON value from the data loader (e.g. samples consumed)
    config: dict = field(default_factory=dict)
    world_size: int = 1  # ranks that saved it


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
    """The step, data position, config and world size stored in a checkpoint directory."""
    path = Path(directory) / STATE_FILE
    state = read_json(path)
    fields = ("step", "data_position", "config", "world_size")
    for key in fields:
        if key not in state:
            raise CheckpointError(f"{path}: missing the field {key!r}")
    return TrainingState(**{key: state[key] for key in fields})
