"""Code rewards, from running the completion's program in the sandbox against test cases.

``code_pass``: fraction of the test cases passed, in [0, 1].
``code_no_bug``: 1 when the program ran without a compile or runtime error (timeouts and
runaway output included) on every test case, 0 otherwise; higher is better. A wrong answer
is not a bug.

The program is the last fenced code block (```python ... ``` or ``` ... ```) of the
completion. Ground truth: ``{"tests": [...]}`` where a test is either
``{"input": stdin, "output": expected stdout}`` (compared line by line, trailing whitespace
ignored) or ``{"assert": code}`` (run after the program; passes if no assertion fails).
The sandbox limits come from the reward's ``limits`` kwarg (see ``SandboxLimits``).
"""
from __future__ import annotations

import functools
import json
import re

from gdpo_megatron.rewards.registry import register_reward
from gdpo_megatron.rewards.sandbox import SandboxLimits, run_python

_FENCED = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_ASSERT_FAILED = 86  # exit status of an assert test that failed (the program itself ran fine)


def extract_program(completion: str) -> str | None:
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else None


@register_reward("code_pass")
def code_pass(completion: str, num_tokens: int, ground_truth: dict, limits: dict | None = None) -> float:
    outcomes = _outcomes(completion, ground_truth, limits)
    return sum(passed for passed, _ in outcomes) / len(outcomes) if outcomes else 0.0


@register_reward("code_no_bug")
def code_no_bug(completion: str, num_tokens: int, ground_truth: dict, limits: dict | None = None) -> float:
    outcomes = _outcomes(completion, ground_truth, limits)
    return 1.0 if outcomes and all(ran for _, ran in outcomes) else 0.0


def _outcomes(completion: str, ground_truth: dict, limits: dict | None) -> tuple[tuple[bool, bool], ...]:
    """(passed, ran without error) per test; empty when there is no program."""
    tests = ground_truth.get("tests") if isinstance(ground_truth, dict) else None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"ground_truth: expected a non-empty 'tests' list, got {ground_truth!r}")
    program = extract_program(completion)
    if program is None:
        return ()
    return _run_tests(program, json.dumps(tests, sort_keys=True), SandboxLimits(**(limits or {})))


@functools.lru_cache(maxsize=256)  # code_pass and code_no_bug of one rollout share the runs
def _run_tests(program: str, tests_json: str, limits: SandboxLimits) -> tuple[tuple[bool, bool], ...]:
    outcomes = []
    for i, test in enumerate(json.loads(tests_json)):
        if isinstance(test, dict) and "assert" in test:
            result = run_python(_with_assert(program, test["assert"]), "", limits)
            failed_assert = result.returncode == _ASSERT_FAILED
            outcomes.append((result.ok, result.ok or failed_assert))
        elif isinstance(test, dict) and "input" in test and "output" in test:
            result = run_python(program, test["input"], limits)
            outcomes.append((result.ok and _lines(result.stdout) == _lines(test["output"]), result.ok))
        else:
            raise ValueError(f"ground_truth: tests[{i}] must have 'input' and 'output', or 'assert'; got {test!r}")
    return tuple(outcomes)


def _with_assert(program: str, test: str) -> str:
    """The program followed by the test; an assertion of the test itself that fails (the
    innermost frame is the test's) exits with _ASSERT_FAILED, any other error propagates."""
    return (
        f"{program}\n\n"
        "try:\n"
        f"    exec(compile({test!r}, '<test>', 'exec'), globals())\n"
        "except AssertionError as __gdpo_error:\n"
        "    __gdpo_tb = __gdpo_error.__traceback__\n"
        "    while __gdpo_tb.tb_next is not None:\n"
        "        __gdpo_tb = __gdpo_tb.tb_next\n"
        "    if __gdpo_tb.tb_frame.f_code.co_filename != '<test>':\n"
        "        raise\n"
        f"    raise SystemExit({_ASSERT_FAILED})\n"
    )


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]
