"""BFCL single-turn categories as tool-calling prompts, and the accuracy evaluation."""
import json
from collections import Counter

import pytest

from gdpo_megatron.data import BFCL_CATEGORIES, bfcl_accuracy, load_bfcl
from gdpo_megatron.data.bfcl import bfcl_data_dir

FILES = {  # category -> file stem
    "simple": "simple_python", "multiple": "multiple", "parallel": "parallel", "parallel_multiple": "parallel_multiple",
}


@pytest.fixture(scope="module")
def samples():
    return load_bfcl()


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answer(sample, pick):
    """A completion calling what BFCL's possible answer lists, choosing values with ``pick``."""
    calls = []
    for call in sample.ground_truth["tool_calls"]:
        arguments = {}
        for name, alternatives in call["accepted"].items():
            value = pick([a for a in alternatives if a != ""], "" in alternatives)
            if value is not None:
                arguments[name] = value
        calls.append({"name": call["name"], "arguments": arguments})
    return f"<think>calling</think>\n<tool_call>\n{json.dumps(calls)}\n</tool_call>"


def first_value(values, optional):
    if not values:  # the only listed answer is "omit it"
        return None
    value = values[0]
    if isinstance(value, dict):  # nested alternatives: one value per key
        return {k: v[0] for k, v in value.items() if v[0] != ""}
    return value


def last_value_or_omit(values, optional):
    return None if optional else first_value(values[::-1], optional)


def test_every_question_of_the_four_categories_is_loaded(samples):
    data = bfcl_data_dir()
    counts = Counter(s.metadata["category"] for s in samples)
    for category, stem in FILES.items():
        (questions,) = [p for p in data.glob("BFCL_v*.json") if p.name.split("_", 2)[2] == f"{stem}.json"]
        assert counts[category] == len(lines(questions))
        assert all(s.id.startswith(f"{stem}_") for s in samples if s.metadata["category"] == category)
    assert len({s.id for s in samples}) == len(samples)


def test_a_sample_holds_the_question_the_functions_and_the_possible_answer(samples):
    data = bfcl_data_dir()
    (questions,) = [p for p in data.glob("BFCL_v*.json") if p.name.split("_", 2)[2] == "simple_python.json"]
    question = lines(questions)[0]
    possible = lines(data / "possible_answer" / questions.name)[0]
    sample = next(s for s in samples if s.id == question["id"])
    (name, accepted), = possible["ground_truth"][0].items()
    assert sample.ground_truth["tool_calls"] == [{"name": name, "accepted": accepted}]
    assert sample.ground_truth["tools"] == question["function"]
    assert sample.messages[1:] == question["question"][0]
    assert json.dumps(question["function"][0]) in sample.messages[0]["content"]


def test_listed_answers_score_full_accuracy(samples):
    for pick in (first_value, last_value_or_omit):
        accuracy = bfcl_accuracy(samples, [answer(s, pick) for s in samples])
        assert accuracy == {f"eval/bfcl/{c}/accuracy": 1.0 for c in (*BFCL_CATEGORIES, "overall")}


def test_accuracy_per_category_counts_exact_matches_only(samples):
    completions, wrong = [], Counter()
    for n, sample in enumerate(samples):
        text = answer(sample, first_value)
        if n % 3 == 0:  # break every third: drop its last call
            calls = json.loads(text.split("<tool_call>\n")[1].split("\n</tool_call>")[0])[:-1]
            text = f"<think>x</think>\n<tool_call>\n{json.dumps(calls)}\n</tool_call>"
            wrong[sample.metadata["category"]] += 1
        completions.append(text)
    accuracy = bfcl_accuracy(samples, completions)
    totals = Counter(s.metadata["category"] for s in samples)
    for category, total in totals.items():
        assert accuracy[f"eval/bfcl/{category}/accuracy"] == pytest.approx(1 - wrong[category] / total)
    assert accuracy["eval/bfcl/overall/accuracy"] == pytest.approx(1 - sum(wrong.values()) / len(samples))


def test_limit_and_bad_category():
    few = load_bfcl(["parallel"], limit=3)
    assert [s.id for s in few] == ["parallel_0", "parallel_1", "parallel_2"]
    with pytest.raises(ValueError, match="BFCL category"):
        load_bfcl(["live_simple"])
    with pytest.raises(ValueError, match="2 samples but 1 completions"):
        bfcl_accuracy(few[:2], ["x"])
