"""Tool-calling rewards against hand-computed ToolRL scores."""
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bfcl_reference
from gdpo_megatron.rewards.tool_call import best_assignment, parse_tool_calls, tool_correctness, tool_format


def completion(calls, think="I should call a tool."):
    return f"<think>{think}</think>\n<tool_call>\n{json.dumps(calls)}\n</tool_call>"


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def scaled(score, best):
    """ToolRL's scaling of a matching score S to [-3, 3]: 6 * S / S_max - 3."""
    return 6 * score / best - 3


WEATHER = {"tool_calls": [call("get_weather", city="Paris", unit="celsius")]}  # S_max = 1 + 1 + 2 = 4
CURRENCY = {"tool_calls": [  # S_max = 1 + 2 + 3 + 3 = 9
    call("convert", amount=100, to="EUR", src="USD"),
    call("convert", amount=100, to="JPY", src="USD"),
]}
NO_CALL = {"tool_calls": []}

CORRECTNESS_CASES = [
    # (ground truth, completion, expected, why)
    (WEATHER, completion([call("get_weather", city="Paris", unit="celsius")]), 3.0, "exact"),
    (WEATHER, completion([call("get_weather", unit="celsius", city="Paris")]), 3.0, "argument order is irrelevant"),
    (WEATHER, completion(call("get_weather", city="Paris", unit="celsius")), 3.0, "single object instead of a list"),
    (WEATHER, completion([call("get_weather", city="Paris", unit="kelvin")]), scaled(1 + 1 + 1, 4), "one wrong value"),
    (WEATHER, completion([call("get_weather", city="Paris")]), scaled(1 + 0.5 + 1, 4), "one missing argument"),
    (WEATHER, completion([call("get_weather", city="Paris", unit="celsius", days=3)]),
     scaled(1 + 2 / 3 + 2, 4), "one extra argument"),
    (WEATHER, completion([call("get_forecast", city="Paris", unit="celsius")]), -3.0, "wrong function name"),
    (WEATHER, completion([call("get_weather", city="Paris", unit="celsius"), call("get_weather", city="Rome")]),
     scaled(0.5 + 1 + 2, 4), "extra call halves the name Jaccard"),
    (WEATHER, "<think>no tools</think>\nIt is sunny.", -3.0, "call block missing"),
    (WEATHER, "<think>x</think>\n<tool_call>\n[{\"name\": \"get_weather\", </tool_call>", -3.0, "unparseable JSON"),
    (WEATHER, "<think>x</think>\n<tool_call>\n[{\"arguments\": {}}]\n</tool_call>", -3.0, "call without a name"),
    (CURRENCY, completion(list(reversed([c for c in CURRENCY["tool_calls"]]))), 3.0, "parallel calls in any order"),
    (CURRENCY, completion([call("convert", amount=100, to="EUR", src="USD")]),
     scaled(0.5 + (1 + 3) + 0, 9), "one of two parallel calls"),
    (CURRENCY, completion([call("convert", amount=100.0, to="JPY", src="USD"),
                           call("convert", amount=99, to="EUR", src="USD")]),
     scaled(1 + (1 + 3) + (1 + 2), 9), "partial match: ints equal floats, one wrong amount"),
    (NO_CALL, "<think>just chat</think>\nHere is a joke.", 0.0, "no call expected, none made"),
    (NO_CALL, completion([call("get_weather", city="Paris")]), -3.0, "no call expected, one made"),
]


@pytest.mark.parametrize("truth,text,expected,why", CORRECTNESS_CASES, ids=[c[3] for c in CORRECTNESS_CASES])
def test_tool_correctness(truth, text, expected, why):
    assert tool_correctness(text, 0, truth) == pytest.approx(expected, abs=1e-12)


def test_calls_are_matched_to_maximize_the_score():
    # Greedy matching in ground-truth order would pair f(x=1,y=2) with f(x=1,y=3) (one equal
    # value each way) and leave f(x=1,y=3) the worse f(x=7,y=7): S = 1 + 2 + 1. The optimal
    # matching pairs each call with its best partner overall: S = 1 + 1 + 3.
    truth = {"tool_calls": [call("f", x=1, y=2), call("f", x=1, y=3)]}  # S_max = 1 + 2 + 4 = 7
    text = completion([call("f", x=1, y=3), call("f", x=7, y=7)])
    assert tool_correctness(text, 0, truth) == pytest.approx(scaled(1 + (1 + 0) + (1 + 2), 7))
    reordered = {"tool_calls": truth["tool_calls"][::-1]}
    assert tool_correctness(text, 0, reordered) == tool_correctness(text, 0, truth)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.integers(1, 4).flatmap(lambda m: st.lists(
    st.lists(st.integers(0, 6).map(lambda x: x / 2), min_size=m, max_size=m), min_size=n, max_size=n))))
def test_best_assignment_equals_brute_force(scores):
    n, m = len(scores), len(scores[0])
    if n <= m:
        brute = max(sum(scores[i][cols[i]] for i in range(n)) for cols in itertools.permutations(range(m), n))
    else:
        brute = max(sum(scores[rows[j]][j] for j in range(m)) for rows in itertools.permutations(range(n), m))
    assert best_assignment(scores) == pytest.approx(brute)


def test_boolean_is_not_a_number():
    truth = {"tool_calls": [call("f", flag=1)]}  # S_max = 3
    assert tool_correctness(completion([call("f", flag=True)]), 0, truth) == pytest.approx(scaled(2, 3))


BERKELEY = {"tool_calls": [{"name": "find", "accepted": {  # S_max = 1 + 1 + 3 = 5
    "a": [1], "unit": ["units", ""], "city": ["New York", "NYC"]}}]}
NESTED = {"tool_calls": [{"name": "query", "accepted": {  # S_max = 1 + 1 + 1 = 3
    "conditions": [{"department": ["Science"], "school": ["Bluebird High School", "Bluebird HS"],
                    "year": ["", 2024]}]}}]}

BERKELEY_CASES = [
    (BERKELEY, [call("find", a=1, city="NYC")], False, 3.0, "optional argument omitted, second alternative"),
    (BERKELEY, [call("find", a=1, city="New York", unit="units")], False, 3.0, "optional argument given"),
    (BERKELEY, [call("find", a=1, city="NYC", unit="cm")], False, scaled(1 + 1 + 2, 5), "optional argument wrong"),
    (BERKELEY, [call("find", city="NYC")], False, scaled(1 + 2 / 3 + 2, 5), "required argument omitted"),
    (BERKELEY, [call("find", a=1, city="NYC", extra=5)], False, scaled(1 + 3 / 4 + 3, 5), "extra argument"),
    (BERKELEY, [call("find", a=1.0, city="new-york")], False, 3.0, "strings always normalized like BFCL"),
    (BERKELEY, [call("find", a=1, city="NYC", unit="")], False, scaled(1 + 1 + 2, 5), '"" is not a value'),
    (NESTED, [call("query", conditions={"department": "Science", "school": "Bluebird HS"})], False, 3.0, "nested"),
    (NESTED, [call("query", conditions={"department": "Science", "school": "Bluebird HS", "year": 2024})],
     False, 3.0, "nested optional key given"),
    (NESTED, [call("query", conditions={"department": "Math", "school": "Bluebird HS"})], False,
     scaled(1 + 1 + 0, 3), "nested value wrong"),
    (NESTED, [call("query", conditions={"department": "Science", "school": "Bluebird HS", "x": 1})], False,
     scaled(1 + 1 + 0, 3), "nested extra key"),
]


@pytest.mark.parametrize("truth,calls,normalize,expected,why", BERKELEY_CASES, ids=[c[4] for c in BERKELEY_CASES])
def test_tool_correctness_berkeley_alternatives(truth, calls, normalize, expected, why):
    assert tool_correctness(completion(calls), 0, truth, normalize_strings=normalize) == pytest.approx(expected)


def test_plain_ground_truth_values_are_not_read_as_alternatives():
    # A list or dict-of-lists value in the plain form is one value, not a list of choices.
    truth = {"tool_calls": [call("f", ids=[1, 2], spec={"k": [3]})]}
    assert tool_correctness(completion([call("f", ids=[1, 2], spec={"k": [3]})]), 0, truth) == 3.0
    assert tool_correctness(completion([call("f", ids=1, spec={"k": 3})]), 0, truth) == pytest.approx(scaled(2, 4))


FORMAT_CASES = [
    (WEATHER, completion([call("get_weather", city="Paris")]), 1.0, "think then call"),
    (WEATHER, "  " + completion([call("get_weather", city="Paris")]) + "\n", 1.0, "surrounding whitespace"),
    (WEATHER, f"<tool_call>\n{json.dumps([call('g')])}\n</tool_call>", 0.0, "no think block"),
    (WEATHER, completion([call("g")]) + "\nDone.", 0.0, "text after the call block"),
    (WEATHER, completion([call("g")]) + "\n<tool_call>[]</tool_call>", 0.0, "two call blocks"),
    (WEATHER, "<think>a</think><think>b</think>\n<tool_call>[]</tool_call>", 0.0, "two think blocks"),
    (WEATHER, "<think>x</think>\n<tool_call>\n{not json}\n</tool_call>", 0.0, "call block is not JSON"),
    (WEATHER, "<think>x</think>\n<tool_call>\n[1, 2]\n</tool_call>", 0.0, "JSON but not calls"),
    (WEATHER, "<think>x</think>\nThe weather is nice.", 0.0, "answer where a call is expected"),
    (NO_CALL, "<think>x</think>\nHere is a joke.", 1.0, "plain answer when none expected"),
    (NO_CALL, "<think>x</think>\n", 0.0, "empty answer"),
    (NO_CALL, completion([call("g")]), 0.0, "call when none expected"),
    (NO_CALL, "Here is a joke.", 0.0, "no think block, no call"),
]


@pytest.mark.parametrize("truth,text,expected,why", FORMAT_CASES, ids=[c[3] for c in FORMAT_CASES])
def test_tool_format(truth, text, expected, why):
    assert tool_format(text, 0, truth) == expected


def test_parse_tool_calls_reads_every_block():
    text = completion([call("a", x=1)]) + "\n" + f"<tool_call>{json.dumps(call('b'))}</tool_call>"
    assert parse_tool_calls(text) == [call("a", x=1), call("b")]
    assert parse_tool_calls("<think>no call</think>") is None


def test_bad_ground_truth_is_named():
    with pytest.raises(ValueError, match="tool_calls"):
        tool_correctness(completion([]), 0, {"calls": []})
    with pytest.raises(ValueError, match="'arguments' or 'accepted'"):
        tool_correctness(completion([]), 0, {"tool_calls": [{"name": "f"}]})


def test_plain_ground_truth_strings_normalize_like_bfcl_when_asked():
    truth = {"tool_calls": [call("say", text='He said "hi", bye')]}
    given = completion([call("say", text="he said 'HI' bye")])
    assert tool_correctness(given, 0, truth) < 3.0
    assert tool_correctness(given, 0, truth, normalize_strings=True) == 3.0


# ---- Against BFCL's own checker (bfcl-eval's ast_checker) on BFCL's data ----

@pytest.fixture(scope="module")
def bfcl():
    from gdpo_megatron.data.bfcl import load_bfcl

    return {s.id: s for s in load_bfcl()}, bfcl_reference.load_ast_checker()


def exact(sample, calls):
    return tool_correctness(bfcl_reference.completion(calls), 0, sample.ground_truth) == 3.0


def first_listed(sample_id):
    return lambda samples: bfcl_reference.listed_calls(samples[sample_id])


# (sample, calls, BFCL's verdict written out, why): each one the project decided differently before.
BFCL_RULES = [
    ("simple_python_2", [call("math.hypot", x=4, y=5, z="")], False, '"" in the answers means "may be omitted" only'),
    ("simple_python_2", [call("math.hypot", x=4, y=5)], True, "an optional argument omitted"),
    ("simple_python_0", [call("calculate_triangle_area", base=10.0, height=5)], False, "a float for an integer"),
    ("simple_python_13", [call("calculate_area_under_curve", function="x**2", interval=[1, 3])], False,
     "ints inside a float array (a nested type error stays one)"),
    ("simple_python_17", None, False, 'a required argument omitted although its answers list ""'),
    ("live_multiple_121-46-0", "first", True, "a plain dict inside a BFCL dict, and a list of dicts"),
    ("live_multiple_121-46-0", "dict list dropped", False, "a list of dicts one short"),
    ("parallel_multiple_12", "first", False, "an answer listing an argument the schema does not declare"),
]


@pytest.mark.parametrize("sample_id,calls,valid,why", BFCL_RULES, ids=[c[3] for c in BFCL_RULES])
def test_bfcl_rules(bfcl, sample_id, calls, valid, why):
    samples, checker = bfcl
    sample = samples[sample_id]
    if calls == "first":
        calls = bfcl_reference.listed_calls(sample)
    elif calls == "dict list dropped":
        calls = bfcl_reference.perturbations(sample)["lists of dicts: last dict dropped"]
    elif calls is None:
        calls = bfcl_reference.perturbations(sample)["optional arguments omitted"]
    assert bfcl_reference.bfcl_valid(checker, sample, calls) == valid
    assert exact(sample, calls) == valid


def test_quotes_are_normalized_like_bfcl(bfcl):
    samples, checker = bfcl
    sample = samples["simple_python_0"]
    sample = type(sample)(**{**sample.__dict__, "ground_truth": {**sample.ground_truth, "tool_calls": [
        {"name": "calculate_triangle_area", "accepted": {"base": [10], "height": [5], "unit": ['"square" units']}}]}})
    calls = [call("calculate_triangle_area", base=10, height=5, unit="'Square' units")]
    assert bfcl_reference.bfcl_valid(checker, sample, calls) and exact(sample, calls)


def test_exact_calls_agree_with_bfcl_on_every_seventh_question(bfcl):
    """The listed answers and edits of them (tests/bfcl_reference.py), every category."""
    samples, checker = bfcl
    disagreements, checked = [], 0
    for sample in list(samples.values())[::7]:
        for name, calls in bfcl_reference.perturbations(sample).items():
            checked += 1
            if exact(sample, calls) != bfcl_reference.bfcl_valid(checker, sample, calls):
                disagreements.append((sample.id, name))
    assert checked > 5000 and disagreements == []
