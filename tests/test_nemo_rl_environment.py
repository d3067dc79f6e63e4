"""The reward stage as a NeMo-RL environment, the prompt data NeMo-RL loads, and the
diagnostics reaching NeMo-RL's logger, driven by the calls NeMo-RL makes.

Read from NeMo-RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (not installable here):
``ResponseDataset`` loads a local JSONL with ``datasets.load_dataset("json", ...)["train"]``
and adds a ``task_name`` column; a processor turns each row into a ``DatumSpec``;
``calculate_rewards`` calls ``env.step(message_logs, extra_env_infos)`` with the
``{"role", "content"}`` of every message and unpacks the six fields of its return; a dict of
rewards becomes one ``reward/<name>`` batch column each; ``grpo_train`` then calls the
estimator and the logger in the order :func:`grpo_train_step` replays.
"""
import json
import os
from types import SimpleNamespace

import datasets
import pytest
import torch

from gdpo_megatron.data.chat import encode_prompt, render_prompt
from gdpo_megatron.data.samples import load_samples
from gdpo_megatron.demo.task import CHAT_TEMPLATE
from gdpo_megatron.integrations.nemo_rl import (DiagnosticsLogger, GDPOMegatronEstimator, RewardStageEnvironment,
                                                prompt_processor, write_response_jsonl)
from gdpo_megatron.integrations.nemo_rl import environment as environment_module
from gdpo_megatron.rewards import get_reward
from support.tiny_model import build_tokenizer

TOOL_DATA = "examples/data/tool.jsonl"
CODE_DATA = "examples/data/code.jsonl"
MAX_TOKENS = 200  # the length reward's limit in the tool environment (the long completion has ~340)
TOOL_REWARDS = [{"name": "tool_format"}, {"name": "tool_correctness"},
                {"name": "length", "kwargs": {"max_tokens": MAX_TOKENS}}]
NO_SPEC = SimpleNamespace(system_prompt=None, prompt=None)  # a TaskDataSpec without prompt files
SECRET = "GDPO_NEMO_ENV_SECRET"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    tok = build_tokenizer(512)
    tok.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def tool_env(tokenizer_dir):
    env = RewardStageEnvironment({"tokenizer": tokenizer_dir, "num_workers": 2, "timeout_s": 20.0,
                                  "rewards": TOOL_REWARDS})
    yield env
    env.shutdown()


@pytest.fixture(scope="module")
def tool_rows(tmp_path_factory, tokenizer):
    """DatumSpecs of examples/data/tool.jsonl, through NeMo-RL's loading path."""
    root = tmp_path_factory.mktemp("nemo_rl_data")
    path = root / "tool.jsonl"
    assert write_response_jsonl(TOOL_DATA, "tool", path) == 6
    rows = datasets.load_dataset("json", data_files=str(path), cache_dir=str(root / "cache"))["train"]
    rows = rows.add_column("task_name", ["tool"] * len(rows))
    return [prompt_processor(rows[i], NO_SPEC, tokenizer, 4096, i) for i in range(len(rows))]


def call(name, arguments):
    calls = json.dumps([{"name": name, "arguments": arguments}])
    return f"<think>call {name}</think>\n<tool_call>\n{calls}\n</tool_call>"


# (sample index, completion): a right call, a wrong value, an unformatted answer, a long right call
COMPLETIONS = [
    (0, call("get_weather", {"city": "Paris", "unit": "celsius"})),
    (0, call("get_weather", {"city": "Paris", "unit": "fahrenheit"})),
    (0, "It is sunny in Paris."),
    (5, call("multiply", {"a": 23, "b": 19})),
    (5, call("multiply", {"a": 23, "b": 19}).replace("call multiply", "call multiply " + "because " * 40)),
    (5, call("add", {"a": 23, "b": 19})),
]


def conversation(row, completion):
    """The message log NeMo-RL's calculate_rewards hands the environment (role and content)."""
    return [{"role": "user", "content": row["message_log"][0]["content"]}, {"role": "assistant", "content": completion}]


def test_prompt_rows_keep_the_ground_truth_and_the_chat(tool_rows, tokenizer):
    samples = load_samples(TOOL_DATA, "tool")
    for row, sample in zip(tool_rows, samples):
        assert row["extra_env_info"] == {**sample.ground_truth, **sample.metadata}  # no key added or lost
        assert row["message_log"][0]["token_ids"].tolist() == encode_prompt(tokenizer, sample.messages)
        assert row["message_log"][0]["content"] == render_prompt(tokenizer, sample.messages)
        assert row["length"] == len(row["message_log"][0]["token_ids"]) and row["loss_multiplier"] == 1.0
        assert row["task_name"] == "tool"
    assert "get_weather" in tool_rows[0]["message_log"][0]["content"]  # the schemas are in the system prompt


def test_an_over_long_prompt_is_masked_and_prompt_files_are_refused(tmp_path, tokenizer):
    path = tmp_path / "tool.jsonl"
    write_response_jsonl(TOOL_DATA, "tool", path)
    row = {**json.loads(path.read_text().splitlines()[0]), "task_name": "tool"}
    datum = prompt_processor(row, NO_SPEC, tokenizer, 10, 0)
    assert datum["loss_multiplier"] == 0.0 and datum["length"] == 4 == len(datum["message_log"][0]["token_ids"])
    with pytest.raises(ValueError, match="system_prompt_file: the rows of write_response_jsonl carry their own"):
        prompt_processor(row, SimpleNamespace(system_prompt="Be brief.", prompt=None), tokenizer, 4096, 0)
    with pytest.raises(ValueError, match=r"row 3 \(x\): no 'ground_truth'"):
        prompt_processor({"id": "x", "messages": row["messages"], "task_name": "tool"}, NO_SPEC, tokenizer, 4096, 3)


def test_step_scores_like_the_reward_functions(tool_env, tool_rows, tokenizer):
    logs = [conversation(tool_rows[i], text) for i, text in COMPLETIONS]
    metadata = [tool_rows[i]["extra_env_info"] for i, _ in COMPLETIONS]
    result = tool_env.step(logs, metadata)

    observations, returned_metadata, next_stop_strings, rewards, terminateds, answers = result  # as NeMo-RL unpacks
    assert type(result)._fields == ("observations", "metadata", "next_stop_strings", "rewards", "terminateds",
                                    "answers")
    assert list(rewards) == ["reward/tool_format", "reward/tool_correctness", "reward/length"]
    for k, name in enumerate(["tool_format", "tool_correctness", "length"]):
        kwargs = TOOL_REWARDS[k].get("kwargs", {})
        want = [get_reward(name)(text, len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                                 tool_rows[i]["extra_env_info"], **kwargs) for i, text in COMPLETIONS]
        assert rewards[f"reward/{name}"].tolist() == pytest.approx(want), name
        assert rewards[f"reward/{name}"].dtype == torch.float32
    # the cases are what they claim: right / one wrong value of two (ToolRL: 6 * 3 / 4 - 3) / no call,
    # and one too long
    assert rewards["reward/tool_correctness"].tolist()[:3] == pytest.approx([3.0, 1.5, -3.0])
    assert rewards["reward/tool_format"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert rewards["reward/length"].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert terminateds.tolist() == [1.0] * 6 and next_stop_strings == [None] * 6 and answers is None
    assert returned_metadata == metadata and all(o["role"] == "environment" for o in observations)

    metrics = tool_env.take_metrics()
    assert metrics["reward/tool_format/mean"] == pytest.approx(5 / 6)
    assert metrics["reward/length/failures"] == 0.0 and metrics["reward/tool_correctness/timeouts"] == 0.0
    assert tool_env.take_metrics() == {}  # counted once
    batch = {"reward/tool_format": rewards["reward/tool_format"]}
    assert tool_env.global_post_process_and_metrics(batch) == (batch, {})


def test_only_the_assistants_text_is_scored(tool_env, tool_rows):
    # A right call in the prompt (or an earlier non-assistant message) pays nothing.
    right = call("get_weather", {"city": "Paris", "unit": "celsius"})
    log = [{"role": "user", "content": right}, {"role": "environment", "content": right},
           {"role": "assistant", "content": "<think>hm</think>"}]
    rewards = tool_env.step([log], [tool_rows[0]["extra_env_info"]]).rewards
    assert rewards["reward/tool_correctness"].item() == -3.0 and rewards["reward/tool_format"].item() == 0.0
    tool_env.take_metrics()


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"rewards": TOOL_REWARDS}, r"env.<name>.tokenizer: expected the name or path"),
        ({"tokenizer": "x", "rewards": [{"name": "tool_format", "weight": 2.0}]},
         r"env.<name>.rewards.0.weight: a NeMo-RL run weighs rewards in grpo.adv_estimator.reward_weights"),
        ({"tokenizer": "x", "rewards": TOOL_REWARDS, "workers": 2}, r"env.<name>.workers: unknown key"),
        ({"tokenizer": "x", "rewards": []}, r"rewards"),
    ],
)
def test_bad_environment_config_is_named(cfg, match):
    with pytest.raises(ValueError, match=match):
        RewardStageEnvironment(cfg)


def test_bad_step_inputs_are_named(tool_env, tool_rows):
    truth = tool_rows[0]["extra_env_info"]
    with pytest.raises(ValueError, match=r"message_log_batch\[1\]: no assistant message to score"):
        tool_env.step([[{"role": "assistant", "content": "x"}], [{"role": "user", "content": "x"}]], [truth, truth])
    with pytest.raises(ValueError, match=r"metadata\[0\]: expected the sample's ground truth dict"):
        tool_env.step([[{"role": "assistant", "content": "x"}]], ["Paris"])
    with pytest.raises(ValueError, match="2 message logs but 1 metadata"):
        tool_env.step([[{"role": "assistant", "content": "x"}]] * 2, [truth])


def test_the_actor_class_is_built_on_demand():
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="RewardStageEnvironmentActor needs ray"):
            environment_module.RewardStageEnvironmentActor
    else:
        assert hasattr(environment_module.RewardStageEnvironmentActor, "remote")
    with pytest.raises(AttributeError):
        environment_module.NoSuchThing


HANGING_REWARD = '''
import time
from gdpo_megatron.rewards import register_reward

@register_reward("nemo_env_hangs_on_request")
def hangs_on_request(completion, num_tokens, ground_truth):
    if "please hang" in completion:
        time.sleep(3600)
    return 1.0
'''


def program(code):
    return f"<think>plan</think>\n```python\n{code}\n```"


def test_code_rewards_run_in_the_sandbox_with_timeouts(tmp_path, tokenizer_dir, monkeypatch):
    reward_file = tmp_path / "hangs.py"
    reward_file.write_text(HANGING_REWARD)
    monkeypatch.setenv(SECRET, "hunter2")  # in the environment's process, not the sandbox's
    fast = {"limits": {"wall_s": 3.0, "cpu_s": 1}}
    env = RewardStageEnvironment({
        "tokenizer": tokenizer_dir, "num_workers": 2, "timeout_s": 30.0, "reward_files": [str(reward_file)],
        "allow_weaker_sandbox": True,  # whatever sandbox level runs here: scoring and timeouts are the point
        "rewards": [{"name": "code_pass", "kwargs": fast}, {"name": "code_no_bug", "kwargs": fast},
                    {"name": "nemo_env_hangs_on_request", "timeout_s": 1.0, "failure_value": -1.0}],
    })
    try:
        add = load_samples(CODE_DATA, "code")[0].ground_truth
        leak = {"tests": [{"input": "", "output": "hunter2\n"}]}
        cases = [
            (add, program("a, b = map(int, input().split())\nprint(a + b)")),
            (leak, program(f"import os\nprint(os.environ.get({SECRET!r}))")),  # paid only if the secret leaks
            (add, program("while True:\n    pass")),
            (add, program("a, b = map(int, input().split())\nprint(a + b)  # please hang")),
        ]
        result = env.step([[{"role": "assistant", "content": text}] for _, text in cases], [t for t, _ in cases])
        assert result.rewards["reward/code_pass"].tolist() == [1.0, 0.0, 0.0, 1.0]
        assert result.rewards["reward/code_no_bug"].tolist() == [1.0, 1.0, 0.0, 1.0]
        assert result.rewards["reward/nemo_env_hangs_on_request"].tolist() == [1.0, 1.0, 1.0, -1.0]
        metrics = env.take_metrics()
        assert metrics["reward/nemo_env_hangs_on_request/failures"] == 1.0
        assert metrics["reward/nemo_env_hangs_on_request/timeouts"] == 1.0
        assert metrics["reward/code_pass/failures"] == 0.0
    finally:
        env.shutdown()
    assert os.environ[SECRET] == "hunter2"


class RecordingLogger:
    """Records what reaches NeMo-RL's ``Logger`` (the methods grpo_train calls on it)."""

    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
        self.calls.append(("metrics", prefix, step, dict(metrics), step_finished))

    def log_histogram(self, histogram, step, name):
        self.calls.append(("histogram", name, step, len(histogram), False))

    def log_batched_dict_as_jsonl(self, to_log, filename):
        self.calls.append(("jsonl", filename, None, sorted(to_log), False))


def grpo_train_step(logger, estimator, env, tool_rows, completions, step, validation=None):
    """One step of NeMo-RL's synchronous grpo_train, in the order it calls the environment,
    the estimator and the logger (values that do not matter here are placeholders)."""
    rows = [tool_rows[i] for i, _ in completions]
    env_out = env.step([conversation(r, text) for r, (_, text) in zip(rows, completions)],
                       [r["extra_env_info"] for r in rows])
    batch = dict(env_out.rewards)  # run_multi_turn_rollout: current_batch[name] = reward_tensor
    batch["total_reward"] = sum(env_out.rewards.values())
    logger.log_metrics({"mean_gen_tokens_per_sample": 9.0, "natural_termination_rate": 1.0}, step, prefix="train")

    prompts = [r["message_log"][0]["token_ids"] for r in rows]
    prompt_ids = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=0)
    mask = torch.cat([torch.zeros(len(rows), prompt_ids.shape[1]), torch.ones(len(rows), 5)], dim=1)
    advantages = estimator.compute_advantage(prompt_ids=prompt_ids, rewards=batch["total_reward"], mask=mask,
                                             repeated_batch=batch, logprobs_policy=torch.zeros_like(mask),
                                             logprobs_reference=torch.zeros_like(mask))
    logger.log_histogram(batch["total_reward"].numpy(), step, "train/baseline_reward/histogram")
    logger.log_histogram(advantages.numpy(), step, "train/advantages/histogram")
    if validation is not None:
        val_rows = [tool_rows[i] for i, _ in validation]
        env.step([conversation(r, text) for r, (_, text) in zip(val_rows, validation)],
                 [r["extra_env_info"] for r in val_rows])
        logger.log_metrics({"validation_total": 1.0}, step, prefix="timing/validation")
        logger.log_metrics({"accuracy": 0.5}, step, prefix="validation")
    logger.log_batched_dict_as_jsonl({"advantages": advantages.tolist()}, f"train_data_step{step}.jsonl")
    logger.log_metrics({"loss": 0.25, "reward": batch["total_reward"].mean().item()}, step, prefix="train")
    logger.log_metrics({"tokens_per_sec_per_gpu": 100.0}, step, prefix="performance")
    logger.log_metrics({"total_step_time": 2.0}, step, prefix="timing/train", step_finished=True)
    return advantages


def test_diagnostics_reach_the_logger_of_the_synchronous_loop(tool_env, tool_rows):
    tool_env.take_metrics()  # start counting here
    estimator = GDPOMegatronEstimator({"name": "gdpo", "reward_weights": [1.0, 1.0, 0.5]}, group_size=3)
    recorder = RecordingLogger()
    logger = DiagnosticsLogger(recorder, estimator, metric_sources=[tool_env.take_metrics])

    grpo_train_step(logger, estimator, tool_env, tool_rows, COMPLETIONS, step=1)
    step1 = dict(estimator.last_metrics)
    validation = [(4, call("search_flights", {"origin": "Berlin", "destination": "Rome", "date": "2025-06-01"})),
                  (4, "no idea")]
    every_call_formatted = [COMPLETIONS[i] for i in (0, 1, 1, 3, 5, 5)]
    grpo_train_step(logger, estimator, tool_env, tool_rows, every_call_formatted, step=2, validation=validation)
    step2 = dict(estimator.last_metrics)

    metric_calls = [(prefix, step, m) for kind, prefix, step, m, _ in recorder.calls if kind == "metrics"]
    train = [(step, m) for prefix, step, m in metric_calls if prefix == "train"]
    assert [step for step, _ in train] == [1, 1, 2, 2]
    # After generation: the environment's counts of this step's rollouts, not the estimator's yet.
    rollouts, after_update = train[0][1], train[1][1]
    assert rollouts["reward/tool_format/mean"] == pytest.approx(5 / 6) and "advantage/batch_std" not in rollouts
    assert rollouts["mean_gen_tokens_per_sample"] == 9.0
    # The step's last train call: the estimator's diagnostics of that step, the loop's own keys kept.
    assert {k: after_update[k] for k in step1} == step1 and after_update["loss"] == 0.25
    assert "reward/tool_format/mean" not in after_update  # nothing scored since the last call
    assert {k: train[3][1][k] for k in step2} == step2 and step2 != step1
    # Validation rollouts are counted under validation, not in the next step's training counts.
    validation_metrics = next(m for prefix, step, m in metric_calls if prefix == "validation")
    assert validation_metrics["reward/tool_format/mean"] == 0.5 and validation_metrics["accuracy"] == 0.5
    assert train[2][1]["reward/tool_format/mean"] == 1.0
    # Everything else passes through unchanged.
    others = [(prefix, m) for prefix, step, m in metric_calls if prefix not in ("train", "validation")]
    assert others == [("performance", {"tokens_per_sec_per_gpu": 100.0}), ("timing/train", {"total_step_time": 2.0}),
                      ("timing/validation", {"validation_total": 1.0}),
                      ("performance", {"tokens_per_sec_per_gpu": 100.0}), ("timing/train", {"total_step_time": 2.0})]
    assert recorder.calls[-1][-1] is True  # step_finished reaches the logger
    assert [c[1] for c in recorder.calls if c[0] == "jsonl"] == ["train_data_step1.jsonl", "train_data_step2.jsonl"]
    assert sum(c[0] == "histogram" for c in recorder.calls) == 4


def test_the_asynchronous_loops_own_copy_is_not_logged_twice(tool_env, tool_rows):
    estimator = GDPOMegatronEstimator({}, group_size=3)
    recorder = RecordingLogger()
    logger = DiagnosticsLogger(recorder, estimator)
    rows = [tool_rows[i] for i, _ in COMPLETIONS]
    batch = dict(tool_env.step([conversation(r, t) for r, (_, t) in zip(rows, COMPLETIONS)],
                               [r["extra_env_info"] for r in rows]).rewards)
    tool_env.take_metrics()
    prompt_ids = torch.tensor([[i] for i, _ in COMPLETIONS])
    estimator.compute_advantage(prompt_ids, None, torch.ones(6, 3), batch)
    rollout_metrics = {"mean_gen_tokens_per_sample": 9.0}
    rollout_metrics.update(estimator.last_metrics)  # async_grpo_train does this itself
    logger.log_metrics({**rollout_metrics, "advantage/batch_std": -1.0}, 1, prefix="train")
    (_, _, _, logged, _), = recorder.calls
    assert logged["advantage/batch_std"] == -1.0  # the loop's value wins
    logger.log_metrics({"loss": 0.1}, 1, prefix="train")
    assert recorder.calls[-1][3] == {"loss": 0.1}  # already logged once, not again


def test_example_config_sections_build():
    import yaml

    from gdpo_megatron.config import RewardsConfig, from_dict
    from gdpo_megatron.rewards.registry import validate_specs

    with open("examples/nemo_rl/gdpo_tool_call_1B.yaml") as f:
        cfg = yaml.safe_load(f)
    estimator = GDPOMegatronEstimator(cfg["grpo"]["adv_estimator"],
                                      group_size=cfg["grpo"]["num_generations_per_prompt"])
    assert (estimator.config.use_leave_one_out_baseline, estimator.config.normalize_rewards) == (False, True)
    env_name = cfg["data"]["default"]["env_name"]
    env_cfg = dict(cfg["env"][env_name])
    assert env_cfg.pop("tokenizer") == "${policy.tokenizer.name}"
    rewards = from_dict(RewardsConfig, env_cfg, f"env.{env_name}")
    validate_specs(rewards.rewards)
    assert len(estimator.config.reward_weights) == len(rewards.names)  # one weight per reward column
    assert cfg["data"]["train"]["dataset_name"] == "ResponseDataset"
    assert cfg["data"]["default"]["prompt_file"] is None and cfg["data"]["default"]["system_prompt_file"] is None
