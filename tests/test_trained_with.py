"""How a run prompted and sampled travels with its export, and gdpo-eval takes from it what its
command line leaves out (the evaluation through vLLM: test_evaluate.py)."""
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from gdpo_megatron.checkpoint.trained_with import (TRAINING_FILE, TrainedEnvironment, TrainedWith, read_trained_with,
                                                   trained_with, write_trained_with)
from gdpo_megatron.commands.eval import parse, settings
from gdpo_megatron.config import TrainConfig, load_config, to_dict
from gdpo_megatron.errors import InputError, UsageError

CONFIG = "configs/tiny_cpu.yaml"
DATA = ["--data", "examples/data/tool_demo.jsonl"]


def _record(*overrides) -> TrainedWith:
    return trained_with(to_dict(load_config(TrainConfig, CONFIG, list(overrides))))


def test_the_record_holds_the_runs_prompt_and_sampling_keys_and_reads_back(tmp_path):
    record = _record("data.prompt_key=messages", "rollout.temperature=0.7", "rollout.stop=[</tool_call>]")
    path = write_trained_with(tmp_path, record)
    assert path == tmp_path / TRAINING_FILE
    # the config's own keys and values, sections named as in the config
    assert json.loads(path.read_text()) == {
        "data": {"family": "tool", "system_prompt": "", "prompt_key": "messages", "system_key": None,
                 "ground_truth_key": None},
        "rollout": {"max_new_tokens": 80, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "stop": ["</tool_call>"]},
        "environment": {"name": None, "file": None, "step_timeout_s": 10.0, "max_steps_per_turn": 8}}
    assert read_trained_with(tmp_path) == record
    (tmp_path / "plain").mkdir()
    assert read_trained_with(tmp_path / "plain") is None  # any other Hugging Face model


@pytest.mark.parametrize("content, message", [
    ("{not json", "unreadable"),
    (json.dumps({"data": {"family": "tool"}, "rollout": {"max_new_tokens": 80, "temperature": "hot"}}),
     "rollout.temperature: expected a number, got 'hot'"),
    (json.dumps({"data": {"family": "tool"}, "rollout": {"max_new_tokens": 0, "temperature": 1.0}}),
     "rollout.max_new_tokens: expected >= 1, got 0"),
    (json.dumps({"data": {}, "rollout": {"max_new_tokens": 80, "temperature": 1.0}}),
     "data.family: required key is missing"),
])
def test_a_malformed_record_is_named(tmp_path, content, message):
    (tmp_path / TRAINING_FILE).write_text(content)
    with pytest.raises(InputError) as error:
        read_trained_with(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / TRAINING_FILE}: ") and message in str(error.value)
    assert str(error.value).endswith("; fix or delete it (without it gdpo-eval uses its own defaults)")


def test_eval_prompts_and_samples_as_trained_where_the_command_line_says_nothing():
    chosen = settings(parse(["--model", "m", *DATA]), _record())
    assert (chosen.data.family, chosen.data.system_prompt, chosen.max_new_tokens, chosen.temperature) == \
        ("tool", "", 80, 1.0)
    # the record's nulls are what training used (the usual fields): trained too; it holds no split
    assert chosen.origins == {"family": "trained", "system_prompt": "trained", "split": "default",
                              "prompt_key": "trained", "system_key": "trained", "ground_truth_key": "trained",
                              "max_new_tokens": "trained", "temperature": "trained"}
    assert chosen.describe("m", _record()) == (
        "gdpo-eval: family tool (trained), system prompt none (trained); max_new_tokens 80 (trained), "
        "temperature 1 (trained), seed 0; trained: m/gdpo_training.json")
    with_instructions = _record("data.system_prompt=null")
    chosen = settings(parse(["--model", "m", *DATA]), with_instructions)
    assert chosen.data.system_prompt is None and chosen.describe("m", with_instructions).startswith(
        "gdpo-eval: family tool (trained), system prompt the family's (trained); ")


def test_eval_flags_win_over_the_record():
    record = _record("data.prompt_key=messages", "rollout.stop=[</tool_call>]")
    chosen = settings(parse(["--model", "m", *DATA, "--system-prompt", "Call a tool.", "--max-new-tokens", "32",
                             "--temperature", "0"]), record)
    assert (chosen.data.system_prompt, chosen.data.prompt_key, chosen.max_new_tokens, chosen.temperature,
            chosen.stop) == ("Call a tool.", "messages", 32, 0.0, ["</tool_call>"])
    assert chosen.describe("m", record) == (
        "gdpo-eval: family tool (trained), system prompt 'Call a tool.' (given), prompt_key messages (trained); "
        "max_new_tokens 32 (given), greedy (given), stop ['</tool_call>'] (trained); trained: m/gdpo_training.json")


def test_eval_of_another_family_takes_only_the_sampling_from_the_record():
    record = _record("data.prompt_key=messages")
    chosen = settings(parse(["--model", "m", "--data", "examples/data/math.jsonl", "--family", "math"]), record)
    assert (chosen.data.family, chosen.data.system_prompt, chosen.data.prompt_key) == ("math", None, None)
    assert (chosen.origins["system_prompt"], chosen.origins["prompt_key"]) == ("default", "default")
    assert (chosen.max_new_tokens, chosen.temperature) == (80, 1.0)
    bfcl = settings(parse(["--model", "m", "--bfcl"]), record)
    assert bfcl.data is None and (bfcl.max_new_tokens, bfcl.temperature) == (80, 1.0)


def test_eval_of_a_model_without_a_record_keeps_the_defaults():
    chosen = settings(parse(["--model", "m", *DATA, "--family", "tool"]), None)
    assert (chosen.data.system_prompt, chosen.max_new_tokens, chosen.temperature, chosen.top_p, chosen.stop) == \
        (None, 256, 0.0, 1.0, [])
    assert chosen.describe("m", None) == (
        "gdpo-eval: family tool (given), system prompt the family's (default); max_new_tokens 256 (default), "
        "greedy (default); m has no gdpo_training.json")
    with pytest.raises(UsageError, match=r"^gdpo-eval: --data needs --family \(m has no gdpo_training.json"):
        settings(parse(["--model", "m", *DATA]), None)



def test_a_multi_turn_run_records_its_environment_and_eval_steps_through_it(tmp_path):
    record = trained_with(to_dict(load_config(TrainConfig, "configs/multi_turn_cpu.yaml", [])))
    assert (record.environment.name, record.environment.file, record.environment.max_steps_per_turn) == \
        ("CityDesk", "examples/environments/city_desk.py", 2)
    chosen = settings(parse(["--model", "m", "--data", "examples/data/city_desk.jsonl"]), record)
    reference, section = chosen.environment
    assert reference == f"{Path('examples/environments/city_desk.py').resolve()}:CityDesk"
    assert (section.max_steps_per_turn, chosen.origins["environment"], chosen.origins["max_steps_per_turn"]) == \
        (2, "trained", "trained")
    given = settings(parse(["--model", "m", "--data", "examples/data/city_desk.jsonl", "--max-steps-per-turn", "5"]),
                     record)
    assert (given.environment[1].max_steps_per_turn, given.origins["max_steps_per_turn"]) == (5, "given")
    # another multi-turn family takes its own environment, not the record's
    bfcl = settings(parse(["--model", "m", "--bfcl-multi-turn"]), record)
    assert (bfcl.environment[0], bfcl.environment[1].max_steps_per_turn, bfcl.origins["environment"]) == \
        ("bfcl", 8, "default")
    # a record written before environments were kept reads with the section's defaults
    old = asdict(record)
    del old["environment"]
    (tmp_path / TRAINING_FILE).write_text(json.dumps(old))
    assert read_trained_with(tmp_path).environment == TrainedEnvironment(None, None, 10.0, 8)
    assert trained_with(old).environment == TrainedEnvironment(None, None, 10.0, 8)  # a checkpoint's config of then
