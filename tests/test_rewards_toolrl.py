"""ToolRL's rewards on ToolRL's own data and on perturbed answers, values worked out by hand.

The real files are the excerpt in examples/data/toolrl (see its README). The counts below
(71 of the 80 test references call tools, 9 answer in text; rows 10 and 44 of the SFT excerpt
cannot be read) were also obtained by running ToolRL's released reward code on the files.
"""
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gdpo_megatron.data.samples import Fields, load_samples
from gdpo_megatron.rewards import get_reward
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.rewards.registry import validate_specs
from gdpo_megatron.rewards.toolrl import UnscorableReference, toolrl_correctness, toolrl_format

TOOLRL = Path(__file__).resolve().parents[1] / "examples" / "data" / "toolrl"
TEST_SPLIT = TOOLRL / "rlla_4k_test.parquet"
SFT_EXCERPT = TOOLRL / "rlla_sft_first50.json"
SFT_FIELDS = Fields(prompt_key="input", system_key="instruction")


def test_test_split_loads_unchanged_and_every_reference_scores_as_toolrl_scores_it():
    rows = pq.read_table(TEST_SPLIT).to_pylist()
    samples = load_samples(TEST_SPLIT, "toolrl")
    assert len(samples) == len(rows) == 80
    calls = 0
    for sample, row in zip(samples, rows):
        answer = row["reward_model"]["ground_truth"]
        assert sample.messages == row["prompt"]  # ToolRL's own system prompt, nothing added
        assert sample.ground_truth == {"answer": answer}
        assert sample.metadata["data_source"] == "rlla" and sample.metadata["extra_info"] == row["extra_info"]
        assert toolrl_format(answer, 0, sample.ground_truth) == 1.0
        expected = 3.0 if "<tool_call>" in answer else 0.0
        assert toolrl_correctness(answer, 0, sample.ground_truth) == expected
        calls += "<tool_call>" in answer
    assert calls == 71


def test_sft_rows_toolrl_cannot_read_are_reported_not_scored():
    records = json.loads(SFT_EXCERPT.read_text(encoding="utf-8"))
    left_out = (r"rlla_sft_first50\.json: left out 2 of 50 rows, reference answer ToolRL's reward cannot parse "
                r".*: rows 10, 44$")
    with pytest.warns(UserWarning, match=left_out):
        samples = load_samples(SFT_EXCERPT, "toolrl", fields=SFT_FIELDS)
    kept = [r for i, r in enumerate(records) if i not in (10, 44)]
    assert [s.id for s in samples] == [f"rlla_sft_first50-{i}" for i in range(50) if i not in (10, 44)]
    for sample, record in zip(samples, kept):
        assert sample.messages == [{"role": "system", "content": record["instruction"]},
                                   {"role": "user", "content": record["input"]}]
        assert sample.ground_truth == {"answer": record["output"]} and sample.metadata == {}
        assert toolrl_format(record["output"], 0, sample.ground_truth) == 1.0
        assert toolrl_correctness(record["output"], 0, sample.ground_truth) == (
            3.0 if "<tool_call>" in record["output"] else 0.0)
    for i in (10, 44):  # the think block mentions <tool_call>: two of them, so ToolRL's format check fails
        truth = {"answer": records[i]["output"]}
        assert records[i]["output"].count("<tool_call>") == 2
        assert toolrl_format(records[i]["output"], 0, truth) == 0.0
        with pytest.raises(UnscorableReference, match="reference tool calls"):
            toolrl_correctness(records[i]["output"], 0, truth)


WEATHER = {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "parameters": {"zone": "CET"}}
REFERENCE = {"answer": "<think> Two lookups. </think>\n<tool_call>\n" + json.dumps(WEATHER) + "\n"
             + json.dumps(TIME) + "\n</tool_call>"}


def answer(*calls, think=True, tail=""):
    body = "<tool_call>\n" + "\n".join(json.dumps(c) for c in calls) + "\n</tool_call>" + tail
    return ("<think> I will call the tools. </think>\n" if think else "") + body


def with_params(call, **params):
    return {"name": call["name"], "parameters": params}


# S_max = 1 + (1 + 2) + (1 + 1) = 6, so correctness = 6 * S / 6 - 3 = S - 3, where
# S = Jaccard(names) + sum over pairs of (Jaccard(parameter names) + equal values).
PERTURBATIONS = {
    "exact": (answer(WEATHER, TIME), 1.0, 3.0),                                      # S = 1 + 3 + 2
    "reordered calls": (answer(TIME, WEATHER), 1.0, 3.0),                            # same pairs
    "wrong name": (answer({**WEATHER, "name": "get_forecast"}, TIME), 1.0, 1 / 3 + 2 - 3),
    "missing parameter": (answer(with_params(WEATHER, city="Paris"), TIME), 1.0, 1 + (0.5 + 1) + 2 - 3),
    "extra parameter": (answer(with_params(WEATHER, city="Paris", unit="celsius", days=3), TIME),
                        1.0, 1 + (2 / 3 + 2) + 2 - 3),
    "wrong value": (answer(with_params(WEATHER, city="Paris", unit="kelvin"), TIME), 1.0, 1 + (1 + 1) + 2 - 3),
    "extra call": (answer(WEATHER, TIME, with_params(TIME, zone="PST")), 1.0, 2 / 3 + 3 + 2 - 3),
    "missing call": (answer(WEATHER), 1.0, 1 / 2 + 3 - 3),
    "arguments instead of parameters": (answer({"name": "get_weather", "arguments": WEATHER["parameters"]}, TIME),
                                        1.0, -3.0),
    "other call with arguments": (answer(WEATHER, TIME, {"name": "log", "arguments": {}}), 1.0, 2 / 3 + 3 + 2 - 3),
    "no think block": (answer(WEATHER, TIME, think=False), 0.0, 3.0),
    "text instead of a call": ("<think> Paris is sunny. </think>\n<response>It is sunny in Paris.</response>",
                               0.0, -3.0),
    "calls as one JSON list": ("<think> x </think>\n<tool_call>\n" + json.dumps([WEATHER, TIME]) + "\n</tool_call>",
                               1.0, -3.0),
    "blank line between calls": ("<think> x </think>\n<tool_call>\n" + json.dumps(WEATHER) + "\n\n"
                                 + json.dumps(TIME) + "\n</tool_call>", 1.0, -3.0),
    "unexpected response block": (answer(WEATHER, TIME, tail="\n<response>Done.</response>"), 0.0, 3.0),
    "second tool_call block": (answer(WEATHER) + "\n" + answer(TIME, think=False), 0.0, 1 / 2 + 3 - 3),
    "tag mentioned in the think block": ("<think> I need a <tool_call> here. </think>\n" + answer(WEATHER, TIME,
                                         think=False), 0.0, -3.0),
}


@pytest.mark.parametrize("name", list(PERTURBATIONS))
def test_perturbed_answers_score_as_toolrl_rules_say(name):
    completion, fmt, correctness = PERTURBATIONS[name]
    assert toolrl_format(completion, 0, REFERENCE) == fmt
    assert toolrl_correctness(completion, 0, REFERENCE) == pytest.approx(correctness, abs=1e-12)
    assert toolrl_correctness("\n  " + completion + "\n", 0, REFERENCE) == pytest.approx(correctness, abs=1e-12)


def test_values_compare_as_decoded_json():
    reference = {"answer": '<think> t </think>\n<tool_call>\n{"name": "f", "parameters": {"x": 1.0, "p": "1"}}'
                           "\n</tool_call>"}
    # S_max = 1 + (1 + 2) = 4; correctness = 6 S / 4 - 3.
    assert toolrl_correctness(answer({"name": "f", "parameters": {"x": 1, "p": "1"}}), 0, reference) == 3.0
    assert toolrl_correctness(answer({"name": "f", "parameters": {"x": 1, "p": 1}}), 0, reference) == pytest.approx(
        6 * (1 + 1 + 1) / 4 - 3)


def test_answers_without_a_call_score_zero_correctness_whatever_they_do():
    text_only = {"answer": "<think> Just greet. </think>\n<response>Hello!</response>"}
    both = {"answer": "<think> t </think>\n<tool_call>\n" + json.dumps(TIME) + "\n</tool_call>\n<response>On it."
                      "</response>"}
    neither = {"answer": "<think> Nothing to do. </think>"}
    greeting = "<think> Greet back. </think>\n<response>Hi there.</response>"
    assert (toolrl_format(greeting, 0, text_only), toolrl_correctness(greeting, 0, text_only)) == (1.0, 0.0)
    assert toolrl_correctness(answer(TIME), 0, text_only) == 0.0 and toolrl_format(answer(TIME), 0, text_only) == 0.0
    assert toolrl_format(greeting.replace("</response>", "</response><response>x</response>"), 0, text_only) == 0.0
    assert toolrl_format(answer(TIME, tail="\n<response>Done.</response>"), 0, both) == 1.0
    assert toolrl_format(answer(TIME), 0, both) == 0.0
    assert toolrl_format("<response>Done.</response>\n" + answer(TIME, think=False), 0, both) == 0.0
    assert toolrl_format("<think> Nothing. </think>", 0, neither) == 1.0
    assert toolrl_format(greeting, 0, neither) == 0.0


def test_greedy_pairing_follows_toolrl_and_optimal_pairing_is_available():
    reference = {"answer": '<think> t </think>\n<tool_call>\n{"name": "f", "parameters": {"s": "x"}}\n'
                           '{"name": "f", "parameters": {"s": "y"}}\n</tool_call>'}
    completion = answer({"name": "f", "parameters": {}}, {"name": "f", "parameters": {"s": "y"}})
    # S_max = 1 + 2 + 2 = 5; names Jaccard 1. Greedy: f(s=x) takes f(s=y) (1 + 0), f(s=y) is left with
    # f() (0): S = 2. Optimal: f(s=x)-f() (0) and f(s=y)-f(s=y) (1 + 1): S = 3.
    assert toolrl_correctness(completion, 0, reference) == pytest.approx(6 * 2 / 5 - 3)
    assert toolrl_correctness(completion, 0, reference, matching="optimal") == pytest.approx(6 * 3 / 5 - 3)
    validate_specs([RewardSpec("toolrl_correctness", kwargs={"matching": "optimal"})])
    with pytest.raises(ValueError, match="matching must be one of"):
        toolrl_correctness(completion, 0, reference, matching="hungarian")


def test_rewards_are_registered_and_reject_a_missing_reference():
    assert get_reward("toolrl_format") is toolrl_format and get_reward("toolrl_correctness") is toolrl_correctness
    for reward in (toolrl_format, toolrl_correctness):
        with pytest.raises(ValueError, match="reference answer string under 'answer'"):
            reward(answer(TIME), 0, {"tool_calls": []})
    with pytest.raises(UnscorableReference, match=re.escape("expected {'name': str, 'parameters': object}")):
        toolrl_correctness(answer(TIME), 0, {"answer": "<tool_call>\n" + json.dumps({"name": "f"}) + "\n</tool_call>"})


def test_the_paper_config_reads_toolrl_data_and_its_rewards():
    from gdpo_megatron.config import TrainConfig, load_config

    config = load_config(TrainConfig, "configs/toolrl_qwen2.5_1.5b.yaml", [f"data.train_path={TEST_SPLIT}"])
    data = config.data
    fields = Fields(data.prompt_key, data.system_key, data.ground_truth_key)
    samples = load_samples(data.train_path, data.family, data.system_prompt, fields=fields, split=data.split)
    assert len(samples) == 80 and samples[0].messages == pq.read_table(TEST_SPLIT).to_pylist()[0]["prompt"]
    validate_specs(config.rewards.rewards)
    assert config.rewards.names == ["toolrl_format", "toolrl_correctness"]
    # NVlabs/GDPO verl-GDPO/train_gdpo.sh: n=4, lr 1e-6, prompt 2048, response 1024; 105 batches of 512 prompts
    assert (config.rollout.group_size, config.policy.optim.lr) == (4, 1e-6)
    assert (data.max_prompt_tokens, config.rollout.max_new_tokens) == (2048, 1024)
    assert config.steps * data.prompts_per_step == 105 * 512


def test_dotted_field_names_read_the_same_rows_from_extra_info():
    # ToolRL's parquet repeats each row's system message, user message and reference answer in
    # extra_info; dotted field names reach them and give the same samples as the verl fields.
    nested = Fields(prompt_key="extra_info.input", system_key="extra_info.instruction",
                    ground_truth_key="extra_info.output")
    by_verl, by_extra_info = load_samples(TEST_SPLIT, "toolrl"), load_samples(TEST_SPLIT, "toolrl", fields=nested)
    assert [(s.messages, s.ground_truth) for s in by_verl] == [(s.messages, s.ground_truth) for s in by_extra_info]
    assert by_extra_info[0].metadata["extra_info"] == {"index": 0, "split": "test"}
