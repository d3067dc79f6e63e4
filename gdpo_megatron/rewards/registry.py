"""Reward functions by name: registration, lookup, and what a configured reward's failure scores.

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
instead of scoring every rollout as a failure. A reward that runs model-written code in the
sandbox registers with ``runs_code=True``: preflight then requires the strong sandbox, or the
config's explicit ``rewards.allow_weaker_sandbox``.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.user_files import import_user_file

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class _Registered:
    """What ``register_reward`` recorded for one name."""

    fn: RewardFn
    bounds: tuple[float, float] | None  # the (low, high) its values lie in, when declared
    check: Callable[..., None] | None  # raises ValueError for kwargs ``fn`` would refuse
    runs_code: bool = False  # runs model-written code in the sandbox


_REGISTRY: dict[str, _Registered] = {}


def register_reward(name: str, bounds: tuple[float, float] | None = None,
                    check: Callable[..., None] | None = None, runs_code: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as reward ``name``, returning values in ``bounds`` (low, high);
    ``check(**kwargs)`` (optional) raises ValueError for kwargs ``fn`` would refuse; ``runs_code``:
    ``fn`` runs model-written code in the sandbox."""
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
        _REGISTRY[name] = _Registered(fn, None if bounds is None else (float(bounds[0]), float(bounds[1])), check,
                                      runs_code)
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


def runs_code(name: str) -> bool:
    """Whether reward ``name`` runs model-written code in the sandbox."""
    return _registered(name).runs_code


def load_reward_file(path: str | Path) -> None:
    """Import a Python file so that its ``@register_reward`` decorators run (idempotent)."""
    import_user_file(path, "gdpo_megatron_user_rewards", "reward file")


def failure_score(spec: RewardSpec) -> float:
    """What a failed call of ``spec``'s reward scores: its ``failure_value``, else the reward's
    declared low bound, else 0."""
    if spec.failure_value is not None:
        return float(spec.failure_value)
    bounds = reward_bounds(spec.name)
    return bounds[0] if bounds is not None else 0.0


class SignatureError(ValueError):
    """A reward's function cannot be called as ``fn(completion, num_tokens, ground_truth, ...)``,
    whatever its kwargs."""


def validate_specs(specs: Sequence[RewardSpec]) -> None:
    """Each reward registered, its function callable as a reward (else :class:`SignatureError`),
    and its kwargs accepted by its function (and its check)."""
    for spec in specs:
        registered = _registered(spec.name)
        signature = inspect.signature(registered.fn)
        try:
            signature.bind_partial("", 0, {})
        except TypeError as e:
            raise SignatureError(f"reward {spec.name!r} is {_described(registered.fn)}, which cannot be called as a "
                                 f"reward, fn(completion, num_tokens, ground_truth, **kwargs): {e}") from None
        try:
            signature.bind("", 0, {}, **spec.kwargs)
        except TypeError as e:
            raise ValueError(f"reward {spec.name!r}: kwargs {spec.kwargs} do not fit {_described(registered.fn)}: "
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


def _described(fn: Callable) -> str:
    """``name(its, signature)``, and where it is defined when Python knows."""
    try:
        where = f" ({inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno})"
    except (TypeError, AttributeError):
        where = ""
    return f"{_qualname(fn)}{inspect.signature(fn)}{where}"
