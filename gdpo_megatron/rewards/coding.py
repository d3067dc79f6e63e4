"""Code rewards, from running the completion's program in the sandbox against test cases.

``code_pass``: fraction of the test cases passed, in [0, 1].
``code_no_bug``: 1 when the program ran without a compile or runtime error (timeouts and
runaway output included) on every test case, 0 otherwise; higher is better. A wrong answer
is not a bug.

The program is the last fenced code block (```python ... ``` or ``` ... ```) of the
completion. Ground truth: ``{"tests": [...]}`` where a test is either
``{"input": stdin, "output": expected stdout}`` (compared as verl's ``prime_code`` harness,
which Eurus-2-RL is scored with, compares them: see :func:`same_output`) or
``{"assert": code}``: test code that calls the program's functions (e.g.
``assert add(1, 2) == 3``, or HumanEval's ``def check(candidate): ...`` followed by
``check(add)``). An assert test runs in a process of its own that receives the program's
return values as plain data of its own types, or as handles to the program's objects that
equal nothing but themselves (see :mod:`gdpo_megatron.rewards.judge`), so nothing the program
does (exiting early, patching builtins, objects equal to everything) can pass it; the
program runs as module ``solution``, so its ``if __name__ == "__main__":`` block does not
run, as in HumanEval's harness. A failed assertion of the test is a wrong answer; the
program raising, dying or timing out is a bug.
The sandbox limits come from the reward's ``limits`` kwarg (see ``SandboxLimits``); going past
one is the program's bug. A failure of the sandbox itself raises, and so does a program the
sandbox killed for what it may not do (:class:`ProgramRefused`), so the reward stage counts them
in the reward's failure metrics with the reason, never as a score. Both rewards register with
``runs_code``: a config using them needs the strong sandbox or ``rewards.allow_weaker_sandbox``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from fractions import Fraction
from pathlib import Path

from gdpo_megatron.rewards import judge
from gdpo_megatron.rewards.registry import register_reward
from gdpo_megatron.rewards.sandbox import RunResult, SandboxLimits, run_python, start_python

_FENCED = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_JUDGE_SOURCE = Path(judge.__file__).read_text(encoding="utf-8")


class ProgramRefused(RuntimeError):
    """The sandbox killed the program for something it may not do (e.g. a system call of another
    architecture): a failure of the reward call, with the reason, not a score."""


def extract_program(completion: str) -> str | None:
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else None


def _check_kwargs(limits: dict | None = None) -> None:
    """``limits``: fields of :class:`SandboxLimits`."""
    if limits is None:
        return
    if not isinstance(limits, dict):
        raise ValueError(f"limits: expected a mapping of sandbox limits, got {limits!r}")
    fields = [f.name for f in dataclasses.fields(SandboxLimits)]
    unknown = sorted(set(limits) - set(fields))
    if unknown:
        raise ValueError(f"limits: unknown key {unknown[0]!r} (expected some of: {', '.join(fields)})")
    try:
        SandboxLimits(**limits)
    except TypeError as e:  # a value of the wrong type
        raise ValueError(f"limits: {e}") from None


@register_reward("code_pass", bounds=(0.0, 1.0), check=_check_kwargs, runs_code=True)
def code_pass(completion: str, num_tokens: int, ground_truth: dict, limits: dict | None = None) -> float:
    outcomes = _outcomes(completion, ground_truth, limits)
    return sum(passed for passed, _ in outcomes) / len(outcomes) if outcomes else 0.0


@register_reward("code_no_bug", bounds=(0.0, 1.0), check=_check_kwargs, runs_code=True)
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
    try:
        program.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: no source file can hold it, so it is a compile error
        return tuple((False, False) for _ in tests)
    return _run_tests(program, json.dumps(tests, sort_keys=True), SandboxLimits(**(limits or {})))


@functools.lru_cache(maxsize=256)  # code_pass and code_no_bug of one rollout share the runs
def _run_tests(program: str, tests_json: str, limits: SandboxLimits) -> tuple[tuple[bool, bool], ...]:
    outcomes = []
    for i, test in enumerate(json.loads(tests_json)):
        if isinstance(test, dict) and "assert" in test:
            verdict = run_assert_test(program, test["assert"], limits)
            outcomes.append((verdict == "passed", verdict != "error"))
        elif isinstance(test, dict) and "input" in test and "output" in test:
            result = _not_refused(run_python(program, test["input"], limits))
            outcomes.append((result.ok and same_output(result.stdout, test["output"]), result.ok))
        else:
            raise ValueError(f"ground_truth: tests[{i}] must have 'input' and 'output', or 'assert'; got {test!r}")
    return tuple(outcomes)


def run_assert_test(program: str, test: str, limits: SandboxLimits) -> str:
    """``"passed"``, ``"failed"`` (an assertion of the test failed) or ``"error"`` (the
    program raised, died or ran out of a limit), decided by the judge process."""
    requests_r, requests_w = os.pipe()
    responses_r, responses_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    deadline = time.monotonic() + limits.wall_s
    try:
        # The judge runs as the caller's second sandbox user: the program cannot read its test,
        # signal it or take its processes even at the basic level (as root).
        judging = start_python({"main.py": _judge_main(f"judge({requests_w}, {responses_r}, {verdict_w})"),
                                "test.py": test}, "", limits, pass_fds=(requests_w, responses_r, verdict_w), user=1)
        try:
            serving = start_python({"main.py": _judge_main(f"serve({requests_r}, {responses_w})"),
                                    "solution.py": program}, "", limits, pass_fds=(requests_r, responses_w))
        except BaseException:
            judging.finish(time.monotonic())
            raise
        for fd in (requests_r, requests_w, responses_r, responses_w, verdict_w):
            os.close(fd)
        requests_r = requests_w = responses_r = responses_w = verdict_w = None
        try:
            judged = judging.finish(deadline)
        finally:
            served = serving.finish(time.monotonic())  # the judge is done: the program has no more calls to serve
        _not_refused(served)
        _not_refused(judged)
        with os.fdopen(verdict_r, "rb") as f:
            verdict_r, text = None, f.read()
    finally:
        for fd in (requests_r, requests_w, responses_r, responses_w, verdict_r, verdict_w):
            if fd is not None:
                os.close(fd)
    try:
        return json.loads(text)["verdict"]
    except (ValueError, KeyError, TypeError):
        return "error"  # the judge was stopped at the wall limit: the program kept it waiting


def _judge_main(call: str) -> str:
    """``main.py`` of an assert test's process: :mod:`judge` and a call of its entry point, which
    a worker process the program spawns (importing ``__main__`` again) does not make."""
    return f"{_JUDGE_SOURCE}\nif __name__ == '__main__':\n    {call}\n"


def _not_refused(result: RunResult) -> RunResult:
    if result.refused:
        raise ProgramRefused(result.refused)
    return result


def same_output(output: str, expected: str) -> bool:
    """Whether a program's standard output answers as ``expected`` does, by the rules of verl's
    ``prime_code`` harness: the non-blank lines, stripped, are equal; or there are as many, every
    one of them is a single number, they are not all digit strings, and each is within
    ``1e-8 + 1e-5 * |expected|`` of the expected one (``numpy.allclose``). Stricter than it in
    one place: an expected integer takes only a number that rounds to it (the relative
    tolerance alone would take ``1234560.0`` for ``1234567``)."""
    got, want = _answer_lines(output), _answer_lines(expected)
    if got == want:
        return True
    if len(got) != len(want) or all(a.isdigit() and b.isdigit() for a, b in zip(got, want)):
        return False
    try:
        return all(_close(a, b) for a, b in zip(got, want))
    except ValueError:  # a line that is not one number
        return False


def _answer_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _close(got: str, expected: str) -> bool:
    x, y = float(got), float(expected)
    if not (x == y or abs(x - y) <= 1e-8 + 1e-5 * abs(y)):
        return False
    if re.fullmatch(r"[+-]?[0-9]+", expected) is None:
        return True
    return math.isfinite(x) and abs(Fraction(got) - int(expected)) < Fraction(1, 2)
