"""gdpo-eval on multi-turn questions: BFCL's multi-turn categories rolled out on the demo model and
judged, its verdicts re-judged by BFCL's own checker on the trajectories it wrote; a user's
environment through --data; bad input named in one line before the engine starts.

The agreement of the verdict function with BFCL's checker on every reference trajectory and
on perturbed ones is tests/test_bfcl_multi_turn.py's.
"""
import json
import shutil
from pathlib import Path

import pytest

from bfcl_reference import multi_turn_verdict
from gdpo_megatron.commands.eval import environment_section, main, parse
from gdpo_megatron.data.bfcl_multi_turn import bfcl_multi_turn_rows
from gdpo_megatron.environments import Trajectory
from gdpo_megatron.errors import UsageError
from gdpo_megatron.rewards import get_reward
from gdpo_megatron.tasks.multi_turn import REWARDS

pytest.importorskip("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")

ROOT = Path(__file__).resolve().parents[1]
CITY_DESK = ROOT / "examples" / "environments" / "city_desk.py"
CITY_DESK_DATA = ROOT / "examples" / "data" / "city_desk.jsonl"


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("arguments, message", [
    (["--bfcl-multi-turn", "base", "parallel"], "gdpo-eval: argument --bfcl-multi-turn: invalid choice: 'parallel' "
                                                "(choose from "),  # the categories, as this Python quotes them
    (["--bfcl-multi-turn", "--split", "test"], "gdpo-eval: --split: with --bfcl-multi-turn, expected one of heldout, "
                                               "train, all, got 'test'"),
    (["--bfcl-multi-turn", "--family", "tool"], "gdpo-eval: --family goes with --data, not --bfcl-multi-turn"),
    (["--bfcl-multi-turn", "--environment", "bfcl"], "gdpo-eval: --environment goes with --data of a multi-turn "
                                                     "family"),
    (["--bfcl", "--verdicts", "v.jsonl"], "gdpo-eval: --verdicts goes with a multi-turn evaluation, not --bfcl"),
])
def test_a_command_line_that_does_not_fit_is_named(arguments, message, capsys):
    assert main(["--model", "m", *arguments]) == 2
    (line,) = _errors(capsys)
    assert line.startswith(f"error: {message}"), line


def test_each_question_is_evaluated_once_and_seeded_by_its_id():
    from gdpo_megatron.data.samples import Sample
    from gdpo_megatron.evaluate_multi_turn import sample_keys

    assert parse(["--model", "m", "--bfcl-multi-turn", "base", "miss_func", "base"]).bfcl_multi_turn == [
        "base", "miss_func"]
    a, b, c = (Sample(name, "multi_turn", [], {}) for name in "abc")
    # a question's key is its id's, wherever it stands among the questions evaluated
    assert sample_keys([a, b, c])[1:] == sample_keys([b, c]) and sample_keys([c, b]) == sample_keys([b, c])[::-1]
    keys = sample_keys([a, b, a])
    assert keys[0] == sample_keys([a])[0] and len(set(keys)) == 3  # a repeated id still seeds its own


def test_a_multi_turn_family_takes_its_environment_from_the_family_or_the_options():
    def section(*arguments):
        args = parse(["--model", "m", "--data", str(CITY_DESK_DATA), *arguments])
        return environment_section(args, args.family, None, {})

    with pytest.raises(UsageError, match=r"^--environment: --family multi_turn rolls out trajectories through an "
                                         r"environment; name it \(and --environment-file for your own\)$"):
        section("--family", "multi_turn")
    reference, config = section("--family", "multi_turn", "--environment", "CityDesk", "--environment-file",
                                str(CITY_DESK), "--max-steps-per-turn", "3")
    assert reference == f"{CITY_DESK}:CityDesk" and config.max_steps_per_turn == 3
    assert section("--family", "bfcl_multi_turn")[0] == "bfcl"
    assert section("--family", "tool") is None
    with pytest.raises(UsageError, match=r"^--verdicts: --family tool is single-turn"):
        section("--family", "tool", "--verdicts", "v.jsonl")


def test_a_question_the_model_cannot_take_is_named_before_the_engine_starts(tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    from gdpo_megatron.demo.warmup import make_base_model
    from gdpo_megatron.rollout import factory

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(factory, "build_engine", no_engine)
    model = str(make_base_model(tmp_path / "model", steps=0))  # 1024 positions
    assert main(["--model", model, "--bfcl-multi-turn", "miss_param", "--limit", "2"]) == 2
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = bfcl_multi_turn_rows(["miss_param"], "heldout")[:2]
    shortest = min(_prompt_tokens(tokenizer, row) for row in rows)
    assert _errors(capsys) == [f"error: --max-model-len: none of the 2 prompts fits in 1024 tokens with "
                               f"--max-new-tokens=256 (the shortest has {shortest}); nothing to evaluate"]
    # a question whose reference calls cannot be judged
    data = tmp_path / "desk.jsonl"
    data.write_text(json.dumps(_city_desk_row(0, "Weather?", [["get_weather(city=open('x').read())"]], [])) + "\n")
    assert main(["--model", model, "--data", str(data), "--family", "multi_turn", "--environment", "CityDesk",
                 "--environment-file", str(CITY_DESK)]) == 2
    (line,) = _errors(capsys)
    assert line.startswith("error: --data: desk-0: reference call \"get_weather(city=open('x').read())\" of turn 0 "
                           "does not parse ("), line
    # one that parses but that the environment refuses, replayed in a fresh environment: in a later
    # turn, the questions before it fine
    rows = [_city_desk_row(0, "Weather?", [["get_weather(city='Seoul')"]], []),
            _city_desk_row(1, "Weather?", [["get_weather(city='Seoul')"], ["get_wether(city='Oslo')"]], ["Oslo?"])]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["--model", model, "--data", str(data), "--family", "multi_turn", "--environment", "CityDesk",
                 "--environment-file", str(CITY_DESK)]) == 2
    assert _errors(capsys) == ["error: --data: desk-1: reference call \"get_wether(city='Oslo')\" of turn 1 is "
                               "refused ('get_wether' is not an available function)"]
    # the environment options are named as given on the command line
    missing = tmp_path / "nope.py"
    assert main(["--model", model, "--data", str(data), "--family", "multi_turn", "--environment", "CityDesk",
                 "--environment-file", str(missing)]) == 2
    assert _errors(capsys) == [f"error: --environment-file: {missing} does not exist (expected a file)"]
    assert main(["--model", model, "--data", str(data), "--family", "multi_turn", "--environment", "Nope"]) == 2
    (line,) = _errors(capsys)
    assert line.startswith("error: --environment: ValueError: environment 'Nope': expected a built-in"), line


def _system_prompt(row) -> dict:
    from gdpo_megatron.tasks.bfcl_multi_turn import instructions

    return {"role": "system", "content": instructions(row["multi_turn"])}


def _steps(turns: list[list[str]], row: dict) -> list[list[list[str]]]:
    """A written trajectory as BFCL's checker takes it: per user turn, one step per message whose
    calls parse, rendered as call strings, every turn of the question present. BFCL's checker
    runs them with ``eval``: a call of a name the question's classes do not document is renamed
    to one no Python scope defines (an error on both sides, never a builtin run)."""
    from gdpo_megatron.environments import Message
    from gdpo_megatron.environments.bfcl import function_docs

    config = row["multi_turn"]["environment_config"]
    documented = {doc["name"] for cls in config["involved_classes"] for doc in function_docs(cls)}
    steps = []
    for turn in turns:
        parsed = [Message(text).calls() for text in turn]
        steps.append([[str(call) if call.name in documented else f"undocumented_{call.name}()" for call in calls]
                      for calls in parsed if isinstance(calls, list) and calls])
    return steps + [[]] * (len(row["multi_turn"]["reference_calls"]) - len(steps))


def _prompt_tokens(tokenizer, row) -> int:
    """The question's prompt as the engine sees it: the chat template's text, tokenized."""
    text = tokenizer.apply_chat_template([_system_prompt(row), *row["messages"]], add_generation_prompt=True,
                                         tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.slow
def test_bfcl_multi_turn_verdicts_agree_with_bfcls_checker_on_the_trajectories_written(demo_base_model, tmp_path,
                                                                                        capsys):
    from transformers import AutoTokenizer

    model = tmp_path / "model"  # the demo model, declaring a context that holds BFCL's questions
    shutil.copytree(demo_base_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    out, verdicts = tmp_path / "metrics.json", tmp_path / "verdicts.jsonl"
    categories = ["base", "miss_func"]
    assert main(["--model", str(model), "--bfcl-multi-turn", *categories, "--limit", "2", "--max-new-tokens", "24",
                 "--max-model-len", "15000", "--max-steps-per-turn", "3", "--out", str(out),
                 "--verdicts", str(verdicts)]) == 0
    metrics = json.loads(out.read_text())
    records = [json.loads(line) for line in verdicts.read_text().splitlines()]

    # the first two held-out questions of each category, those whose prompt leaves room for 24 tokens
    tokenizer = AutoTokenizer.from_pretrained(model)
    asked = [row for c in categories for row in bfcl_multi_turn_rows([c], "heldout")[:2]]
    fitting = [row for row in asked if _prompt_tokens(tokenizer, row) + 24 <= 15000]
    assert 0 < len(fitting) < len(asked)
    assert [r["id"] for r in records] == [row["id"] for row in fitting]
    assert (metrics["eval/prompts"], metrics["eval/skipped_too_long"]) == (len(fitting), len(asked) - len(fitting))

    for category in {r["category"] for r in records} | {"overall"}:
        group = [(r, row) for r, row in zip(records, fitting) if category in (r["category"], "overall")]
        theirs = [multi_turn_verdict(_steps(r["turns"], row), row) for r, row in group]
        for (r, _), (valid, failure, turn) in zip(group, theirs):
            assert (r["valid"], r["failure"]) == (valid, failure) and turn in (None, r["turn"]), (r, turn)
        prefix = f"eval/bfcl_multi_turn/{category}"
        assert metrics[f"{prefix}/questions"] == len(group)
        assert metrics[f"{prefix}/accuracy"] == sum(valid for valid, _, _ in theirs) / len(group)
        for name in REWARDS:  # the rewards of the trajectories written, computed again here
            again = [get_reward(name)(Trajectory.from_texts("bfcl", r["turns"]), 0, row["multi_turn"])
                     for r, row in group]
            assert [r["rewards"][name] for r, _ in group] == pytest.approx(again)
            assert metrics[f"{prefix}/{name}/mean"] == pytest.approx(sum(again) / len(group))
    assert all(metrics[f"eval/{name}/failures"] == 0 for name in REWARDS)
    assert sum(metrics[f"eval/ended_{e}_frac"] for e in ("answered", "turn_limit", "token_budget", "failed")) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdpo-eval: BFCL")]
    assert lines == [f"gdpo-eval: BFCL's multi-turn questions (heldout split of base, miss_func), environment bfcl "
                     f"(default), max_steps_per_turn 3 (given); max_new_tokens 24 (given), greedy (default); {model} "
                     "has no gdpo_training.json"]


def _looked_up(call) -> str | None:
    """What CityDesk records for a call it accepts (its state is the list of these), None for one
    it refuses (an unknown function, arguments that do not fit its schema)."""
    names = {"get_weather": ["city"], "get_time": ["city"], "convert_currency": ["amount", "from", "to"]}
    if call.name not in names or len(call.args) > len(names[call.name]):
        return None
    positional = dict(zip(names[call.name], call.args))
    args = {**positional, **call.kwargs}
    if positional.keys() & call.kwargs.keys() or set(args) != set(names[call.name]):
        return None
    if not all(isinstance(args[k], str) for k in ("city", "from", "to") if k in args):
        return None
    if call.name != "convert_currency":
        return f"{call.name}:{args['city']}"
    return f"{args['amount']} {args['from']}->{args['to']}" if type(args["amount"]) is int else None


def _city_desk_verdict(turns: list[list[str]], reference: list[list[str]]) -> tuple[bool, str | None, int | None]:
    """BFCL's checks on a CityDesk trajectory, worked out by hand: a graded turn fails ``empty``
    without a call, else ``state`` unless the calls accepted so far are the reference's so far (the
    results are functions of the calls, so with the same calls every reference result is there)."""
    from gdpo_megatron.environments import Message, parse_calls

    made = []
    for t, reference_turn in enumerate(reference):
        called = False
        for text in turns[t] if t < len(turns) else []:
            calls = Message(text).calls()
            if isinstance(calls, list):
                called = called or bool(calls)
                made += [entry for entry in map(_looked_up, calls) if entry is not None]
        if not reference_turn:
            continue
        expected = [_looked_up(call) for turn in reference[:t + 1] for text in turn for call in parse_calls(text)]
        if not called:
            return False, "empty", t
        if made != expected:
            return False, "state", t
    return True, None, None


def _city_desk_row(n: int, question: str, reference: list[list[str]], later: list[str]) -> dict:
    return {"id": f"desk-{n}", "messages": [{"role": "system", "content": "Answer with one tool call."},
                                           {"role": "user", "content": question}],
            "multi_turn": {"environment_config": {"weather": {"Seoul": "fog"}}, "reference_calls": reference,
                           "later_turns": [[{"role": "user", "content": text}] for text in later]}}


@pytest.mark.slow
def test_a_multi_turn_family_through_a_users_environment(demo_base_model, tmp_path, capsys):
    # questions of CityDesk's layout; the demo model (greedy) asks for the weather in Seoul, then
    # answers, so some are right and some fail a check
    rows = [
        _city_desk_row(0, "What is the weather in Seoul?", [["get_weather(city='Seoul')"], []], ["And the time?"]),
        _city_desk_row(1, "What is the weather in Seoul?", [["get_weather(city='Seoul')"], ["get_time(city='Rome')"]],
                       ["What time is it in Rome?"]),
        _city_desk_row(2, "What time is it in Oslo?", [["get_time(city='Oslo')"]], []),
    ]
    data, out, verdicts = tmp_path / "desk.jsonl", tmp_path / "metrics.json", tmp_path / "verdicts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["--model", demo_base_model, "--data", str(data), "--family", "multi_turn", "--environment",
                 "CityDesk", "--environment-file", str(CITY_DESK), "--max-new-tokens", "96", "--max-model-len", "1024",
                 "--out", str(out), "--verdicts", str(verdicts)]) == 0
    metrics = json.loads(out.read_text())
    records = [json.loads(line) for line in verdicts.read_text().splitlines()]
    assert [r["id"] for r in records] == [row["id"] for row in rows] and metrics["eval/prompts"] == len(rows)
    expected = [_city_desk_verdict(r["turns"], row["multi_turn"]["reference_calls"]) for r, row in zip(records, rows)]
    assert [(r["valid"], r["failure"], r["turn"]) for r in records] == expected
    assert {valid for valid, _, _ in expected} == {True, False}
    assert metrics["eval/multi_turn/overall/questions"] == len(rows)
    assert metrics["eval/multi_turn/overall/accuracy"] == sum(valid for valid, _, _ in expected) / len(rows)
    for name in REWARDS:
        assert metrics[f"eval/multi_turn/overall/{name}/mean"] == pytest.approx(
            sum(r["rewards"][name] for r in records) / len(rows))
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gdpo-eval: family")]
    assert line.startswith(f"gdpo-eval: family multi_turn (given), system prompt the family's (default), environment "
                           f"{CITY_DESK}:CityDesk (given), max_steps_per_turn 8 (default); max_new_tokens 96 (given)")
