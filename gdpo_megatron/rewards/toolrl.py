"""ToolRL's tool-calling rewards: ``toolrl_format`` in {0, 1}, ``toolrl_correctness`` in [-3, 3].

These are the rewards of the GDPO paper's tool-calling runs, on ToolRL's rlla data, whose
prompts ask for this answer format::

    <think> ... </think>
    <tool_call>
    {"name": "get_weather", "parameters": {"city": "Paris"}}
    {"name": "get_time", "parameters": {"zone": "CET"}}
    </tool_call>
    <response> ... </response>

a think block, then a ``<tool_call>`` block (one JSON object per line), a ``<response>``
block, or both. The ground truth is ToolRL's reference answer in the same format,
``{"answer": "<think>...</think>\\n<tool_call>..."}``; its kind is which of the two tags it
contains.

``toolrl_format``: 1 if the completion, stripped, is exactly the reference's kind of answer
(``<think>...</think>``, then ``\\n<tool_call>\\n...\\n</tool_call>`` and/or
``\\n<response>...</response>``, nothing else; with no tag in the reference, the think block
alone) and each ``tool_call`` / ``response`` tag the reference uses appears once in it.

``toolrl_correctness``: 0 when the reference calls no tool. Otherwise -3 unless the completion
has ``<tool_call>`` and ``</tool_call>`` and every line after the first ``<tool_call>`` up to
the next ``<tool_call>`` or ``</tool_call>`` (as ToolRL splits the text) is a JSON object with a
``"name"`` (and a ``"parameters"`` object where the name is one of the reference's); then
``6 * S / S_max - 3`` with

    S     = Jaccard(reference names, predicted names)             (multisets)
          + sum over paired calls of  Jaccard(parameter names) + #parameters with equal values
    S_max = 1 + sum over reference calls of (1 + #parameters)

where each reference call is paired with at most one predicted call of the same name. By
default the pairs are those of ToolRL's released reward code, which the GDPO paper trains
with: reference calls in order, each taking the unpaired predicted call that scores highest
with it (the first on ties). ``matching="optimal"`` takes the pairs that make S largest
instead: never lower, and independent of the order of calls that repeat a name. Values are
equal when the decoded JSON values compare equal in Python (``1 == 1.0``).

A reference that ToolRL's rules cannot read (that span is not one JSON call per line, e.g.
because its think block mentions the tag) raises :class:`UnscorableReference`; ToolRL's own
code crashes on it.
"""
from __future__ import annotations

import json
import re
from typing import Any

from gdpo_megatron.rewards.registry import register_reward
from gdpo_megatron.rewards.tool_call import _jaccard, best_assignment

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"
MAX_CORRECTNESS, MIN_CORRECTNESS = 3.0, -3.0
MATCHINGS = ("greedy", "optimal")
_THINK = r"<think>.*?</think>"
_CALLS = r"\n<tool_call>\n.*?\n</tool_call>"
_RESPONSE = r"\n<response>.*?</response>"
# The completion's whole structure, by (reference calls a tool, reference has a response).
_STRUCTURE = {
    (True, False): re.compile(_THINK + _CALLS, re.DOTALL),
    (False, True): re.compile(_THINK + _RESPONSE, re.DOTALL),
    (True, True): re.compile(_THINK + _CALLS + _RESPONSE, re.DOTALL),
    (False, False): re.compile(_THINK, re.DOTALL),
}


class UnscorableReference(ValueError):
    """A reference answer whose tool calls ToolRL's rules cannot read."""


def parse_reference(answer: Any) -> tuple[dict[str, Any], ...] | None:
    """The calls of reference answer ``answer`` read by ToolRL's rules (None: it calls no tool).

    Raises :class:`UnscorableReference` when ToolRL's rules cannot read them.
    """
    if not isinstance(answer, str):
        raise UnscorableReference(f"reference answer: expected a string, got {type(answer).__name__}")
    if CALL_OPEN not in answer:
        return None
    try:
        calls = _call_lines(answer)
    except ValueError as e:
        raise UnscorableReference(f"reference tool calls: {e}") from None
    for call in calls:
        if not (isinstance(call.get("name"), str) and isinstance(call.get("parameters"), dict)):
            raise UnscorableReference(f"reference call {call!r}: expected {{'name': str, 'parameters': object}}")
    return tuple(calls)


@register_reward("toolrl_format", bounds=(0.0, 1.0))
def toolrl_format(completion: str, num_tokens: int, ground_truth: dict) -> float:
    """1 if the completion has the structure of the reference's kind of answer (module docstring)."""
    answer = _answer(ground_truth)
    expects_calls, expects_response = CALL_OPEN in answer, RESPONSE_OPEN in answer
    text = completion.strip()
    tags = ((CALL_OPEN, CALL_CLOSE) if expects_calls else ()) + (
        (RESPONSE_OPEN, RESPONSE_CLOSE) if expects_response else ())
    # Counting the tags first keeps the pattern's backtracking linear in the completion's length.
    if not all(text.count(tag) == 1 for tag in tags):
        return 0.0
    return 0.0 if _STRUCTURE[expects_calls, expects_response].fullmatch(text) is None else 1.0


def _check_matching(matching: str = "greedy") -> None:
    if matching not in MATCHINGS:
        raise ValueError(f"matching must be one of {MATCHINGS}, got {matching!r}")


@register_reward("toolrl_correctness", bounds=(MIN_CORRECTNESS, MAX_CORRECTNESS), check=_check_matching)
def toolrl_correctness(completion: str, num_tokens: int, ground_truth: dict, matching: str = "greedy") -> float:
    """ToolRL's matching score of the calls, in [-3, 3]; ``matching``: "greedy" or "optimal" (module docstring)."""
    _check_matching(matching)
    expected = parse_reference(_answer(ground_truth))
    if expected is None:
        return 0.0
    text = completion.strip()
    if CALL_OPEN not in text or CALL_CLOSE not in text:
        return MIN_CORRECTNESS
    try:
        predicted = _call_lines(text)
    except ValueError:
        return MIN_CORRECTNESS
    expected_names = {call["name"] for call in expected}
    for call in predicted:
        if "name" not in call or isinstance(call["name"], (list, dict)):
            return MIN_CORRECTNESS
        if call["name"] in expected_names and not isinstance(call.get("parameters"), dict):
            return MIN_CORRECTNESS
    pairs = [[_pair_score(want["parameters"], got["parameters"]) if got["name"] == want["name"] else 0.0
              for got in predicted] for want in expected]
    score = _jaccard([c["name"] for c in expected], [c["name"] for c in predicted])
    if matching == "optimal":
        score += best_assignment(pairs)
    else:
        paired: set[int] = set()
        for row in pairs:
            best, column = max(((value, j) for j, value in enumerate(row) if j not in paired),
                               key=lambda item: item[0], default=(0.0, None))
            if best > 0.0:
                paired.add(column)
                score += best
    best_possible = 1.0 + sum(1.0 + len(call["parameters"]) for call in expected)
    return (MAX_CORRECTNESS - MIN_CORRECTNESS) * score / best_possible + MIN_CORRECTNESS


def _answer(ground_truth: dict) -> str:
    answer = ground_truth.get("answer") if isinstance(ground_truth, dict) else None
    if not isinstance(answer, str):
        raise ValueError(f"ground_truth: expected ToolRL's reference answer string under 'answer', "
                         f"got {ground_truth!r}")
    return answer


def _call_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects on the lines after the first ``<tool_call>``, up to the next tag of the two.

    Raises ValueError when a line is not a JSON object.
    """
    block = text.split(CALL_OPEN, 2)[1].split(CALL_CLOSE, 1)[0].strip()
    calls = []
    for line in block.split("\n"):
        try:
            call = json.loads(line)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
            raise ValueError(f"line {line[:80]!r} is not JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(call, dict):
            raise ValueError(f"line {line[:80]!r} is not a JSON object")
        calls.append(call)
    return calls


def _pair_score(expected: dict[str, Any], given: dict[str, Any]) -> float:
    """Jaccard of the parameter names + the number of expected parameters given with equal values."""
    equal = sum(1 for key, value in expected.items() if key in given and given[key] == value)
    return _jaccard(list(expected), list(given)) + equal
