"""benchmarks/toolrl_base_probe.py: its counts on real ToolRL references with completions
whose scores are known; its run is part of the comparison's smoke test."""
import math
import re
import sys

import pytest

sys.path.insert(0, "benchmarks")
from toolrl_base_probe import called_names, group_counts  # noqa: E402

from gdpo_megatron.data.samples import load_samples  # noqa: E402
from gdpo_megatron.demo.toolrl_cpu import TEST_DATA  # noqa: E402

TRUTHS = [s.reward_truth() for s in load_samples(TEST_DATA, "toolrl")]
CALLING = next(t for t in TRUTHS if "<tool_call>" in t["answer"])
REPLYING = next(t for t in TRUTHS if "<tool_call>" not in t["answer"])


def renamed(truth: dict, name: str) -> str:
    """The reference answer of ``truth`` with every call's name replaced by ``name``."""
    body = truth["answer"].split("</think>")
    return body[0] + "</think>" + re.sub(r'"name": "[^"]*"', f'"name": "{name}"', body[1])


def test_counts_name_spread_and_means_of_known_completions():
    wrong = renamed(CALLING, "not_a_listed_tool")
    groups = [(CALLING, [CALLING["answer"], wrong, "no format at all"]),  # 3, -3, -3: spread; one of three named
              (CALLING, [wrong, wrong, wrong]),  # -3 each: no spread, none named
              (REPLYING, [REPLYING["answer"], "x", "y"])]  # correctness 0 for any completion: no spread, not counted for names
    counts = group_counts(groups)
    assert counts["prompts"] == 3
    assert counts["correctness"] == pytest.approx((3 - 3 - 3 - 9 + 0) / 9)
    assert counts["format"] == pytest.approx((1 + 1 + 0 + 1 + 1 + 1 + 1 + 0 + 0) / 9)
    assert counts["completions_of_calling_prompts"] == 6
    assert counts["named_a_reference_tool"] == pytest.approx(1 / 6)
    assert counts["prompts_with_correctness_spread"] == 1


def test_names_are_read_after_the_think_block_even_from_broken_json():
    assert called_names('<think> "name": "f" </think>\n<tool_call>\n{"name": "g", "parameters": {"x": }\n') == {"g"}
    assert called_names("<think> nothing </think> <response> hi </response>") == set()
    assert math.isnan(group_counts([(REPLYING, ["a"])])["named_a_reference_tool"])
