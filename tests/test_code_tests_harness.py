"""Call-based APPS / TACO / Eurus-2-RL test cases judged as the published harness judges them.

The reference is APPS's eval/testing_util.py (hendrycks/apps), TACO's metrics/testing_util.py
(FlagOpen/TACO) and verl's prime_code/testing_util.py (Eurus-2-RL): each passes the decoded
inputs to ``fn_name`` and compares the return value with the output as it stands in the data
(APPS, TACO) or with the output's JSON text decoded (Eurus-2-RL, whose inputs are JSON text
too); all three give integer keys to a dict argument or output whose keys all read as
integers (JSON cannot hold them). Values below follow those rules; the programs are this
file's own.
"""
import json

import pytest

from gdpo_megatron.data.code_tests import tests_from_input_output as cases_from_input_output
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
