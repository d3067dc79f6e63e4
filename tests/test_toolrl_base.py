"""The ToolRL base model's data: the SFT split, the shortened think blocks, the renamed tools, the RL rows' layout."""
import random
import hashlib
import json
import re

import pyarrow.parquet as pq
import pytest

from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.demo.toolrl_base import (SFT_PATH, TEST_PATH, held_out_prompts, rename_tools, short_think, split_sft_rows,
                                            tool_names, verl_row)
from gdpo_megatron.rewards.toolrl import parse_reference, toolrl_correctness

ROWS = json.loads(SFT_PATH.read_text())


def test_the_split_holds_out_the_test_prompts_and_follows_the_hash_rule():
    tests = {row["extra_info"]["input"] for row in pq.read_table(TEST_PATH).to_pylist()}
    assert held_out_prompts() == tests and len(tests) == 80
    warmup, rl = split_sft_rows(ROWS, tests)
    shared = [i for i, row in enumerate(ROWS) if row["input"] in tests]
    assert len(shared) == 1  # one SFT row's dialogue is also a test prompt
    expected_rl = [i for i, row in enumerate(ROWS) if i not in shared
                   and int(hashlib.sha256(f"rlla_sft:{i}".encode()).hexdigest(), 16) % 4 == 0]
    assert [ROWS.index(row) for row in rl] == expected_rl
    assert sorted(map(ROWS.index, warmup + rl)) == [i for i in range(len(ROWS)) if i not in shared]
    assert (len(warmup), len(rl)) == (299, 100)


def test_short_think_keeps_the_first_sentences_and_everything_after_the_block():
    call = '\n<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call>'
    first = "Okay, let's see. The user wants the weather in Paris today, and the tool f gives it."
    assert len(first) > 80 > len("Okay, let's see. The user wants the weather in Paris today, and the tool")
    assert short_think(f"<think> {first} So I call f. Then done. </think>{call}") == f"<think> {first} </think>{call}"
    assert short_think("<think> Short. </think>" + call) == "<think> Short. </think>" + call
    assert short_think("no block at all") == "no block at all"
    for row in ROWS:
        short = short_think(row["output"])
        assert short[short.index("</think>"):] == row["output"][row["output"].index("</think>"):]
        assert len(re.match(r"<think>(.*?)</think>", short, re.DOTALL).group(1)) <= len(row["output"])


def test_rl_rows_load_as_the_test_split_does(tmp_path):
    rows = ROWS[:12]
    path = tmp_path / "rl.json"
    path.write_text(json.dumps([verl_row(row) for row in rows]))
    with pytest.warns(UserWarning, match="left out 1 of 12 rows"):  # row 10 names <tool_call> in its think block
        samples = load_samples(path, "toolrl")
    kept = [row for i, row in enumerate(rows) if i != 10]
    assert [s.messages for s in samples] == [[{"role": "system", "content": r["instruction"]},
                                              {"role": "user", "content": r["input"]}] for r in kept]
    assert [s.reward_truth()["answer"] for s in samples] == [r["output"] for r in kept]


def test_renamed_rows_call_the_same_tools_under_their_new_names():
    rng = random.Random(0)
    called_rows = [row for row in ROWS if "<tool_call>" in short_think(row["output"]).split("</think>")[1]]
    for row in called_rows[:60]:
        row = {**row, "output": short_think(row["output"])}  # as the warm-up reads it
        renamed = rename_tools(row, rng)
        old, new = tool_names(row["instruction"]), tool_names(renamed["instruction"])
        assert len(new) == len(old) and all(re.fullmatch(r"[A-Za-z]\w{4,14}", n) for n in new)
        mapping = dict(zip(old, new))
        assert len(set(new)) == len(new) and not set(new) & set(old)
        want, got = parse_reference(row["output"]), parse_reference(renamed["output"])
        assert [c["name"] for c in got] == [mapping[c["name"]] for c in want]
        assert [c["parameters"] for c in got] == [c["parameters"] for c in want]
        # The old answer no longer scores on the renamed row; the renamed answer scores full marks.
        assert toolrl_correctness(row["output"], 0, {"answer": renamed["output"]}) == -3.0
        assert toolrl_correctness(renamed["output"], 0, {"answer": renamed["output"]}) == 3.0
        assert renamed["instruction"].replace("\n", "").count("Name: ") == row["instruction"].replace("\n", "").count("Name: ")


def test_renaming_takes_whole_names_only():
    row = {"instruction": "1. Name: get\nDescription: get data\n2. Name: get_data\nDescription: budget",
           "input": "get it", "output": '<think> use get_data </think>\n<tool_call>\n{"name": "get_data", "parameters": {}}\n</tool_call>'}
    renamed = rename_tools(row, random.Random(1))
    first, second = tool_names(renamed["instruction"])
    assert renamed["instruction"] == f"1. Name: {first}\nDescription: {first} data\n2. Name: {second}\nDescription: budget"
    assert renamed["input"] == f"{first} it"
    assert f'"name": "{second}"' in renamed["output"] and f"use {second} " in renamed["output"]


def test_a_share_outside_0_1_is_refused_before_anything_runs(tmp_path, capsys):
    from gdpo_megatron.demo.toolrl_base import main

    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "base"), "--rename-share", "1.5"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --rename-share: expected a share in [0, 1], got 1.5")
    assert not (tmp_path / "base").exists()
