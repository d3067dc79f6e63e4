"""APPS / TACO / Eurus-2-RL test cases judged as the published harness judges them.

The reference is APPS's eval/testing_util.py (hendrycks/apps), TACO's metrics/testing_util.py
(FlagOpen/TACO) and verl's prime_code/testing_util.py (Eurus-2-RL): each passes the decoded
inputs to ``fn_name`` and compares the return value with the output as it stands in the data
(APPS, TACO) or with the output's JSON text decoded (Eurus-2-RL, whose inputs are JSON text
too); all three give integer keys to a dict argument or output whose keys all read as
integers (JSON cannot hold them). Values below follow those rules; the programs are this
file's own.
"""
import json

import numpy as np
import pytest

from gdpo_megatron.tasks.code_tests import tests_from_input_output as cases_from_input_output
from gdpo_megatron.rewards.coding import code_pass


def program(code: str) -> str:
    return f"<think> Plan. </think>\n```python\n{code}\n```"


def score(spec: dict, code: str) -> float:
    return code_pass(program(code), 0, {"tests": cases_from_input_output(json.dumps(spec))})


@pytest.mark.parametrize("code,expected", [
    ("def label(s):\n    return {'a': '1', 'b': 'null'}[s]", 1.0),  # returns the strings the data holds
    ("def label(s):\n    return {'a': 1, 'b': None}[s]", 0.0),  # what the strings would decode to
])
def test_apps_string_outputs_are_compared_as_strings(code, expected):
    # APPS / TACO inputs are argument lists and outputs plain values: "1" is the string "1".
    spec = {"fn_name": "label", "inputs": [["a"], ["b"]], "outputs": ["1", "null"]}
    assert score(spec, code) == expected


def test_eurus_outputs_are_json_text():
    spec = {"fn_name": "label", "inputs": ['"a"', '"b"'], "outputs": ["1", "null"]}
    assert score(spec, "def label(s):\n    return {'a': 1, 'b': None}[s]") == 1.0
    assert score(spec, "def label(s):\n    return {'a': '1', 'b': 'null'}[s]") == 0.0


@pytest.mark.parametrize("spec", [
    {"fn_name": "totals", "inputs": [[{"1": 10, "2": 20}]], "outputs": [{"3": 30}]},  # APPS / TACO
    {"fn_name": "totals", "inputs": [[{"1": 10, "2": 20}]], "outputs": [[{"3": 30}]]},
    {"fn_name": "totals", "inputs": ['{"1": 10, "2": 20}'], "outputs": ['{"3": 30}']},  # Eurus-2-RL
])
def test_dicts_with_integer_keys_reach_the_program_and_the_comparison_as_integers(spec):
    honest = "def totals(d):\n    return {sum(d): sum(d.values())}"
    assert score(spec, honest) == 1.0
    assert score(spec, "def totals(d):\n    return {'3': 30}") == 0.0


def test_dicts_with_other_keys_keep_them():
    spec = {"fn_name": "first", "inputs": [[{"a": 1, "2": 2}]], "outputs": [["a"]]}
    assert score(spec, "def first(d):\n    return min(d, key=str)") == 0.0  # '2' < 'a'
    assert score(spec, "def first(d):\n    return max(d)") == 1.0


# Standard input / output: verl's prime_code/testing_util.py (the harness Eurus-2-RL's code rows
# are scored with) passes a program whose output, line by line with surrounding whitespace and
# blank lines dropped, equals the expected one, or, when every one of those lines on both sides
# is a single number and they are not all digit strings, is close to it (numpy.allclose,
# rtol 1e-5, atol 1e-8). One rule is stricter here: an expected integer takes only a number
# that rounds to it (PRIME's relative tolerance takes 1234560.0 for 1234567).
STDOUT_CASES = [
    # (the program's output, the expected output, PRIME passes it, code_pass passes it)
    ("3\n", "3\n", True, True),
    ("1\n  2  \n", "1\n2", True, True),  # whitespace around a line
    ("1\n\n2\n\n", "1\n2", True, True),  # blank lines
    ("1 2\n", "1  2", False, False),  # whitespace inside a line is compared
    ("4\n5\n", "4\n6", False, False),
    ("007\n", "7", False, False),  # all digit strings: compared as text
    ("0.3333333\n", "0.333333333", True, True),
    ("0.3333\n", "0.333333333", False, False),
    ("2.0\n", "2", True, True),
    ("1.0 2.0\n", "1 2", False, False),  # a line of two numbers is not a number
    ("YES\n0.3333333\n", "YES\n0.333333333", False, False),  # not every line a number
    ("1234566.9\n", "1234567", True, True),
    ("1234560.0\n", "1234567", True, False),  # an approximate integer answer
    ("1e18\n", "1000000000000000007", True, False),
]


def prime_passes(output, expected):
    """PRIME's verdict as its rules above state it, with numpy as its numeric comparison."""
    got, want = ([line.strip() for line in text.splitlines() if line.strip()] for text in (output, expected))
    if got == want:
        return True
    if len(got) != len(want) or all(a.isdigit() and b.isdigit() for a, b in zip(got, want)):
        return False
    try:
        return bool(np.allclose([float(a) for a in got], [float(b) for b in want]))
    except ValueError:  # a line that is not one number
        return False


@pytest.mark.parametrize("output,expected,prime,ours", STDOUT_CASES)
def test_standard_output_is_compared_as_prime_compares_it(output, expected, prime, ours):
    assert prime_passes(output, expected) == prime
    program = f"```python\nimport sys\nsys.stdout.write({output!r})\n```"
    assert code_pass(program, 0, {"tests": [{"input": "", "output": expected}]}) == float(ours)
