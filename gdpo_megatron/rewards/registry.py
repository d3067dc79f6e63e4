"""Reward functions by name, and the per-reward settings a config refers to them with.

A reward function has the signature ``fn(completion, num_tokens, ground_truth, **kwargs) ->
float``: the completion text, its token count, the sample's ground truth/metadata dict, and
the keyword arguments of its :class:`RewardSpec`. Built-in rewards register on import of
``gdpo_megatron.rewards``; users add their own in a Python file (``load_reward_file``) whose
``@register_reward("name", bounds=(low, high))`` decorators run when it is imported.

``bounds`` declares the values the function returns. A call that fails (raises, times out,
returns a non-number or a value outside the bounds) scores ``low`` unless its spec sets
``failure_value``: a completion that makes its reward fail is never paid more than the worst
honest answer. A reward declared without bounds fails to 0.

A reward whose kwargs need more than its signature says registers a ``check(**kwargs)`` that
raises ValueError for kwargs it would refuse, so that a config is refused before training
instead of scoring every rollout as a failure.
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


@dataclass(frozen=True)
class _Registered:
    """What ``register_reward`` recorded for one name."""

    fn: RewardFn
    bounds: tuple[float, float] | None  # the (low, high) its values lie in, when declared
    check: Callable[..., None] | None  # raises ValueError for kwargs ``fn`` would refuse


_REGISTRY: dict[str, _Registered] = {}


def register_reward(name: str, bounds: tuple[float, float] | None = None,
                    check: Callable[..., None] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as reward ``name``, returning values in ``bounds`` (low, high);
    ``check(**kwargs)`` (optional) raises ValueError for kwargs ``fn`` would refuse."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name: expected a non-empty string, got {name!r}")
    if bounds is not None and not (
        isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(_is_finite_number(b) for b in bounds)
        and bounds[0] < bounds[1]
    ):
        raise ValueError(f"reward {name!r}: bounds must be two finite numbers (low, high) with low < high, "
                         f"got {bounds!r}")

    def add(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise ValueError(f"reward {name!r}: expected a function, got {fn!r}")
        known = _REGISTRY.get(name)
        if known is not None and _qualname(known.fn) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered by {_qualname(known.fn)}")
        _REGISTRY[name] = _Registered(fn, None if bounds is None else (float(bounds[0]), float(bounds[1])), check)
        return fn

    return add


def _registered(name: str) -> _Registered:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"reward {name!r} is not registered; known rewards: {sorted(_REGISTRY)}") from None


def get_reward(name: str) -> RewardFn:
    return _registered(name).fn


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def reward_bounds(name: str) -> tuple[float, float] | None:
    """The (low, high) values reward ``name`` declared at registration, or ``None``."""
    return _registered(name).bounds


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
    or non-numeric value or one outside its declared bounds, or runs past ``timeout_s``
    (``None``: the stage's default); ``None`` means the lowest value the reward declares (0
    for a reward that declares no bounds), see :meth:`failure_score`.
    ``kwargs`` go to the function, e.g. ``{"max_tokens": 512}`` for ``length``.
    """

    name: str
    weight: float = 1.0
    failure_value: float | None = None
    timeout_s: float | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"reward name: expected a non-empty string, got {self.name!r}")
        if not _is_finite_number(self.weight):
            raise ValueError(f"reward {self.name!r}: weight must be a finite number, got {self.weight!r}")
        if self.failure_value is not None and not _is_finite_number(self.failure_value):
            raise ValueError(f"reward {self.name!r}: failure_value must be a finite number or None, "
                             f"got {self.failure_value!r}")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"reward {self.name!r}: timeout_s must be > 0 or None, got {self.timeout_s!r}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"reward {self.name!r}: kwargs must be a dict, got {type(self.kwargs).__name__}")

    def failure_score(self) -> float:
        """What a failed call scores: ``failure_value``, else the reward's declared low bound, else 0."""
        if self.failure_value is not None:
            return float(self.failure_value)
        bounds = reward_bounds(self.name)
        return bounds[0] if bounds is not None else 0.0


def validate_specs(specs: Sequence[RewardSpec]) -> None:
    """Names unique and registered; each spec's kwargs accepted by its function (and its check)."""
    if not specs:
        raise ValueError("rewards: expected at least one reward")
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"rewards: {spec.name!r} is listed twice")
        seen.add(spec.name)
        registered = _registered(spec.name)
        try:
            inspect.signature(registered.fn).bind("", 0, {}, **spec.kwargs)
        except TypeError as e:
            raise ValueError(f"reward {spec.name!r}: kwargs {spec.kwargs} do not fit {_qualname(registered.fn)}: "
                             f"{e}") from None
        if registered.check is not None:
            try:
                registered.check(**spec.kwargs)
            except ValueError as e:
                raise ValueError(f"{spec.name}: {e}") from None


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
