"""Tool-calling rewards: ``tool_format`` in {0, 1} and ``tool_correctness`` in [-3, 3].

A completion that calls tools looks like::

    <think>...</think>
    <tool_call>
    [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
    </tool_call>

(a single JSON object instead of the list is accepted). One that answers without a call is a
think block followed by plain text.

Ground truth: ``{"tool_calls": [call, ...]}``, an empty list meaning "answer without a call".
A call is either ``{"name": ..., "arguments": {arg: value}}`` (the value must match) or, in
the Berkeley Function Calling Leaderboard form, ``{"name": ..., "accepted": {arg: [v1, v2,
...]}}`` where any listed value matches and ``""`` in the list marks an optional argument
that may be omitted (nested dict values list their accepted values the same way).

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
from typing import Any

from gdpo_megatron.rewards.registry import register_reward

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_CORRECTNESS, MIN_CORRECTNESS = 3.0, -3.0
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_WITH_CALL = re.compile(
    r"\A<think>.*?</think>\s*<tool_call>(?P<calls>.*?)</tool_call>\Z", re.DOTALL
)
_WITHOUT_CALL = re.compile(r"\A<think>.*?</think>(?P<answer>.*)\Z", re.DOTALL)
_STRING_NOISE = re.compile(r"[ ,./\-_*^]")
_MISSING = object()


class ToolCallParseError(ValueError):
    """The completion's tool-call block is not a JSON list of {"name", "arguments"} objects."""


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """Calls in every ``<tool_call>`` block of ``text``; ``None`` if there is no block.

    Raises :class:`ToolCallParseError` when a block does not hold valid calls.
    """
    blocks = _CALL_BLOCK.findall(text)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            parsed = json.loads(block)
        except json.JSONDecodeError as e:
            raise ToolCallParseError(f"tool_call block is not JSON: {e}") from None
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                    and isinstance(call.get("arguments", {}), dict)):
                raise ToolCallParseError(f"expected {{'name': str, 'arguments': dict}}, got {call!r}")
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return calls


@register_reward("tool_format")
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


@register_reward("tool_correctness")
def tool_correctness(
    completion: str, num_tokens: int, ground_truth: dict, normalize_strings: bool = False
) -> float:
    """ToolRL matching score scaled to [-3, 3] (see the module docstring).

    ``normalize_strings`` compares strings the way the Berkeley Function Calling Leaderboard
    does (case, spaces and ``,./-_*^`` ignored); off, strings must be equal.
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


def _expected_calls(ground_truth: dict) -> list[dict[str, Any]]:
    """Ground-truth calls as ``{"name", "args": {arg: (accepted values, berkeley_form)}}``."""
    calls = ground_truth.get("tool_calls") if isinstance(ground_truth, dict) else None
    if not isinstance(calls, list):
        raise ValueError(f"ground_truth: expected a 'tool_calls' list, got {ground_truth!r}")
    out = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("accepted"), dict):
            args = {k: (alts, True) for k, alts in call["accepted"].items()}
        elif isinstance(call, dict) and isinstance(call.get("arguments"), dict):
            args = {k: ([v], False) for k, v in call["arguments"].items()}
        else:
            raise ValueError(f"ground_truth: call {call!r} needs a name and an 'arguments' or 'accepted' dict")
        out.append({"name": call["name"], "args": args})
    return out


def _argument_score(expected: dict[str, tuple], given: dict[str, Any], normalize_strings: bool) -> float:
    """Jaccard of argument names + count of arguments with an accepted value.

    An omitted optional argument counts as present and matching.
    """
    omitted_optional = [k for k, (alts, berkeley) in expected.items() if berkeley and k not in given and "" in alts]
    names = _jaccard(list(expected), list(given) + omitted_optional)
    equal = sum(
        _matches(given.get(k, _MISSING), alts, berkeley, normalize_strings)
        for k, (alts, berkeley) in expected.items()
    )
    return names + equal


def _matches(value: Any, alternatives: list, berkeley: bool, normalize_strings: bool) -> bool:
    """``value`` equals one of the alternatives.

    In the Berkeley form ``""`` accepts an omitted value and a dict alternative lists the
    accepted values of each of its keys.
    """
    if value is _MISSING:
        return berkeley and "" in alternatives
    for alt in alternatives:
        if berkeley and isinstance(alt, dict):
            if isinstance(value, dict) and set(value) <= set(alt) and all(
                _matches(value.get(k, _MISSING), alts, True, normalize_strings) for k, alts in alt.items()
            ):
                return True
        elif _equal(value, alt, normalize_strings):
            return True
    return False


def _equal(a: Any, b: Any, normalize_strings: bool) -> bool:
    """JSON equality where ints equal floats of the same value but booleans are not numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        if normalize_strings:
            return _STRING_NOISE.sub("", a).lower() == _STRING_NOISE.sub("", b).lower()
        return a == b
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
