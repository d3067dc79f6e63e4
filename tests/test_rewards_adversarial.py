"""Every built-in reward against completions built to make it raise, hang, or pay for nothing.

The completion is the policy's to choose. Whatever it is, a reward returns a finite value
inside the bounds it declares, within a CPU-time budget, and never more than an honest wrong
answer gets: a completion holding no call to the expected function scores the lowest tool
correctness, and none of these states the math answer. (A reward that raised would score its
failure value in the reward stage; these tests call the functions directly, so a raise fails.)
"""
import gc
import math
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdpo_megatron.environments import Trajectory
from gdpo_megatron.rewards import get_reward, registered_rewards, reward_bounds

NAME = "get_weather"  # the expected function; no generated completion below contains it
SCHEMA = {"type": "dict", "required": ["city", "days"], "properties": {
    "city": {"type": "string"}, "days": {"type": "float"}, "unit": {"type": "string"}}}
TOOL = {"tool_calls": [{"name": NAME, "arguments": {"city": "Paris", "days": 3}}]}
TOOL_BFCL = {"tool_calls": [{"name": NAME, "accepted": {"city": ["Paris"], "days": [3.0], "unit": ["", "C"]}}],
             "tools": [{"name": NAME, "parameters": SCHEMA}]}
TOOLRL = {"answer": f'<think> t </think>\n<tool_call>\n{{"name": "{NAME}", "parameters": {{"city": "Paris", '
                    '"days": 3}}\n</tool_call>'}
MATH = {"answer": "\\frac{7}{13}"}
CODE = {"tests": [{"input": "2\n", "output": "4\n"}]}
CODE_LIMITS = {"wall_s": 10.0}
# The multi-turn rewards take a trajectory: the completion is its one message (a call attempt or an
# answer) in a file system where the reference makes a directory no completion below names.
MULTI_TURN = {"environment_config": {"involved_classes": ["GorillaFileSystem"], "initial_config": {
    "GorillaFileSystem": {"root": {"alice": {"type": "directory", "contents": {}}}}}},
    "reference_calls": [["mkdir(dir_name='reports')"]]}
GROUND_TRUTHS = {
    "tool_format": [TOOL, {"tool_calls": []}],
    "tool_correctness": [TOOL, TOOL_BFCL],
    "toolrl_format": [TOOLRL],
    "toolrl_correctness": [TOOLRL],
    "math_correctness": [MATH],
    "math_format": [MATH],
    "length": [{}],
    "code_pass": [CODE],
    "code_no_bug": [CODE],
    **{f"multi_turn_{name}": [MULTI_TURN] for name in ("format", "state", "response", "accuracy", "efficiency")},
}
KWARGS = {"code_pass": {"limits": CODE_LIMITS}, "code_no_bug": {"limits": CODE_LIMITS}}
BUILT_IN = sorted(n for n in registered_rewards() if get_reward(n).__module__.startswith("gdpo_megatron.rewards."))
# math-verify stops a parse and a comparison after 1 s each; everything else takes milliseconds.
CPU_BUDGET_S = 5.0


class _OverBudget(BaseException):
    """Raised by SIGPROF when a reward call has used its CPU budget (not an ``Exception``, so
    no reward's error handling can swallow it)."""


def _stop(signum, frame):
    raise _OverBudget


def score(name: str, completion: str, ground_truth: dict, num_tokens: int = 7) -> float:
    """The reward's value; fails the test if it raises, leaves its bounds or runs past the budget.

    The budget is process CPU time (``ITIMER_PROF``, repeating until it lands), which a loaded
    machine stretches far less than wall time, and which math-verify's own ``SIGALRM`` limits do
    not touch. Garbage-collector callbacks are off during the call, as in a reward worker: a
    limit that fires inside one (Hypothesis installs one) is swallowed there.
    """
    callbacks, gc.callbacks[:] = gc.callbacks[:], []
    previous = signal.signal(signal.SIGPROF, _stop)
    signal.setitimer(signal.ITIMER_PROF, CPU_BUDGET_S, 0.5)
    try:
        scored = Trajectory.from_texts("bfcl", [[completion]]) if name.startswith("multi_turn_") else completion
        value = get_reward(name)(scored, num_tokens, ground_truth, **KWARGS.get(name, {}))
    except _OverBudget:
        pytest.fail(f"{name} used over {CPU_BUDGET_S} s of CPU on {completion[:80]!r} ({len(completion)} chars)")
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
        gc.callbacks[:] = callbacks
    low, high = reward_bounds(name)
    assert isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high, (
        f"{name} returned {value!r} on {completion[:80]!r}")
    return value


def calls(block: str) -> str:
    """A well-formed think + tool_call completion around ``block`` (one line per call for ToolRL)."""
    return f"<think> t </think>\n<tool_call>\n{block}\n</tool_call>"


def call(arguments: str) -> str:
    return calls(f'{{"name": "{NAME}", "arguments": {arguments}, "parameters": {arguments}}}')


def fenced(program: str) -> str:
    return f"```python\n{program}\n```"


# Completions that hold no call to the expected function and do not state 7/13.
ATTACKS = {
    "deeply nested JSON": calls("[" * 5000),
    "nested just under the JSON parser's limit": calls("[" * 900 + "]" * 900),
    "a deeply nested call": calls("[" + "{" * 900 + "}" * 900 + "]"),
    "3000 calls, one per line": calls("\n".join(['{"name": "f", "parameters": {}}'] * 3000)),
    "NaN and Infinity as names": calls('{"name": NaN, "parameters": {}}\n{"name": Infinity}\n[-Infinity]'),
    "an integer past the digit limit": calls('{"name": "f", "arguments": {"a": 1' + "0" * 5000 + "}}"),
    "unclosed tool_call tags": "<tool_call>" * 9000,
    "unclosed answer tags": "<answer>" * 12000,
    "unclosed think tags": "<think>" * 14000,
    "closing tags only": "</tool_call></response></answer></think>" * 2400,
    "tags in reverse": "</think><think></tool_call><tool_call>" * 2500,
    "unclosed boxes": "\\boxed{" * 14000,
    "boxes repeated": "\\boxed{1}" * 11000,
    "nested fractions": "\\boxed{" + "\\frac{1}{" * 2000 + "2" + "}" * 2001,
    "a few nested fractions": "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 61,
    "nested square roots": "<answer>" + "\\sqrt{" * 5000 + "2" + "}" * 5000 + "</answer>",
    "a tower of powers": "\\boxed{9^{9^{9}}}",
    "a huge factorial": "<answer>(10^{1000000})!</answer>",
    "100k digits": "\\boxed{" + "9" * 99_990 + "}",
    "dollar signs": "$" * 100_000,
    "an unbalanced left": "\\boxed{\\left(" * 7000,
    "control characters": "".join(map(chr, range(32))) * 3000,
    "lone surrogates and bidi overrides": calls('{"name": "\ud800\u202e", "parameters": {"\udfff": 1}}') + "\ud800",
    "a program with a lone surrogate": fenced("print(2 * int(input()))  # \ud800"),
    "a program with a NUL": fenced("print(4)\x00"),
    "a program nested too deeply to compile": fenced("print(" + "(" * 40_000 + ")" * 40_000 + ")"),
    "fences without an end": "```python\n" * 9000,
    "empty": "",
}


def test_every_built_in_reward_is_covered_and_declares_its_bounds():
    assert BUILT_IN == sorted(GROUND_TRUTHS)
    assert all(reward_bounds(name) is not None for name in BUILT_IN)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attacks_neither_raise_nor_hang_nor_pay(attack):
    completion = ATTACKS[attack]
    assert len(completion) <= 100_000 and NAME not in completion
    for name in BUILT_IN:
        values = [score(name, completion, truth) for truth in GROUND_TRUTHS[name]]
        if name in ("tool_correctness", "toolrl_correctness"):
            assert values == [-3.0] * len(values), f"{name} paid {values} for {attack}"
        if name in ("math_correctness", "multi_turn_state", "multi_turn_accuracy"):
            assert values == [0.0]


@pytest.mark.parametrize("arguments", [
    '{"city": NaN, "days": Infinity}',
    '{"city": -Infinity, "days": 1e999}',
    '{"city": "Rome", "days": 1' + "0" * 400 + "}",  # an integer past any float, for a float parameter
    '{"city": ' + "[" * 900 + "]" * 900 + ', "days": [[[3]]]}',
    '{"city": "\ud800", "days": "\x00"}',
])
def test_junk_values_score_no_more_than_wrong_ones(arguments):
    honest = call('{"city": "Rome", "days": 4}')
    for name, truth in [("tool_correctness", TOOL), ("tool_correctness", TOOL_BFCL), ("toolrl_correctness", TOOLRL)]:
        assert score(name, call(arguments), truth) <= score(name, honest, truth) < 3.0


# Pieces of the generated completions: tags of every reward, JSON and LaTeX syntax, numbers
# JSON and LaTeX cannot hold, and characters that confuse text handling.
FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>", "<answer>", "</answer>",
    "\n", "{", "}", "[", "]", '"', ":", ",", '"name"', '"arguments"', '"parameters"', '"f"', "NaN", "Infinity",
    "-Infinity", "1e999", "-0", "1" + "0" * 5000, "null", "true", "\\boxed{", "\\frac{", "^{9", "\\sqrt{", "!",
    "\\left(", "\\right)", "$", "\\$", "\\\\", "```python\n", "```", "\x00", "\x1b[2J", "\r", "\u2028", "\ufeff",
    "\u200b", "\u202e", "\ud800", "\udfff", "\uff1cthink\uff1e", "\U0001f600",
]
_repeated = st.tuples(st.sampled_from(FRAGMENTS), st.integers(1, 25_000)).map(lambda t: t[0] * t[1])
_nested = st.tuples(st.sampled_from(["[", "{\"a\": ", "\\frac{1}{", "\\sqrt{", "(", "^{9", "\\boxed{"]),
                    st.integers(100, 20_000)).map(lambda t: t[0] * t[1])
_piece = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=30), _repeated, _nested)
_garbage = st.lists(_piece, max_size=6).map("".join)
_WRAPPERS = [("", ""), ("<think> t </think>\n<tool_call>\n", "\n</tool_call>"), ("\\boxed{", "}"),
             ("<answer>", "</answer>"), ("<think> t </think>\n<tool_call>\n{\"name\": \"f\", \"arguments\": ", "}")]
completions = st.tuples(st.sampled_from(_WRAPPERS), _garbage).map(lambda t: (t[0][0] + t[1] + t[0][1])[:100_000])


@settings(derandomize=True, database=None, max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(completion=completions, num_tokens=st.integers(0, 10**6))
def test_generated_completions_neither_raise_nor_hang_nor_pay(completion, num_tokens):
    for name in BUILT_IN:
        for truth in GROUND_TRUTHS[name]:
            value = score(name, completion, truth, num_tokens)
            if name in ("tool_correctness", "toolrl_correctness"):
                assert value == -3.0, f"{name} paid {value} for {completion[:200]!r}"
            if name in ("multi_turn_state", "multi_turn_accuracy"):
                assert value == 0.0, f"{name} paid {value} for {completion[:200]!r}"
