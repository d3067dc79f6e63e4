"""BFCL single-turn categories as tool-calling prompts, and the accuracy evaluation."""
import json
from collections import Counter

import bfcl_reference
import pytest

from gdpo_megatron.data import BFCL_CATEGORIES, bfcl_accuracy, load_bfcl
from gdpo_megatron.data.bfcl import bfcl_data_dir

FILES = {  # category -> file stem
    "simple": "simple_python", "multiple": "multiple", "parallel": "parallel", "parallel_multiple": "parallel_multiple",
    "live_simple": "live_simple", "live_multiple": "live_multiple", "live_parallel": "live_parallel",
    "live_parallel_multiple": "live_parallel_multiple",
}
# Questions whose own first listed answer BFCL's checker rejects: the possible answer lists an
# argument the schema does not declare, or leaves out (or marks optional) one it requires.
CONTRADICTIONS = {"parallel_multiple_12", "parallel_multiple_26", "live_simple_106-63-0", "live_simple_112-68-0",
                  "live_multiple_507-149-4", "live_multiple_862-181-3", "live_multiple_964-207-0"}


@pytest.fixture(scope="module")
def samples():
    return load_bfcl()


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answer(sample, pick=bfcl_reference.pick_first):
    """A completion calling what BFCL's possible answer lists, choosing values with ``pick``."""
    return bfcl_reference.completion(bfcl_reference.listed_calls(sample, pick))


def test_every_question_of_the_single_turn_categories_is_loaded(samples):
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


def test_listed_answers_are_exact_except_where_bfcl_contradicts_itself(samples):
    checker = bfcl_reference.load_ast_checker()
    rejected = {s.id for s in samples if not bfcl_reference.bfcl_valid(checker, s, bfcl_reference.listed_calls(s))}
    assert rejected == CONTRADICTIONS
    accuracy = bfcl_accuracy(samples, [answer(s) for s in samples])
    totals, wrong = Counter(s.metadata["category"] for s in samples), Counter(
        s.metadata["category"] for s in samples if s.id in CONTRADICTIONS)
    for category in BFCL_CATEGORIES:
        assert accuracy[f"eval/bfcl/{category}/accuracy"] == pytest.approx(1 - wrong[category] / totals[category])
    assert len(samples) == 2351


def test_accuracy_per_category_counts_exact_matches_only(samples):
    samples = [s for s in samples if s.id not in CONTRADICTIONS]
    completions, wrong = [], Counter()
    for n, sample in enumerate(samples):
        calls = bfcl_reference.listed_calls(sample)
        if n % 3 == 0:  # break every third: drop its last call
            calls = calls[:-1]
            wrong[sample.metadata["category"]] += 1
        completions.append(bfcl_reference.completion(calls))
    accuracy = bfcl_accuracy(samples, completions)
    totals = Counter(s.metadata["category"] for s in samples)
    for category, total in totals.items():
        assert accuracy[f"eval/bfcl/{category}/accuracy"] == pytest.approx(1 - wrong[category] / total)
    assert accuracy["eval/bfcl/overall/accuracy"] == pytest.approx(1 - sum(wrong.values()) / len(samples))


def test_limit_and_bad_category():
    few = load_bfcl(["parallel"], limit=3)
    assert [s.id for s in few] == ["parallel_0", "parallel_1", "parallel_2"]
    with pytest.raises(ValueError, match="BFCL category"):
        load_bfcl(["live_irrelevance"])
    with pytest.raises(ValueError, match="2 samples but 1 completions"):
        bfcl_accuracy(few[:2], ["x"])
