"""BFCL's own checkers as the reference for the tool-calling reward and the multi-turn verdicts,
and calls to compare on.

``ast_checker`` is BFCL's code, imported from the installed ``bfcl-eval`` package. Its module
imports BFCL's registry of model handlers (``constants.model_config``) only to look up, for a
function name with a dot, whether a model's API renames it; that registry imports every
vendor SDK, so where it cannot be imported it is replaced by one entry that renames nothing.
Used by tests/test_rewards_tool.py and benchmarks/bfcl_agreement.py.

:func:`multi_turn_verdict` is BFCL's ``multi_turn_checker`` on per-turn call lists (used by
tests/test_bfcl_multi_turn.py and tests/test_eval_multi_turn.py). It runs the calls with
``eval``: give it only call strings written by a test, or rendered from calls the project's
parser accepted (a plain name and literal arguments).
"""
from __future__ import annotations

import copy
import itertools
import json
import re
import sys
import types

MODEL = "gdpo"
MULTI_TURN_ERRORS = {"multi_turn:empty_turn_model_response": "empty",
                     "multi_turn:instance_state_mismatch": "state",
                     "multi_turn:execution_response_mismatch": "response"}
_multi_turn_runs = itertools.count()  # BFCL keeps each run's instances by name: a fresh name per verdict


def multi_turn_verdict(steps: list[list[list[str]]], row: dict) -> tuple[bool, str | None, int | None]:
    """BFCL's verdict on a ``bfcl_multi_turn`` row's question, given per user turn the model's
    steps (each a list of call strings): (valid, the check that failed, its turn or None)."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    truth = row["multi_turn"]
    entry = {"id": row["id"], "initial_config": truth["environment_config"]["initial_config"],
             "involved_classes": truth["environment_config"]["involved_classes"]}
    result = multi_turn_checker(steps, truth["reference_calls"], entry, row["id"].rsplit("_", 1)[0],
                                f"agreement_{next(_multi_turn_runs)}")
    if result["valid"]:
        return True, None, None
    turn = re.search(r"for turn (\d+)", result["error_message"])
    return False, MULTI_TURN_ERRORS[result["error_type"]], int(turn[1]) if turn else None


def load_ast_checker():
    try:
        import bfcl_eval.constants.model_config  # noqa: F401
    except ImportError:
        registry = types.ModuleType("bfcl_eval.constants.model_config")
        registry.MODEL_CONFIG_MAPPING = {MODEL: types.SimpleNamespace(underscore_to_dot=False)}
        sys.modules["bfcl_eval.constants.model_config"] = registry
    from bfcl_eval.eval_checker.ast_eval import ast_checker

    return ast_checker


def bfcl_valid(checker, sample, calls: list[dict]) -> bool:
    """BFCL's verdict on ``calls`` (``[{"name", "arguments"}]``) for a loaded BFCL sample; a
    checker that raises counts as invalid."""
    truth = sample.ground_truth
    possible = [{c["name"]: c["accepted"]} for c in truth["tool_calls"]]
    output = [{c["name"]: c["arguments"]} for c in calls]
    try:
        return checker.ast_checker(truth["tools"], output, possible, checker.Language.PYTHON,
                                   sample.metadata["category"], MODEL)["valid"]
    except Exception:
        return False


def completion(calls: list[dict]) -> str:
    return f"<think>calling</think>\n<tool_call>\n{json.dumps(calls)}\n</tool_call>"


def pick_first(alternatives: list):
    """The first listed answer, as a model would write it. A parameter's answers may be dicts
    (or lists of dicts) listing accepted values per key; the values inside those are literal."""
    for alt in alternatives:
        if alt == "":
            continue
        if isinstance(alt, dict):
            return _first_of_each_key(alt)
        if isinstance(alt, list) and alt and all(isinstance(a, dict) for a in alt):
            return [_first_of_each_key(a) for a in alt]
        return alt
    return _OMIT


def _first_of_each_key(answer: dict) -> dict:
    return {k: next(x for x in v if x != "") for k, v in answer.items()
            if isinstance(v, list) and any(x != "" for x in v)}


_OMIT = object()


def listed_calls(sample, pick=pick_first) -> list[dict]:
    calls = []
    for call in sample.ground_truth["tool_calls"]:
        arguments = {}
        for name, alternatives in call["accepted"].items():
            value = pick(alternatives) if isinstance(alternatives, list) else _OMIT
            if value is not _OMIT:
                arguments[name] = value
        calls.append({"name": call["name"], "arguments": arguments})
    return calls


def _map_values(calls, fn):
    """A copy of ``calls`` with ``fn(value)`` applied to every argument value (and nested ones)."""
    def walk(v):
        v = fn(v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    return [{"name": c["name"], "arguments": {k: walk(v) for k, v in c["arguments"].items()}} for c in calls]


def _first_string_edit(calls, edit):
    """``calls`` with the first top-level string argument edited, or None if there is none."""
    out = copy.deepcopy(calls)
    for call in out:
        for k, v in call["arguments"].items():
            if isinstance(v, str):
                call["arguments"][k] = edit(v)
                return out
    return None


def perturbations(sample) -> dict[str, list[dict]]:
    """Calls to compare the verdicts on: the listed answers and edits of them."""
    base = listed_calls(sample)
    out = {"first listed values": base}
    out["optional arguments omitted"] = listed_calls(
        sample, lambda alts: _OMIT if "" in alts else pick_first(alts[::-1]))
    for i, call in enumerate(base):
        for k in list(call["arguments"])[:3]:
            omitted = copy.deepcopy(base)
            del omitted[i]["arguments"][k]
            out[f"call {i}: {k} omitted"] = omitted
    out["ints as floats"] = _map_values(base, lambda v: float(v) if type(v) is int else v)
    out["integral floats as ints"] = _map_values(base, lambda v: int(v) if type(v) is float and v.is_integer() else v)
    out["numbers as strings"] = _map_values(base, lambda v: str(v) if type(v) in (int, float) else v)
    out["booleans as ints"] = _map_values(base, lambda v: int(v) if type(v) is bool else v)
    out["numbers plus one"] = _map_values(base, lambda v: v + 1 if type(v) in (int, float) else v)
    out["strings upper case with dashes"] = _map_values(base, lambda v: v.upper().replace(" ", "-") if type(v) is str else v)
    out["double quotes as single"] = _map_values(base, lambda v: v.replace('"', "'") if type(v) is str else v)
    out["strings with a letter added"] = _first_string_edit(base, lambda v: v + "q")
    out["unexpected argument"] = [dict(c, arguments={**c["arguments"], "unexpected_argument": 1}) for c in base]
    out["first call renamed"] = [dict(base[0], name=base[0]["name"] + "_v2")] + base[1:] if base else None
    out["last call dropped"] = base[:-1] if base else None
    out["first call repeated"] = base + base[:1] if base else None
    out["calls reversed"] = base[::-1] if len(base) > 1 else None
    out["dict values: a key dropped"] = [
        dict(c, arguments={k: dict(list(v.items())[1:]) if isinstance(v, dict) and v else v
                           for k, v in c["arguments"].items()}) for c in base]
    out["lists of dicts: last dict dropped"] = [
        dict(c, arguments={k: v[:-1] if isinstance(v, list) and v and all(isinstance(x, dict) for x in v) else v
                           for k, v in c["arguments"].items()}) for c in base]
    return {name: calls for name, calls in out.items() if calls is not None}
