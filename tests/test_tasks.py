"""The task registry: each family's default rewards exist, and a family added as one entry is
read, instructed and left out by the same reader as the built-in ones."""
import json
import warnings

import pytest

from gdpo_megatron.config import ConfigError, RewardSpec
from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.rewards import validate_specs
from gdpo_megatron.tasks import TASKS, Task, UnusableGroundTruth, get_task, task_names


@pytest.mark.parametrize("name", task_names())
def test_each_family_is_registered_under_its_name_with_rewards_that_exist(name):
    task = get_task(name)
    assert task.name == name and task.ground_truth_keys and task.rewards
    validate_specs([RewardSpec(reward) for reward in task.rewards])  # registered, and callable without kwargs


def parse_word(value, key, row, where):
    if value == "":
        raise UnusableGroundTruth(f"{where}: {key!r} is blank", "blank word")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} must be a word, got {value!r}")
    return {"word": value, "hint": row.pop("hint", None)}


ECHO = Task(name="echo", ground_truth_keys=("word", "meta.word"), parse_ground_truth=parse_word,
            instructions=lambda truth: f"Repeat the word (hint: {truth['hint']}).", rewards=("length",),
            reference_in_chat=True)


def test_a_family_added_as_one_entry_is_read_like_the_built_in_ones(tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "echo", ECHO)
    rows = [
        {"prompt": "say cat", "word": "cat", "hint": "pet", "source": "a"},
        {"prompt": "say dog", "meta": {"word": "dog"}},
        {"messages": [{"role": "user", "content": "say owl"}, {"role": "assistant", "content": "owl"}]},
        {"prompt": "say nothing", "word": ""},
    ]
    path = tmp_path / "echo.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = load_samples(path, "echo")
    assert [str(w.message) for w in caught] == [f"{path}: left out 1 of 4 rows, blank word: lines 4"]
    assert [(s.family, s.ground_truth) for s in samples] == [
        ("echo", {"word": "cat", "hint": "pet"}), ("echo", {"word": "dog", "hint": None}),
        ("echo", {"word": "owl", "hint": None}),
    ]
    assert samples[0].messages == [{"role": "system", "content": "Repeat the word (hint: pet)."},
                                   {"role": "user", "content": "say cat"}]
    assert samples[0].metadata == {"source": "a"}  # the hint went into the ground truth
    path.write_text(json.dumps({"prompt": "say 7", "word": 7}) + "\n")
    with pytest.raises(ValueError, match=r"echo.jsonl:1: 'word' must be a word, got 7"):
        load_samples(path, "echo")
    path.write_text(json.dumps({"prompt": "say"}) + "\n")
    with pytest.raises(ValueError, match=r"echo.jsonl:1: missing the echo ground truth 'word' or 'meta.word' or a "
                                         r"final assistant message \(or set data.ground_truth_key\)"):
        load_samples(path, "echo")


def test_an_unknown_family_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"^data.family: expected one of \('math', 'tool', 'code', 'toolrl', "
                                          r"'bfcl_multi_turn', 'multi_turn'\), "
                                          r"got 'poetry'$"):
        get_task("poetry", "data.family")
