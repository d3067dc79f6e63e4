"""How a checkpoint was trained, kept next to its Hugging Face export: ``gdpo_training.json``.

A model scores what its training reported only when it is prompted and sampled the same way:
the same instructions in the system message, the same fields of the data rows, the same
completion length, temperature and stop strings. gdpo-train's export (and gdpo-convert's of a
training checkpoint) writes those settings of the run's config, and the ``environment`` a
multi-turn family's trajectories stepped through, as sections named like the config's::

    {"data": {"family": "tool", "system_prompt": "", "prompt_key": null, "system_key": null,
              "ground_truth_key": null},
     "rollout": {"max_new_tokens": 80, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": []},
     "environment": {"name": null, "file": null, "step_timeout_s": 10.0, "max_steps_per_turn": 8}}

and gdpo-eval reads it for every setting its command line leaves out (a record without
``environment``, written before it was kept, holds the section's defaults). A directory without
the file (any other Hugging Face model) has no record: :func:`read_trained_with` returns None.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.loader import from_dict, require
from gdpo_megatron.config.rollout import TEMPERATURE_RANGE
from gdpo_megatron.errors import InputError

TRAINING_FILE = "gdpo_training.json"


@dataclass
class TrainedPrompts:
    """The keys of the run's ``data`` section that make its prompts (see ``DataConfig``)."""

    family: str
    system_prompt: Optional[str] = None
    prompt_key: Optional[str] = None
    system_key: Optional[str] = None
    ground_truth_key: Optional[str] = None


@dataclass
class TrainedSampling:
    """The keys of the run's ``rollout`` section that make its completions (see ``RolloutConfig``)."""

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)

    def __post_init__(self):
        low, high = TEMPERATURE_RANGE
        require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        require(low <= self.temperature <= high, "temperature", f"in [{low}, {high:g}]", self.temperature)


@dataclass
class TrainedEnvironment:
    """The keys of the run's ``environment`` section (see ``EnvironmentConfig``; ``file`` as the
    config gave it, not checked here: a single-turn evaluation never reads it)."""

    name: Optional[str] = None
    file: Optional[str] = None
    step_timeout_s: float = EnvironmentConfig.step_timeout_s
    max_steps_per_turn: int = EnvironmentConfig.max_steps_per_turn


@dataclass
class TrainedWith:
    """What :data:`TRAINING_FILE` holds."""

    data: TrainedPrompts
    rollout: TrainedSampling
    environment: TrainedEnvironment = field(default_factory=TrainedEnvironment)


def trained_with(config: dict) -> TrainedWith:
    """The record of a run's config, as plain data (``to_dict`` of a TrainConfig, or the config a
    training checkpoint saved; one saved before the ``environment`` section existed has none)."""
    def section(cls, name: str):
        return cls(**{f.name: config[name][f.name] for f in fields(cls)})

    environment = section(TrainedEnvironment, "environment") if "environment" in config else TrainedEnvironment()
    return TrainedWith(section(TrainedPrompts, "data"), section(TrainedSampling, "rollout"), environment)


def write_trained_with(hf_dir: str | Path, record: TrainedWith) -> Path:
    """Write ``record`` into the Hugging Face directory ``hf_dir``."""
    path = Path(hf_dir) / TRAINING_FILE
    path.write_text(json.dumps(asdict(record), indent=2) + "\n")
    return path


def read_trained_with(hf_dir: str | Path) -> TrainedWith | None:
    """The record in ``hf_dir``, None where there is none; an InputError names a malformed one."""
    path = Path(hf_dir) / TRAINING_FILE
    if not path.is_file():
        return None
    hint = "fix or delete it (without it gdpo-eval uses its own defaults)"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: unreadable ({e}); {hint}") from None
    try:
        return from_dict(TrainedWith, data)
    except ValueError as e:  # a ConfigError naming the key
        raise InputError(f"{path}: {e}; {hint}") from None
