"""Reward functions by name, and the per-reward settings a config refers to them with.

A reward function has the signature ``fn(completion, num_tokens, ground_truth, **kwargs) ->
float``: the completion text, its token count, the sample's ground truth/metadata dict, and
the keyword arguments of its :class:`RewardSpec`. Built-in rewards register on import of
``gdpo_megatron.rewards``; users add their own in a Python file (``load_reward_file``) whose
``@register_reward("name")`` decorators run when it is imported. A reward whose kwargs need
more than the signature says registers a ``check`` that raises ValueError for kwargs it would
refuse, so that a config is refused before training instead of scoring every rollout as a failure.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

RewardFn = Callable[..., float]

_REWARDS: dict[str, RewardFn] = {}
_CHECKS: dict[str, Callable[..., None]] = {}


def register_reward(name: str, check: Callable[..., None] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as reward ``name``; ``check(**kwargs)`` (optional) raises
    ValueError for kwargs ``fn`` would refuse."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name: expected a non-empty string, got {name!r}")

    def add(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise ValueError(f"reward {name!r}: expected a function, got {fn!r}")
        known = _REWARDS.get(name)
        if known is not None and _qualname(known) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered by {_qualname(known)}")
        _REWARDS[name] = fn
        if check is not None:
            _CHECKS[name] = check
        return fn

    return add


def get_reward(name: str) -> RewardFn:
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"reward {name!r} is not registered; known rewards: {sorted(_REWARDS)}") from None


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def load_reward_file(path: str | Path) -> None:
    """Import a Python file so that its ``@register_reward`` decorators run (idempotent)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"reward file {path} does not exist")
    module_name = f"gdpo_megatron_user_rewards.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward file {path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise


@dataclass(frozen=True)
class RewardSpec:
    """One configured reward: which function, its weight, and how a failure scores.

    ``failure_value`` is what the reward is when its function raises, returns a non-finite
    or non-numeric value, or runs past ``timeout_s`` (``None``: the stage's default).
    ``kwargs`` go to the function, e.g. ``{"max_tokens": 512}`` for ``length``.
    """

    name: str
    weight: float = 1.0
    failure_value: float = 0.0
    timeout_s: float | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"reward name: expected a non-empty string, got {self.name!r}")
        for attr in ("weight", "failure_value"):
            value = getattr(self, attr)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"reward {self.name!r}: {attr} must be a finite number, got {value!r}")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"reward {self.name!r}: timeout_s must be > 0 or None, got {self.timeout_s!r}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"reward {self.name!r}: kwargs must be a dict, got {type(self.kwargs).__name__}")


def validate_specs(specs: Sequence[RewardSpec]) -> None:
    """Names unique and registered; each spec's kwargs accepted by its function (and its check)."""
    if not specs:
        raise ValueError("rewards: expected at least one reward")
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"rewards: {spec.name!r} is listed twice")
        seen.add(spec.name)
        fn = get_reward(spec.name)
        try:
            inspect.signature(fn).bind("", 0, {}, **spec.kwargs)
        except TypeError as e:
            raise ValueError(f"reward {spec.name!r}: kwargs {spec.kwargs} do not fit {_qualname(fn)}: {e}") from None
        if spec.name in _CHECKS:
            try:
                _CHECKS[spec.name](**spec.kwargs)
            except ValueError as e:
                raise ValueError(f"{spec.name}: {e}") from None


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
