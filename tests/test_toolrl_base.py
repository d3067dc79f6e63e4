"""The ToolRL base model's data: the SFT split, the shortened think blocks, the RL rows' layout."""
import hashlib
import json
import re

import pyarrow.parquet as pq
import pytest

from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.demo.toolrl_base import SFT_PATH, TEST_PATH, held_out_prompts, short_think, split_sft_rows, verl_row

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
