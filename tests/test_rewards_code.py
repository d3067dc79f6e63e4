"""Code rewards: pass fraction and the no-bug reward, from real sandboxed runs."""
import pytest

from gdpo_megatron.rewards.coding import code_no_bug, code_pass, extract_program

FAST = {"wall_s": 3.0, "cpu_s": 1}
ADD = {"tests": [
    {"input": "1 2\n", "output": "3\n"}, {"input": "-5 5\n", "output": "0"}, {"input": "7 8", "output": "15\n"},
]}
IS_EVEN = {"tests": [{"assert": "assert is_even(2)"}, {"assert": "assert not is_even(3)"},
                     {"assert": "assert is_even(0)"}, {"assert": "assert is_even(-4)"}]}


def program(code):
    return f"<think>plan</think>\nHere it is:\n```python\n{code}\n```"


CASES = [
    # (ground truth, completion, code_pass, code_no_bug, why)
    (ADD, program("a, b = map(int, input().split())\nprint(a + b)"), 1.0, 1.0, "all pass"),
    (ADD, program("a, b = map(int, input().split())\nprint(a + b if a > 0 else 1)"), 2 / 3, 1.0,
     "a wrong answer is not a bug"),
    (ADD, program("a, b = map(int, input().split())\nprint(a + b)\nif a == 7: raise RuntimeError"), 2 / 3, 0.0,
     "a crash on one test is a bug"),
    (ADD, program("a, b = map(int, input().split()\nprint(a + b)"), 0.0, 0.0, "syntax error"),
    ({"tests": ADD["tests"][:1]}, program("while True: pass"), 0.0, 0.0, "time limit"),
    (ADD, "print(3)", 0.0, 0.0, "no code block"),
    (IS_EVEN, program("def is_even(n):\n    return n % 2 == 0"), 1.0, 1.0, "assert tests pass"),
    (IS_EVEN, program("def is_even(n):\n    return n > 0 and n % 2 == 0"), 0.5, 1.0, "failed asserts are not bugs"),
    (IS_EVEN, program("def is_even(n):\n    assert n >= 0\n    return n % 2 == 0"), 0.75, 0.0,
     "the program's own assertion is a bug"),
    (IS_EVEN, program("def is_even(n):\n    return n / 0"), 0.0, 0.0, "runtime error"),
]


@pytest.mark.parametrize("truth,text,passed,no_bug,why", CASES, ids=[c[4] for c in CASES])
def test_code_rewards(truth, text, passed, no_bug, why):
    assert code_pass(text, 0, truth, limits=FAST) == pytest.approx(passed)
    assert code_no_bug(text, 0, truth, limits=FAST) == no_bug


def test_extract_program_takes_the_last_block():
    text = "```python\nprint(1)\n```\nbetter:\n```\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("no code") is None


def test_bad_tests_are_named():
    with pytest.raises(ValueError, match="tests"):
        code_pass(program("print(1)"), 0, {"tests": []})
    with pytest.raises(ValueError, match=r"tests\[0\]"):
        code_pass(program("print(1)"), 0, {"tests": [{"stdin": "1"}]})
