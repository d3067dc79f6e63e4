"""What an environment is: reset from a question's config, step on the model's parsed calls.

An :class:`Environment` holds one trajectory's state (one instance per trajectory, on the rank
that generates it). A subclass implements:

* ``reset(config)``: load the question's environment config (a dict from its data row); returns
  the environment's opening note for the model ("" for none).
* ``tools()``: the function schemas callable now, each ``{"name", "description",
  "parameters": {"type": "dict", "properties": {name: {"type", ...}}, "required": [...]}}``
  (BFCL's format; JSON-schema types ``object`` / ``number`` are accepted as ``dict`` / ``float``).
* ``call(name, arguments)``: run one call whose name is among ``tools()`` and whose arguments
  have been checked against its schema (an optional parameter may be given as null); the
  return value is the call's result (a string, or a value turned into one as BFCL does: a dict
  as JSON, anything else with ``str``).
* optionally ``start_turn(index)`` (a note when user turn ``index`` > 0 begins, e.g. functions
  that become available), ``state()`` (what the state-correctness reward compares, by default
  the instance's public attributes) and ``matches(reference)`` (whether this state equals a
  reference environment's after the same turn; default ``state() == reference.state()``), and
  ``done``: set it True in a call that ends the trajectory (a game that is over); the rollout
  stops after that step, and the rewards grade the user turns it never reached as empty.

:meth:`Environment.step` is the same for every environment and is not overridden: each call is
checked (:func:`bind_arguments`: a known function, positional arguments mapped in the schema's
parameter order, required parameters present, no unknown ones, values of the declared types)
and refused with an error result when it does not fit; an accepted call that raises becomes an
error result ``"Error during execution: <message>"`` (BFCL's wording). Neither ends the
trajectory: the model reads the error and goes on. What ends a trajectory as a failure (the
environment's own methods raising outside a call, or a step over its time limit) is
:mod:`gdpo_megatron.environments.host`'s.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from gdpo_megatron.environments.calls import Call, CallRefused

ERROR_PREFIX = "Error during execution: "

# schema type -> the Python types a value of it may have (bool is not an int here)
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "float": (int, float), "number": (int, float), "boolean": (bool,),
    "array": (list, tuple), "tuple": (list, tuple), "dict": (dict,), "object": (dict,),
}


@dataclass(frozen=True)
class CallResult:
    """What one call gave: its text (the result, or why it failed) and whether it failed;
    ``refused``: it was never run (unknown function or arguments that do not fit)."""

    call: Call
    output: str
    error: bool = False
    refused: bool = False


@dataclass(frozen=True)
class StepResult:
    """A step's results, one per call in order; the observation shown to the model; done."""

    results: tuple[CallResult, ...]
    done: bool = False

    @property
    def observation(self) -> str:
        return "\n".join(r.output for r in self.results)


class Environment:
    """One trajectory's environment (see the module docstring for what a subclass implements)."""

    done: bool = False

    def reset(self, config: dict) -> str:
        raise NotImplementedError

    def tools(self) -> list[dict]:
        raise NotImplementedError

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        raise NotImplementedError

    def start_turn(self, index: int) -> str:
        return ""

    def state(self) -> Any:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def matches(self, reference: "Environment") -> bool:
        return self.state() == reference.state()

    def step(self, calls: Sequence[Call]) -> StepResult:
        """Run ``calls`` in order (checked; refused or failing ones give error results)."""
        schemas = {tool["name"]: tool for tool in self.tools()}
        results = []
        for call in calls:
            try:
                arguments = bind_arguments(call, schemas)
            except CallRefused as e:
                results.append(CallResult(call, f"{ERROR_PREFIX}{e}", error=True, refused=True))
                continue
            try:
                output = result_text(self.call(call.name, arguments))
            except Exception as e:  # the call's own failure: the model reads it, as in BFCL
                results.append(CallResult(call, f"{ERROR_PREFIX}{e}", error=True))
            else:
                results.append(CallResult(call, output))
        return StepResult(tuple(results), bool(self.done))


def result_text(value: Any) -> str:
    """A call's return value as the text the model reads (BFCL's conversion)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def bind_arguments(call: Call, schemas: dict[str, dict]) -> dict[str, Any]:
    """``call``'s arguments by parameter name, checked against its function's schema; CallRefused
    naming what does not fit."""
    schema = schemas.get(call.name)
    if schema is None:
        raise CallRefused(f"{call.name!r} is not an available function")
    parameters = schema.get("parameters") or {}
    properties: dict[str, dict] = parameters.get("properties") or {}
    names = list(properties)
    if len(call.args) > len(names):
        raise CallRefused(f"{call.name}: takes at most {len(names)} arguments, got {len(call.args)} positional")
    arguments = dict(zip(names, call.args))
    for key, value in call.kwargs.items():
        if key in arguments:
            raise CallRefused(f"{call.name}: argument {key!r} given twice")
        arguments[key] = value
    unknown = [key for key in arguments if key not in properties]
    if unknown:
        raise CallRefused(f"{call.name}: unknown argument{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(map(repr, unknown))} (parameters: {', '.join(names) or 'none'})")
    required = parameters.get("required") or ()
    missing = [key for key in required if key not in arguments]
    if missing:
        raise CallRefused(f"{call.name}: missing required argument{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(map(repr, missing))}")
    for key, value in arguments.items():
        if value is None and key not in required:
            continue  # an optional parameter given as null: its default
        problem = _type_problem(value, properties[key])
        if problem:
            raise CallRefused(f"{call.name}: argument {key!r} {problem}")
    return arguments


def _type_problem(value: Any, schema: dict) -> str | None:
    """Why ``value`` does not fit ``schema`` (its type, items, enum), or None."""
    kind = schema.get("type", "any")
    allowed = _TYPES.get(kind)
    if allowed is not None:
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            return f"must be {kind}, got {type(value).__name__}"
    if kind in ("array", "tuple") and isinstance(schema.get("items"), dict):
        for item in value:
            problem = _type_problem(item, schema["items"])
            if problem:
                return f"item {problem}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}, got {value!r}"
    return None
