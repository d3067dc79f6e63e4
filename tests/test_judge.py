"""What a program can make the judge of an assert test say: only what its return values earn.

Each case pairs a wrong program that tries to pass with the honest program for the same
test, so that a test here cannot pass by the judge failing everything.
"""
import pytest

from gdpo_megatron.rewards import sandbox
from gdpo_megatron.rewards.coding import code_no_bug, code_pass

LIMITS = {"wall_s": 20.0, "cpu_s": 3}


def score(code, test):
    text, truth = f"```python\n{code}\n```", {"tests": [{"assert": test}]}
    return code_pass(text, 0, truth, limits=LIMITS), code_no_bug(text, 0, truth, limits=LIMITS)


DOUBLE = "def double(x):\n    return 2 * x\n"
WRONG_DOUBLE = "def double(x):\n    return 0\n"

# (the test, the wrong program's extra definitions): each definition shadows a builtin the test calls.
SHADOWED_BUILTINS = {
    "range": ("for i in range(10):\n    assert double(i) == 2 * i\n",
              "def range(*args):\n    return []\n"),
    "abs": ("assert abs(double(1.25) - 2.5) < 1e-9\n",
            "def abs(x):\n    return 0\n"),
    "sorted": ("assert sorted([double(3), double(1)]) == sorted([2, 6])\n",
               "def sorted(*args, **kwargs):\n    return 0\n"),
}


@pytest.mark.parametrize("name", list(SHADOWED_BUILTINS))
def test_program_functions_named_like_builtins_do_not_replace_the_tests_builtins(name):
    test, shadow = SHADOWED_BUILTINS[name]
    assert score(DOUBLE, test) == (1.0, 1.0)
    assert score(WRONG_DOUBLE + shadow, test) == (0.0, 1.0)  # a wrong answer


# The program raises StopIteration from a call the test makes inside an iterator (map): the
# test's loop must not read it as the end of its cases.
STOP_ITERATION_TESTS = {
    "for over zip(map(...))": "for got, want in zip(map(double, [1, 2, 3]), [2, 4, 6]):\n    assert got == want\n",
    "all(map(...))": "assert all(map(lambda x: double(x) == 2 * x, [1, 2, 3]))\n",
    "next(map(...), default)": "assert next(map(double, [5]), 10) == 10\n",
}


@pytest.mark.parametrize("test", list(STOP_ITERATION_TESTS.values()), ids=list(STOP_ITERATION_TESTS))
def test_stop_iteration_raised_by_the_program_is_its_error(test):
    assert score(DOUBLE, test) == (1.0, 1.0)
    assert score("def double(x):\n    raise StopIteration\n", test) == (0.0, 0.0)


def test_integers_of_any_size_reach_the_test_and_the_program():
    """Python's ints have no size limit; its int <-> decimal text conversion has (4300 digits)."""
    power = "def power(n):\n    return 2 ** n\n"
    assert score(power, "assert power(20000) == 2 ** 20000\n") == (1.0, 1.0)
    assert score(power + "def half(n):\n    return n // 2\n",
                 "assert half(-(2 ** 20000)) == -(2 ** 19999)\n") == (1.0, 1.0)
    assert score("def power(n):\n    return 2 ** n + 1\n", "assert power(20000) == 2 ** 20000\n") == (0.0, 1.0)


@pytest.mark.skipif(not sandbox.isolation().guarantees["processes_counted_per_run"],
                    reason="the processes limit counts all processes of the user here")
def test_the_judge_does_not_take_processes_from_the_program():
    """The same program, allowed 4 processes, starts one process as a script and under test."""
    code = ("import os\ndef five():\n    pid = os.fork()\n    if pid == 0:\n        os._exit(5)\n"
            "    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n")
    limits = {**LIMITS, "processes": 4}
    truth = {"tests": [{"input": "", "output": "5"}]}
    assert code_pass(f"```python\n{code}print(five())\n```", 0, truth, limits=limits) == 1.0
    text = f"```python\n{code}```"
    truth = {"tests": [{"assert": "assert five() == 5"}]}
    assert (code_pass(text, 0, truth, limits=limits), code_no_bug(text, 0, truth, limits=limits)) == (1.0, 1.0)



@pytest.fixture(params=["default", "basic"])
def level(request, monkeypatch, tmp_path):
    """The sandbox level runs choose: the default one here, and basic as on a host without
    bubblewrap (none on PATH)."""
    if request.param == "basic":
        monkeypatch.setenv("PATH", str(tmp_path))
    sandbox.isolation.cache_clear()
    sandbox.default_setup.cache_clear()
    yield sandbox.isolation()
    sandbox.isolation.cache_clear()  # probed again with the PATH restored
    sandbox.default_setup.cache_clear()


# Looks for the judge's test among the working directories of every process it may read, and
# returns the value the test expects.
READS_THE_TEST = r"""
import os, re

def double(x):
    for pid in os.listdir('/proc'):
        try:
            found = re.search(r'== (\d+)', open(f'/proc/{pid}/cwd/test.py').read())
        except OSError:
            continue
        if found:
            return int(found.group(1))
    return 0
"""


def test_assert_tests_at_every_level(level):
    test = "assert double(21) == 42\n"
    assert score(DOUBLE, test) == (1.0, 1.0)
    assert score(WRONG_DOUBLE, test) == (0.0, 1.0)
    if level.guarantees["runs_separated"]:
        assert score(READS_THE_TEST, test) == (0.0, 1.0)
