"""BFCL's multi-turn backends as an :class:`~gdpo_megatron.environments.environment.Environment`.

The ``bfcl-eval`` package ships executable backends (``eval_checker/multi_turn_eval/
func_source_code``: a file system, a trading bot, messages, travel booking, vehicle control, a
math API, posts, tickets) and their function docs (``data/multi_turn_func_doc``). A question's
environment config says which classes are involved and their initial state::

    {"involved_classes": ["GorillaFileSystem", "TwitterAPI"], "initial_config": {...},
     "long_context": false, "excluded_functions": ["cp"], "missed_functions": {"3": ["sort"]}}

:meth:`BFCLEnvironment.reset` builds one instance per involved class, loaded with its initial
config as BFCL's own ``multi_turn_utils`` does (``_load_scenario`` of a deep copy; ``MathAPI``
is stateless). Only the backend modules are imported, never BFCL's executor: calls are
dispatched by name to the method of the class whose docs list it, with the arguments checked
against the doc's schema, never through ``eval``. The functions callable at turn ``t`` are the
involved classes' documented ones, less ``excluded_functions`` and less the
``missed_functions`` of turns after ``t`` (BFCL's miss_func category shows those from their
turn on); BFCL's executor would run an excluded or not yet shown function, this environment
refuses it. Positional arguments take the docs' parameter order, which the model is shown; it
is the methods' order for every function but ``TravelAPI.purchase_insurance`` (docs:
``insurance_cost`` before ``booking_id``), where a positional call binds as the docs say and
BFCL's ``eval`` as the method does.

:meth:`BFCLEnvironment.matches` is BFCL's state check: every public attribute of the reference
environment's instances equals the same attribute of this environment's.

A few of BFCL's reference call lists do not fit their own question (an argument of the wrong
type, a function used before its miss_func turn shows it): replayed here
(:func:`~gdpo_megatron.environments.judge.check_reference`) such a call is refused, and the
``bfcl_multi_turn`` family leaves those questions out.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from gdpo_megatron.environments.environment import Environment

BACKENDS = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
# class -> (backend module, function doc file) for the classes of BFCL's multi-turn categories
CLASSES: dict[str, tuple[str, str]] = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
STATELESS = frozenset({"MathAPI"})


def bfcl_data_dir() -> Path:
    """The ``data`` directory of the installed ``bfcl-eval`` package."""
    spec = importlib.util.find_spec("bfcl_eval")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bfcl-eval package is not installed; `pip install --no-deps bfcl-eval` provides its data"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


@lru_cache(maxsize=None)
def function_docs(class_name: str) -> tuple[dict, ...]:
    """The function docs (schemas) of one BFCL class, in the package's order."""
    if class_name not in CLASSES:
        raise ValueError(f"BFCL class {class_name!r} is not one of {sorted(CLASSES)}")
    path = bfcl_data_dir() / "multi_turn_func_doc" / CLASSES[class_name][1]
    with path.open(encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def available_tools(config: dict, turn: int) -> list[dict]:
    """The function docs callable at user turn ``turn`` of a question with ``config``."""
    hidden = set(config.get("excluded_functions") or ())
    for shown_at, names in (config.get("missed_functions") or {}).items():
        if int(shown_at) > turn:
            hidden |= set(names)
    return [doc for cls in config["involved_classes"] for doc in function_docs(cls) if doc["name"] not in hidden]


def check_config(config: Any) -> None:
    """ValueError naming what is wrong with a BFCL environment config."""
    if not isinstance(config, dict):
        raise ValueError(f"expected a dict, got {type(config).__name__}")
    classes = config.get("involved_classes")
    if not isinstance(classes, list) or not classes or not all(c in CLASSES for c in classes):
        raise ValueError(f"'involved_classes' must be a non-empty list of {sorted(CLASSES)}, got {classes!r}")
    if not isinstance(config.get("initial_config", {}), dict):
        raise ValueError("'initial_config' must be a dict of class -> initial state")
    missed = config.get("missed_functions") or {}
    if not isinstance(missed, dict) or not all(str(k).isdigit() and isinstance(v, list) for k, v in missed.items()):
        raise ValueError("'missed_functions' must map a turn number to a list of function names")


class BFCLEnvironment(Environment):
    """The involved BFCL backend instances of one trajectory."""

    def reset(self, config: dict) -> str:
        check_config(config)
        self._config = config
        self._turn = 0
        self._instances: dict[str, Any] = {}
        self._owner: dict[str, Any] = {}  # function name -> the instance whose class documents it
        initial = config.get("initial_config") or {}
        for class_name in config["involved_classes"]:
            module = importlib.import_module(f"{BACKENDS}.{CLASSES[class_name][0]}")
            instance = getattr(module, class_name)()
            if class_name not in STATELESS:
                instance._load_scenario(copy.deepcopy(initial.get(class_name, {})),
                                        long_context=bool(config.get("long_context", False)))
            self._instances[class_name] = instance
            for doc in function_docs(class_name):
                self._owner[doc["name"]] = instance
        return ""

    def start_turn(self, index: int) -> str:
        self._turn = index
        return ""

    def tools(self) -> list[dict]:
        return available_tools(self._config, self._turn)

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        return getattr(self._owner[name], name)(**arguments)

    def state(self) -> dict[str, dict[str, Any]]:
        return {name: _public(instance) for name, instance in self._instances.items()}

    def matches(self, reference: Environment) -> bool:
        if not isinstance(reference, BFCLEnvironment) or reference._instances.keys() != self._instances.keys():
            return False
        return all(
            hasattr(self._instances[name], attr) and getattr(self._instances[name], attr) == value
            for name, instance in reference._instances.items() for attr, value in _public(instance).items()
        )


def _public(instance: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}
