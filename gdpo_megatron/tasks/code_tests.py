"""Test cases of published code data sets, as the ``tests`` the code rewards run (the ``code`` task's ground truth).

APPS and TACO (field ``input_output``) and Eurus-2-RL (verl's ``reward_model.ground_truth``)
hold one JSON object, usually as a JSON string: ``{"inputs": [...], "outputs": [...]}``, plus
``"fn_name"`` for call-based problems.

* Standard input (no ``fn_name``): each input is the program's stdin and each output its
  expected stdout (a list of lines is joined with newlines). Becomes ``{"input", "output"}``.
* Call-based: each input is the argument list and each output the expected return value
  (APPS and TACO: the values, the output usually wrapped in a one-element list; Eurus-2-RL:
  JSON text, the input one JSON value per line, decoded as verl's harness decodes them).
  Becomes an ``{"assert"}`` test calling ``fn_name`` (or ``Solution().fn_name`` when the
  program defines a ``Solution`` class with it). As in the APPS/TACO harness, a dict first
  argument or a dict output (or first element of the output) whose keys all read as integers
  gets integer keys (JSON cannot hold them; the harness also drops the other arguments, which
  are kept here), and the call passes if its return value, tuples read as lists, equals the
  output or, when the output is a non-empty list, its first element.
"""
from __future__ import annotations

import json
from typing import Any

_CALL_TEST = """\
import json as _gdpo_json

def _gdpo_plain(value):
    if isinstance(value, (list, tuple)):
        return [_gdpo_plain(v) for v in value]
    if isinstance(value, dict):
        return {{k: _gdpo_plain(v) for k, v in value.items()}}
    return value

def _gdpo_int_keys(value):
    try:
        return {{int(k): v for k, v in value.items()}}
    except (AttributeError, TypeError, ValueError):  # not a dict, or a key that is no integer
        return None

_gdpo_args = _gdpo_json.loads({args!r})
_gdpo_keyed = _gdpo_int_keys(_gdpo_args[0]) if _gdpo_args else None
if _gdpo_keyed is not None:
    _gdpo_args[0] = _gdpo_keyed
_gdpo_expected = _gdpo_json.loads({expected!r})
_gdpo_keyed = _gdpo_int_keys(_gdpo_expected)
if _gdpo_keyed is None and isinstance(_gdpo_expected, list) and _gdpo_expected:
    _gdpo_keyed = _gdpo_int_keys(_gdpo_expected[0])
if _gdpo_keyed is not None:
    _gdpo_expected = [_gdpo_keyed]
_gdpo_fn = getattr(Solution(), {name!r}) if hasattr(globals().get("Solution"), {name!r}) else {name}
_gdpo_got = _gdpo_plain(_gdpo_fn(*_gdpo_args))
assert _gdpo_got == _gdpo_expected or (
    isinstance(_gdpo_expected, list) and len(_gdpo_expected) > 0 and _gdpo_got == _gdpo_expected[0])
"""


def tests_from_input_output(spec: Any) -> list[dict[str, str]]:
    """The ``tests`` list of an ``{"inputs", "outputs"[, "fn_name"]}`` object or its JSON string.

    Raises ValueError saying what is malformed.
    """
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"test cases are not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"test cases: expected an object with 'inputs' and 'outputs', got {type(spec).__name__}")
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not (isinstance(inputs, list) and isinstance(outputs, list) and inputs and len(inputs) == len(outputs)):
        raise ValueError("test cases: expected non-empty 'inputs' and 'outputs' lists of equal length, got "
                         f"{_size(inputs)} inputs and {_size(outputs)} outputs")
    name = spec.get("fn_name")
    if name is None:
        return [{"input": _text(x, "input", i), "output": _text(y, "output", i)}
                for i, (x, y) in enumerate(zip(inputs, outputs))]
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"test cases: 'fn_name' must be a Python identifier, got {name!r}")
    return [{"assert": _CALL_TEST.format(name=name, args=json.dumps(_arguments(x, i)),
                                         expected=json.dumps(_return_value(y, as_json_text=isinstance(x, str))))}
            for i, (x, y) in enumerate(zip(inputs, outputs))]


def _text(value: Any, what: str, i: int) -> str:
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise ValueError(f"test cases: {what} {i} must be a string or a list of lines, got {value!r}")
    return value


def _arguments(value: Any, i: int) -> list:
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            return [json.loads(line) for line in value.split("\n")]
        except json.JSONDecodeError:
            raise ValueError(f"test cases: input {i} of a call-based problem is neither an argument list nor "
                             f"one JSON value per line: {value!r}") from None
    raise ValueError(f"test cases: input {i} of a call-based problem must be a list or a string, got {value!r}")


def _return_value(value: Any, as_json_text: bool) -> Any:
    """The output as is, or (``as_json_text``: Eurus-2-RL's layout) its JSON text decoded where it is JSON."""
    if not (as_json_text and isinstance(value, str)):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _size(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else "no"
