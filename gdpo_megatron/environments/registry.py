"""Environments by reference: a built-in name, or a user's class in a Python file.

A reference is ``"bfcl"`` (the built-in :class:`~gdpo_megatron.environments.bfcl.BFCLEnvironment`)
or ``"path/to/file.py:ClassName"``: the file is imported once per process (as reward files
are, under a module name made from its path) and ``ClassName`` must be an
:class:`~gdpo_megatron.environments.environment.Environment` subclass defined in it. The config
names a user's environment with ``environment.file`` and ``environment.name``
(:mod:`gdpo_megatron.config.environment`), else the data family's ``Task.environment`` is the
run's (:func:`configured_reference`); the reference travels with each trajectory, so a reward
worker resolves the same class.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.loader import ConfigError
from gdpo_megatron.environments.environment import Environment
from gdpo_megatron.user_files import import_user_file

BUILTIN: dict[str, str] = {"bfcl": "gdpo_megatron.environments.bfcl:BFCLEnvironment"}


def environment_reference(name: str, file: str | None = None) -> str:
    """The reference of environment ``name`` (built-in), or of class ``name`` in ``file``."""
    return f"{Path(file).resolve()}:{name}" if file is not None else name


def configured_reference(environment: EnvironmentConfig, family_environment: str | None) -> str | None:
    """The reference of a run's environment: the config's ``environment`` section where it names
    one, else the data family's (``Task.environment``; None for a single-turn family)."""
    if environment.name is None:
        return family_environment
    return environment_reference(environment.name, environment.file)


def check_family_environment(environment: EnvironmentConfig, family: str, multi_turn: bool,
                             family_environment: str | None) -> None:
    """ConfigError when the config's ``environment`` does not fit ``data.family``: a multi-turn
    family's rollouts need an environment, a single-turn family's take none."""
    if multi_turn and configured_reference(environment, family_environment) is None:
        raise ConfigError(f"environment.name: data.family={family} rolls out trajectories through an environment; "
                          "name one (environment.file and environment.name for your own)")
    if not multi_turn and environment.name is not None:
        raise ConfigError(f"environment.name: data.family={family} is single-turn (one completion per rollout); "
                          f"use a multi-turn family (multi_turn, bfcl_multi_turn) or leave environment.name null")


def environment_class(ref: str) -> type[Environment]:
    """The environment class ``ref`` names; ValueError / FileNotFoundError saying what is missing."""
    if ref in BUILTIN:
        module_name, class_name = BUILTIN[ref].split(":")
        return getattr(importlib.import_module(module_name), class_name)
    path, sep, class_name = ref.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ValueError(f"environment {ref!r}: expected a built-in environment ({', '.join(BUILTIN)}) or "
                         "'path/to/file.py:ClassName'")
    module = import_user_file(path, "gdpo_megatron_user_environments", "environment file")
    cls = getattr(module, class_name, None)
    if cls is None:
        found = sorted(n for n, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Environment) and v is not Environment)
        raise ValueError(f"environment file {path} defines no class {class_name!r} "
                         f"(environment classes there: {', '.join(found) or 'none'})")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {class_name!r} in {path} is not a subclass of "
                         "gdpo_megatron.environments.Environment")
    return cls


def make_environment(ref: str) -> Environment:
    return environment_class(ref)()
