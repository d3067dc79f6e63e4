"""Completions a policy could search for to be paid by ToolRL's rewards without doing the task.

Each value is worked out by hand from ToolRL's rules (correctness = 6 S / S_max - 3, see
gdpo_megatron/rewards/toolrl.py); the same completions were scored by ToolRL's released reward
code, which gives these values too, except where a test says it deviates.
"""
import json
import time

import pytest

from gdpo_megatron.rewards.toolrl import UnscorableReference, toolrl_correctness, toolrl_format

NEWS = {"name": "GetNews", "parameters": {"page": "1"}}
# S_max = 1 + (1 + 1) = 3.
REFERENCE = {"answer": "<think> Fetch the news. </think>\n<tool_call>\n" + json.dumps(NEWS) + "\n</tool_call>"}
BOTH = {"answer": REFERENCE["answer"] + "\n<response> Here it is. </response>"}
TEXT_ONLY = {"answer": "<think> Greet. </think>\n<response> Hi. </response>"}


def calls(*lines: str, think: str = "<think> t </think>\n") -> str:
    return think + "<tool_call>\n" + "\n".join(lines) + "\n</tool_call>"


N = json.dumps(NEWS)
ATTACKS = {  # completion: (format, correctness) against REFERENCE
    "the call twice": (calls(N, N), 1.0, 6 * (1 / 2 + 2) / 3 - 3),
    "the call fifty times": (calls(*[N] * 50), 1.0, 6 * (1 / 50 + 2) / 3 - 3),
    "an extra parameter": (calls('{"name": "GetNews", "parameters": {"page": "1", "q": "x"}}'), 1.0,
                           6 * (1 + 1 / 2 + 1) / 3 - 3),
    "extra top-level keys": (calls('{"name": "GetNews", "parameters": {"page": "1"}, "id": 7}'), 1.0, 3.0),
    "right name, junk value": (calls('{"name": "GetNews", "parameters": {"page": "junk"}}'), 1.0, 6 * 2 / 3 - 3),
    "right name, empty parameters": (calls('{"name": "GetNews", "parameters": {}}'), 1.0, 6 * 1 / 3 - 3),
    "right name, no parameters": (calls('{"name": "GetNews"}'), 1.0, -3.0),
    "right name, parameters a list": (calls('{"name": "GetNews", "parameters": ["page"]}'), 1.0, -3.0),
    "name a list": (calls('{"name": ["GetNews"], "parameters": {"page": "1"}}'), 1.0, -3.0),
    "NaN value": (calls('{"name": "GetNews", "parameters": {"page": NaN}}'), 1.0, 6 * 2 / 3 - 3),
    "Infinity value": (calls('{"name": "GetNews", "parameters": {"page": Infinity}}'), 1.0, 6 * 2 / 3 - 3),
    "duplicate key, last one right": (calls('{"name": "GetNews", "parameters": {"page": "0", "page": "1"}}'),
                                      1.0, 3.0),
    "duplicate key, first one right": (calls('{"name": "GetNews", "parameters": {"page": "1", "page": "0"}}'),
                                       1.0, 6 * 2 / 3 - 3),
    "a JSON list on the line": (calls("[" + N + "]"), 1.0, -3.0),
    "a JSON string on the line": (calls('"GetNews"'), 1.0, -3.0),
    "an empty block": (calls(""), 1.0, -3.0),
    "nested tool_call tags": (calls("<tool_call>", N, "</tool_call>"), 0.0, -3.0),
    "the closing tag inside a JSON string": (calls('{"name": "GetNews", "parameters": {"page": "</tool_call>"}}'),
                                             0.0, -3.0),
    "the calls inside the think block": ("<think>\n<tool_call>\n" + N + "\n</tool_call>\n</think>\n"
                                         "<response> x </response>", 0.0, 3.0),
    "the calls without a think block": (calls(N, think=""), 0.0, 3.0),
    "a response block after the calls": (calls(N) + "\n<response> x </response>", 0.0, 3.0),
    "a zero-width space in the tags": (calls(N).replace("tool_call", "tool\u200bcall"), 0.0, -3.0),
    "fullwidth brackets on think": (calls(N, think="\uff1cthink\uff1e t \uff1c/think\uff1e\n"), 0.0, 3.0),
    "a huge integer value": (calls('{"name": "GetNews", "parameters": {"page": 1' + "0" * 5000 + "}}"), 1.0, -3.0),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attacks_score_what_toolrl_rules_give(name):
    completion, fmt, correctness = ATTACKS[name]
    assert toolrl_format(completion, 0, REFERENCE) == fmt
    assert toolrl_correctness(completion, 0, REFERENCE) == pytest.approx(correctness, abs=1e-12)


def test_no_attack_beats_the_right_answer_on_correctness():
    right = toolrl_correctness(calls(N), 0, REFERENCE)
    assert right == 3.0
    assert all(toolrl_correctness(c, 0, REFERENCE) <= right for c, _, _ in ATTACKS.values())


def test_calls_to_a_text_only_reference_score_no_correctness():
    """ToolRL's correctness is 0 for a reference without a call whatever the completion does (its
    code has the penalty commented out); only the format reward tells a call from a reply."""
    assert toolrl_correctness(calls(N), 0, TEXT_ONLY) == 0.0
    assert toolrl_format(calls(N), 0, TEXT_ONLY) == 0.0


@pytest.mark.parametrize("nested", ["[" * 5000, '{"name": "GetNews", "parameters": {"page": ' + "[" * 5000 + "]" * 5000
                                    + "}}"])
def test_deeply_nested_json_scores_the_minimum_instead_of_raising(nested):
    # ToolRL's code catches every error of the completion's parsing and gives the minimum. A raise
    # would score the reward stage's failure_value (0 by default), above an honest wrong answer.
    assert toolrl_correctness(calls(nested), 0, REFERENCE) == -3.0


def test_a_deeply_nested_reference_is_unscorable():
    with pytest.raises(UnscorableReference):
        toolrl_correctness(calls(N), 0, {"answer": calls("[" * 5000)})


@pytest.mark.parametrize("reference", [REFERENCE, BOTH, TEXT_ONLY])
def test_the_format_check_of_long_repetitive_completions_does_not_hang(reference):
    # Repeating the separators of ToolRL's format pattern made its regular expression backtrack
    # quadratically: about 9 s for 100k characters. This is a hang guard, not a benchmark.
    units = ["</think>\n<tool_call>\n", "</think>\n<response>", "\n</tool_call>\n<response>"]
    start = time.monotonic()
    for unit in units:
        completion = "<think>" + unit * (400_000 // len(unit))
        assert toolrl_format(completion, 0, reference) == 0.0
        assert toolrl_correctness(completion, 0, reference) == (0.0 if reference is TEXT_ONLY else -3.0)
    assert time.monotonic() - start < 10


def test_a_second_tool_call_tag_ends_the_block_as_in_toolrl():
    # ToolRL reads ``text.split("<tool_call>")[1].split("</tool_call>")[0]``: the calls between the
    # first <tool_call> and the next <tool_call> or </tool_call>, whichever comes first.
    stray_open = calls(N + "<tool_call>")
    assert toolrl_correctness(stray_open, 0, REFERENCE) == 3.0 and toolrl_format(stray_open, 0, REFERENCE) == 0.0
    second_block = calls(N, think="<think> t </think>\n<tool_call>\n" + N + "\n")
    assert toolrl_correctness(second_block, 0, REFERENCE) == 3.0
    # A reference is read the same way (a repeated opening tag ends its first block too).
    truth = {"answer": calls(N, think="<think> t </think>\n<tool_call>\n" + N + "\n")}
    assert toolrl_correctness(calls(N), 0, truth) == 3.0
