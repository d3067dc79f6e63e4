"""Tool-calling rewards: ``tool_format`` in {0, 1} and ``tool_correctness`` in [-3, 3].

A completion that calls tools looks like::

    <think>...</think>
    <tool_call>
    [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
    </tool_call>

(a single JSON object instead of the list is accepted). One that answers without a call is a
think block followed by plain text.

Ground truth: ``{"tool_calls": [call, ...]}``, an empty list meaning "answer without a call",
and optionally ``"tools"``, the function schemas. A call is either ``{"name": ...,
"arguments": {arg: value}}`` (the value must match) or, in the Berkeley Function Calling
Leaderboard (BFCL) form, ``{"name": ..., "accepted": {arg: [v1, v2, ...]}}``. A value in
the BFCL form matches exactly when BFCL's own checker (``ast_checker``, Python) accepts it:
the parameter's schema type (an int is accepted for a float, never a float for an int; a
value of the listed answers' type counts as a variable), strings compared after BFCL's
normalization (case, spaces, ``,./-_*^`` ignored, ``'`` read as ``"``), a ``dict`` parameter's
answers listing accepted values per key (values inside compared as they are), a list of
dicts compared dict by dict. ``""`` in the list means "may be omitted", and only that (not
for a parameter the schema requires). So ``tool_correctness == 3`` is BFCL's verdict, except
that calls are paired to maximize the score where BFCL pairs parallel calls greedily.

Correctness follows ToolRL, the reward the GDPO paper trains with: a matching score
S = Jaccard(call names, with multiplicity) + sum over ground-truth calls of their match with
a predicted call of the same name (Jaccard of argument names + number of arguments with
equal values); the reward is 6 * S / S_max - 3 with S_max = 1 + |calls| + sum of the calls'
argument counts. Calls are matched one to one so that S is largest (an optimal assignment;
ToolRL's greedy matching in ground-truth order would make the score of parallel calls
depend on the order the ground truth happens to list them in).
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gdpo_megatron.rewards.registry import register_reward
from gdpo_megatron.rewards.tags import tagged_blocks

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_CORRECTNESS, MIN_CORRECTNESS = 3.0, -3.0
_WITH_CALL = re.compile(
    r"\A<think>.*?</think>\s*<tool_call>(?P<calls>.*?)</tool_call>\Z", re.DOTALL
)
_WITHOUT_CALL = re.compile(r"\A<think>.*?</think>(?P<answer>.*)\Z", re.DOTALL)
_STRING_NOISE = re.compile(r"[ ,./\-_*^]")
# BFCL's Python types of schema types ("any" is checked as a string there too).
_BFCL_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
               "dict": dict, "any": str}
_UNDECLARED = {"type": None}  # a listed argument the schema does not declare: BFCL accepts no value for it


class ToolCallParseError(ValueError):
    """The completion's tool-call block is not a JSON list of {"name", "arguments"} objects."""


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """Calls in every ``<tool_call>`` block of ``text``; ``None`` if there is no block.

    Raises :class:`ToolCallParseError` when a block does not hold valid calls.
    """
    blocks = tagged_blocks(text, CALL_OPEN, CALL_CLOSE)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            parsed = json.loads(block)
        except (ValueError, RecursionError) as e:  # not JSON, an integer past Python's digit limit, too deep
            raise ToolCallParseError(f"tool_call block is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                    and isinstance(call.get("arguments", {}), dict)):
                # The type only: the repr of a deeply nested value can itself exceed the recursion limit.
                raise ToolCallParseError(f"expected {{'name': str, 'arguments': dict}}, got a {type(call).__name__}")
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return calls


@register_reward("tool_format", bounds=(0.0, 1.0))
def tool_format(completion: str, num_tokens: int, ground_truth: dict) -> float:
    """1 if the completion has the structure the ground truth asks for, else 0.

    With expected calls: a think block, then exactly one tool_call block holding valid JSON
    calls, nothing after it. Without: a think block, then a non-empty plain answer and no
    tool_call tag. Every tag appears exactly once.
    """
    text = completion.strip()
    expects_call = bool(_expected_calls(ground_truth))
    tags = (THINK_OPEN, THINK_CLOSE) + ((CALL_OPEN, CALL_CLOSE) if expects_call else ())
    if any(text.count(tag) != 1 for tag in tags):
        return 0.0
    if expects_call:
        match = _WITH_CALL.match(text)
        if match is None:
            return 0.0
        try:
            parse_tool_calls(f"{CALL_OPEN}{match['calls']}{CALL_CLOSE}")
        except ToolCallParseError:
            return 0.0
        return 1.0
    match = _WITHOUT_CALL.match(text)
    ok = match is not None and match["answer"].strip() and CALL_OPEN not in text and CALL_CLOSE not in text
    return 1.0 if ok else 0.0


@register_reward("tool_correctness", bounds=(MIN_CORRECTNESS, MAX_CORRECTNESS))
def tool_correctness(
    completion: str, num_tokens: int, ground_truth: dict, normalize_strings: bool = False
) -> float:
    """ToolRL matching score scaled to [-3, 3] (see the module docstring).

    ``normalize_strings`` compares the strings of ``arguments`` ground truths the way BFCL
    does; off, they must be equal. BFCL-form ground truths always follow BFCL's rules.
    """
    expected = _expected_calls(ground_truth)
    try:
        predicted = parse_tool_calls(completion)
    except ToolCallParseError:
        return MIN_CORRECTNESS
    if predicted is None:
        return 0.0 if not expected else MIN_CORRECTNESS
    if not expected and not predicted:
        return 0.0
    names = _jaccard([c["name"] for c in expected], [c["name"] for c in predicted])
    pair_scores = [
        [_argument_score(call["args"], pred["arguments"], normalize_strings) if pred["name"] == call["name"] else 0.0
         for pred in predicted]
        for call in expected
    ]
    score = names + best_assignment(pair_scores)
    best_possible = 1.0 + sum(1 + len(call["args"]) for call in expected)
    return (MAX_CORRECTNESS - MIN_CORRECTNESS) * score / best_possible + MIN_CORRECTNESS


def best_assignment(scores: list[list[float]]) -> float:
    """Largest total of a one-to-one matching of rows to columns (Hungarian algorithm).

    Rows or columns may be left unmatched; scores must be >= 0.
    """
    if not scores or not scores[0]:
        return 0.0
    if len(scores) > len(scores[0]):
        scores = [list(col) for col in zip(*scores)]
    n, m = len(scores), len(scores[0])
    # Minimize the negated scores with potentials u (rows) and v (columns); 1-based, column 0 is virtual.
    u, v, match, way = [0.0] * (n + 1), [0.0] * (m + 1), [0] * (m + 1), [0] * (m + 1)
    for row in range(1, n + 1):
        match[0], col = row, 0
        slack, used = [math.inf] * (m + 1), [False] * (m + 1)
        while match[col]:
            used[col] = True
            i, delta, next_col = match[col], math.inf, 0
            for j in range(1, m + 1):
                if not used[j]:
                    reduced = -scores[i - 1][j - 1] - u[i] - v[j]
                    if reduced < slack[j]:
                        slack[j], way[j] = reduced, col
                    if slack[j] < delta:
                        delta, next_col = slack[j], j
            for j in range(m + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    slack[j] -= delta
            col = next_col
        while col:
            match[col] = match[way[col]]
            col = way[col]
    return sum(scores[match[j] - 1][j - 1] for j in range(1, m + 1) if match[j])


@dataclass(frozen=True)
class _Argument:
    """What a ground-truth argument accepts (see :func:`_accepts`)."""

    alternatives: list
    berkeley: bool
    omittable: bool
    schema: dict | None = None  # the parameter's schema, BFCL form with the function's schema known


def _expected_calls(ground_truth: dict) -> list[dict[str, Any]]:
    """Ground-truth calls as ``{"name", "args": {arg: _Argument}}``."""
    calls = ground_truth.get("tool_calls") if isinstance(ground_truth, dict) else None
    if not isinstance(calls, list):
        raise ValueError(f"ground_truth: expected a 'tool_calls' list, got {ground_truth!r}")
    schemas = {tool["name"]: tool.get("parameters") for tool in ground_truth.get("tools") or []
               if isinstance(tool, dict) and "name" in tool}
    out = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("accepted"), dict):
            args = _berkeley_arguments(call["accepted"], schemas.get(call.get("name")))
        elif isinstance(call, dict) and isinstance(call.get("arguments"), dict):
            args = {k: _Argument([v], berkeley=False, omittable=False) for k, v in call["arguments"].items()}
        else:
            raise ValueError(f"ground_truth: call {call!r} needs a name and an 'arguments' or 'accepted' dict")
        out.append({"name": call["name"], "args": args})
    return out


def _berkeley_arguments(accepted: dict, schema: dict | None) -> dict[str, _Argument]:
    """The arguments of a BFCL-form call; with the function's ``schema``, typed as BFCL types
    them, and a required argument is never omittable (nor one BFCL's answer does not list)."""
    if not isinstance(schema, dict):
        return {k: _Argument(alts, berkeley=True, omittable="" in alts) for k, alts in accepted.items()}
    properties, required = schema.get("properties") or {}, schema.get("required") or []
    args = {k: _Argument(alts, berkeley=True, omittable="" in alts and k not in required,
                         schema=properties.get(k, _UNDECLARED)) for k, alts in accepted.items()}
    for k in required:
        args.setdefault(k, _Argument([], berkeley=True, omittable=False, schema=_UNDECLARED))
    return args


def _argument_score(expected: dict[str, _Argument], given: dict[str, Any], normalize_strings: bool) -> float:
    """Jaccard of argument names + count of arguments with an accepted value.

    An omitted optional argument counts as present and matching.
    """
    omitted_optional = [k for k, arg in expected.items() if arg.omittable and k not in given]
    names = _jaccard(list(expected), list(given) + omitted_optional)
    equal = sum(arg.omittable if k not in given else _accepts(arg, given[k], normalize_strings)
                for k, arg in expected.items())
    return names + equal


def _accepts(arg: _Argument, value: Any, normalize_strings: bool) -> bool:
    if not arg.berkeley:
        return _equal(value, arg.alternatives[0], normalize_strings)
    if arg.schema is None:
        return any(_berkeley_equal(value, alt) for alt in arg.alternatives if alt != "")
    return _bfcl_accepts(value, arg.alternatives, arg.schema)


def _bfcl_accepts(value: Any, answers: list, schema: dict) -> bool:
    """BFCL's ``simple_function_checker`` on one parameter (Python): type, then value."""
    expected = _BFCL_TYPES.get(schema.get("type"))
    if expected is None:
        return False  # undeclared (BFCL: "unexpected parameter") or a type it does not know
    nested = None
    if schema["type"] in ("array", "tuple"):
        nested = _BFCL_TYPES.get((schema.get("items") or {}).get("type"))
    if schema["type"] == "float" and type(value) is int:
        try:
            value = float(value)
        except OverflowError:  # an integer past any float's range equals no answer
            return False
    valid, is_variable = _bfcl_type_check(value, answers, expected, nested)
    if not valid:
        return False
    if not is_variable:
        if expected is dict:
            return _bfcl_dict_accepts(value, answers)
        if expected is list and nested is dict:
            return _bfcl_dict_list_accepts(value, answers)
        if expected is str:
            return standardize_string(value) in [standardize_string(a) for a in answers if type(a) is str]
        if expected is list:
            return _standardized(value) in [_standardized(a) for a in answers if isinstance(a, (list, str))]
    return value in answers


def _bfcl_type_check(value: Any, answers: list, expected: type, nested: type | None) -> tuple[bool, bool]:
    """(valid, is a variable) as BFCL's ``type_checker``: a value of the type the listed
    answers have, where that differs from the schema's, stands for a variable."""
    answer_type = next((type(a) for a in answers if a != ""), None)
    is_variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if nested is None:
            return True, is_variable
        # Every item of the nested type, against some answer (one level deep); a failure here
        # stays a failure in BFCL, even for a value of the answers' type.
        return any(type(answer) is not list or all(_bfcl_type_check(item, answer, nested, None)[0] for item in value)
                   for answer in answers), is_variable
    if answer_type is not None and type(value) is answer_type:
        return True, True
    return False, is_variable


def _bfcl_dict_accepts(value: dict, answers: list) -> bool:
    """BFCL's ``dict_checker``: some answer lists every key given, each with an accepted value
    (compared as is, strings normalized), and lists as optional every key not given."""
    for answer in answers:
        if not isinstance(answer, dict):
            continue
        if all(k in answer and isinstance(answer[k], (list, str)) and _standardized_item(v) in _standardized(answer[k])
               for k, v in value.items()) and all(k in value or "" in alts for k, alts in answer.items()):
            return True
    return False


def _bfcl_dict_list_accepts(value: list, answers: list) -> bool:
    """BFCL's ``list_dict_checker``: as many dicts as some answer has, each accepted by the
    answer's dict at the same place."""
    return any(len(value) == len(answer) and all(_bfcl_dict_accepts(v, [a]) for v, a in zip(value, answer))
               for answer in answers if isinstance(answer, (list, str)))


def standardize_string(text: str) -> str:
    """BFCL's string normalization: spaces and ``,./-_*^`` removed, lower case, ``'`` as ``"``."""
    return _STRING_NOISE.sub("", text).lower().replace("'", '"')


def _standardized_item(x: Any) -> Any:
    return standardize_string(x) if type(x) is str else x


def _standardized(values) -> list:
    """A list with its strings normalized (one level; a string answer is read char by char, as BFCL does)."""
    return [_standardized_item(x) for x in values]


def _berkeley_equal(value: Any, answer: Any) -> bool:
    """BFCL's rules for one listed answer when the parameter's type is unknown: by the
    answer's shape (accepted values per key, dicts one by one, normalized strings)."""
    if isinstance(answer, dict):
        return isinstance(value, dict) and _bfcl_dict_accepts(value, [answer])
    if isinstance(answer, list) and answer and all(isinstance(a, dict) for a in answer):
        return isinstance(value, list) and _bfcl_dict_list_accepts(value, [answer])
    return _equal(value, answer, True)


def _equal(a: Any, b: Any, normalize_strings: bool) -> bool:
    """JSON equality where ints equal floats of the same value but booleans are not numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return standardize_string(a) == standardize_string(b) if normalize_strings else a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y, normalize_strings) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], normalize_strings) for k in a)
    return a is None and b is None


def _jaccard(a: list, b: list) -> float:
    """Jaccard similarity of two multisets; 1 when both are empty."""
    ca, cb = Counter(a), Counter(b)
    union = sum((ca | cb).values())
    return 1.0 if union == 0 else sum((ca & cb).values()) / union
