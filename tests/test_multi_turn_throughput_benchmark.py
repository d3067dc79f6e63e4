"""benchmarks/multi_turn_throughput.py: what its TRL side is given (chat template, tools, call
parser) matches this project's view of the same work, and its medians are of the per-run totals."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from multi_turn_throughput import (
    TOOL_CALLING_TEMPLATE,
    CityDeskTools,
    project_parser,
    summarize,
    workload_samples,
)

CHATS = [
    [{"role": "system", "content": "Answer with one tool call."}, {"role": "user", "content": "Weather in Oslo?"}],
    [{"role": "user", "content": "Time in Lima?"},
     {"role": "assistant", "content": '<tool_call>\n[{"name": "get_time", "arguments": {"city": "Lima"}}]\n</tool_call>'},
     {"role": "tool", "content": '{"city": "Lima", "time": "12:00"}'}, {"role": "assistant", "content": "Noon."},
     {"role": "user", "content": "And in Rome?"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    from gdpo_megatron.demo.warmup import build_tokenizer

    return build_tokenizer()


@pytest.mark.parametrize("chat", CHATS)
def test_the_tool_calling_template_renders_chats_without_calls_as_the_demo_template(tokenizer, chat):
    for prompt in (True, False):
        demo = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
        assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt,
                                             chat_template=TOOL_CALLING_TEMPLATE) == demo


def test_the_tool_calling_template_renders_tool_calls(tokenizer):
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, chat_template=TOOL_CALLING_TEMPLATE)
    assert text == f"<|user|>Weather?\n<|assistant|><tool_call>{json.dumps(call)}</tool_call><|endoftext|>"


def test_city_desk_tools_are_trls_view_of_city_desks_tools():
    from transformers.utils import get_json_schema

    from gdpo_megatron.environments.environment import ERROR_PREFIX
    from gdpo_megatron.environments.registry import (
        environment_reference,
        make_environment,
    )

    desk = make_environment(environment_reference("CityDesk", str(ROOT / "examples/environments/city_desk.py")))
    city_desk = {t["name"]: t for t in desk.tools()}
    for method in (CityDeskTools.get_weather, CityDeskTools.get_time):
        schema = get_json_schema(method)["function"]  # how TRL describes a tool
        project = city_desk[schema["name"]]
        assert schema["description"] == project["description"]
        assert list(schema["parameters"]["properties"]) == list(project["parameters"]["properties"]) == ["city"]
        assert schema["parameters"]["properties"]["city"]["type"] == "string"
        assert schema["parameters"]["required"] == ["city"]

    tools = CityDeskTools()
    tools.reset(json.dumps({"weather": {"Oslo": "fog"}}), prompt=[])
    assert json.loads(tools.get_weather("Oslo")) == {"city": "Oslo", "weather": "fog"}
    assert json.loads(tools.get_weather("Rome")) == {"city": "Rome", "weather": "sunny"}
    assert json.loads(tools.get_time("Lima")) == {"city": "Lima", "time": "12:00"}  # len("Lima") + 8
    assert tools.get_time(3).startswith(ERROR_PREFIX)  # checked against the schema, as in this project's rollouts
    assert tools._desk.looked_up == ["get_weather:Oslo", "get_weather:Rome", "get_time:Lima"]


def test_the_parser_reads_the_demo_models_calls_as_this_project_does(tokenizer):
    parse = project_parser(tokenizer)

    def ids(text):
        return tokenizer(text + "<|endoftext|>", add_special_tokens=False)["input_ids"]

    two = '<think>w</think>\n<tool_call>\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}, ' \
          '{"name": "get_time", "arguments": {"city": "Rome"}}]\n</tool_call>'
    assert parse(ids(two))["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Rome"}}}]
    for answer in ("It is foggy in Oslo.", '<tool_call>[{"name": "get_weather", "arguments": </tool_call>'):
        parsed = parse(ids(answer))
        assert parsed == {"role": "assistant", "content": answer}  # a plain answer to TRL: its loop ends


def test_one_turn_keeps_the_first_user_turn_only():
    from gdpo_megatron.data.samples import load_samples

    samples = load_samples(ROOT / "examples" / "data" / "city_desk.jsonl", "multi_turn", system_prompt="")
    assert all(s.ground_truth["later_turns"] for s in samples)
    cut = workload_samples(samples, "one-turn")
    assert [s.messages for s in cut] == [s.messages for s in samples]
    assert all(c.ground_truth == {**s.ground_truth, "later_turns": []} for c, s in zip(cut, samples))
    assert workload_samples(samples, "two-turn") is samples


def test_medians_are_of_the_runs_totals():
    def step(s, tokens, digests):
        return {"s": s, "engine_s": s / 2, "trajectories": 2, "tokens": tokens, "messages": 4, "calls": 2, "hits": 10, "queries": 40,
                "digests": digests}

    batched = [[step(1.0, 20, ["a", "b"]), step(3.0, 20, ["c", "d"])], [step(2.0, 30, ["e", "f"])],
               [step(4.0, 40, ["g", "h"])]]
    other = [[step(2.0, 20, ["a", "x"]), step(2.0, 20, ["c", "d"])], [step(1.0, 10, ["e", "f"])],
             [step(8.0, 40, ["y", "z"])]]
    ours = summarize(batched, None)
    # per run: 4 trajectories / 4 s, 2 / 2 s, 2 / 4 s -> 1, 1, 0.5; tokens 40 / 4, 30 / 2, 40 / 4 -> 10, 15, 10
    assert ours["trajectories_per_s"] == 1.0 and ours["tokens_per_s"] == 10.0
    assert ours["calls"] == 2.0 and ours["hit_frac"] == 0.25 and ours["engine_share"] == 0.5 and "same" not in ours
    assert summarize(other, batched)["same"] == 2  # per run: 3, 2, 0 identical trajectories
