"""Every user mistake at the console gets one line naming the key or file, status 2, and writes nothing.

The entry points run in this process (no engine, no process group starts); one case goes
through torchrun for real, where the line must appear once and be torchrun's root cause.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from gdpo_megatron.__main__ import main as cli_main
from gdpo_megatron.commands import console
from gdpo_megatron.commands.console import EXIT_USER_ERROR, console_entry
from gdpo_megatron.commands.convert import main as convert_main
from gdpo_megatron.commands.eval import _max_model_len
from gdpo_megatron.commands.eval import main as eval_main
from gdpo_megatron.commands.plot import main as plot_main
from gdpo_megatron.commands.train import main as train_main
from gdpo_megatron.metrics import METRICS_FILE

CONFIG = "configs/tiny_cpu.yaml"
WITHOUT_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's check")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """The demo's tiny Llama, untrained: config.json (1024 positions), safetensors, tokenizer + chat template."""
    from gdpo_megatron.demo.warmup import make_base_model

    return make_base_model(tmp_path_factory.mktemp("base") / "model", steps=0)


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    """No launcher around these calls (a developer's shell may hold some of its variables)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "TORCHELASTIC_ERROR_FILE", "GDPO_DEBUG"):
        monkeypatch.delenv(name, raising=False)


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(capsys, message: str) -> str:
    """stderr is exactly ``error: ...`` containing ``message``, and nothing went to stdout."""
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    return err


def error_lines(capsys) -> list[str]:
    """The ``error: ...`` lines on stderr (nothing else there, nothing on stdout)."""
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), err
    return lines


def expect_user_error(capsys, tmp_path: Path, call, message: str) -> str:
    """``call()`` returns status 2 with one line holding ``message`` and leaves ``tmp_path`` as it was."""
    before = files_under(tmp_path)
    assert call() == EXIT_USER_ERROR
    line = one_error_line(capsys, message)
    assert files_under(tmp_path) == before
    return line


# ---- gdpo-train ---------------------------------------------------------------------------------


def train(base_model, run_dir, *overrides):
    return lambda: train_main(["--config", CONFIG, f"base_model={base_model}", f"run_dir={run_dir}", *overrides])


@pytest.mark.parametrize("override, message", [
    ("foo=1", "foo: unknown key (expected one of: advantage, base_model,"),
    ("rollout.group_size=1", "rollout.group_size: expected >= 2 (advantages compare the completions of a "
                             "prompt; one alone gets advantage 0), got 1"),
    ("rewards.timeout_s=0", "rewards.timeout_s: expected > 0 seconds, got 0.0"),
    ("rewards.num_workers=0", "rewards.num_workers: expected >= 1 (reward worker processes), got 0"),
    ("data.family=poetry",
     "data.family: expected one of ('math', 'tool', 'code', 'toolrl', 'bfcl_multi_turn', 'multi_turn'), got 'poetry'"),
    ("policy.micro_batch_size=0", "policy.micro_batch_size: expected >= 1, got 0"),
    ("rollout.top_p=0", "rollout.top_p: expected in (0, 1], got 0.0"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization: expected in (0, 1], got 1.5"),
    ("rewards.rewards.0.name=nope_reward", "rewards.rewards.0.name: 'nope_reward' is not a registered reward "
                                           "(registered: code_no_bug, code_pass,"),
    ("rewards.rewards.2.kwargs={max_token: 5}", "rewards.rewards.2.kwargs: reward 'length': kwargs {'max_token': 5} "
                                                "do not fit"),
    ("advantage.conditions.0.gate=speed", "advantage.conditions.0.gate: 'speed' is not a configured reward"),
    ("policy.parallel.tensor_model_parallel_size=2", "policy.parallel: world size 1 is not divisible by tensor x "
                                                      "pipeline x context parallel size 2"),
    ("rollout.max_model_len=2048", "rollout.max_model_len: expected <= 1024, the max_position_embeddings of "
                                   "base_model, got 2048"),
    ("data.max_prompt_tokens=10", "data.max_prompt_tokens: 512 prompt(s) of examples/data/tool_demo.jsonl are "
                                  "longer than 10 tokens, the longest"),
    pytest.param("rollout.quantization=fp8", "rollout.quantization: 'fp8' rollouts need a CUDA GPU; use null on "
                 "this machine", marks=WITHOUT_CUDA),
    ("data.train_path=nowhere.jsonl", "data.train_path: nowhere.jsonl does not exist"),
    ("data.prompts_per_step=100000", "data.prompts_per_step: 100000 is more than the 512 prompts of "
                                     "examples/data/tool_demo.jsonl, so a step would repeat prompts; at most 512"),
    pytest.param("rollout.kv_cache_gib=100000", "rollout.kv_cache_gib: 100000.0 needs 100000.", marks=WITHOUT_CUDA),
    ("rewards.reward_files=[nowhere.py]", "rewards.reward_files.0: nowhere.py does not exist"),
])
def test_train_config_mistakes(base_model, tmp_path, capsys, override, message):
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", override), message)
    assert not (tmp_path / "run").exists()


def test_independent_mistakes_come_together_one_line_each(base_model, tmp_path, capsys):
    """The paper's ToolRL config on the demo model and ToolRL's 80-row test file: too long a
    context for the model, more prompts per step than the file holds, and prompts longer than
    max_prompt_tokens, in one run, with the settings that would fit."""
    from transformers import AutoTokenizer

    from gdpo_megatron.data.samples import load_samples

    data = "examples/data/toolrl/rlla_4k_test.parquet"
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    rendered = {s.id: tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
                for s in load_samples(data, "toolrl")}
    lengths = {i: len(tokenizer(text, add_special_tokens=False)["input_ids"]) for i, text in rendered.items()}
    longest = max(lengths, key=lengths.get)
    over = sum(n > 2048 for n in lengths.values())
    call = lambda: train_main(["--config", "configs/toolrl_qwen2.5_1.5b.yaml", f"base_model={base_model}",
                               f"run_dir={tmp_path / 'run'}", f"data.train_path={data}"])  # noqa: E731
    assert call() == EXIT_USER_ERROR
    assert error_lines(capsys) == [
        "error: rollout.max_model_len: expected <= 1024, the max_position_embeddings of base_model, got 3072",
        f"error: data.prompts_per_step: 128 is more than the {len(lengths)} prompts of {data}, so a step would repeat "
        f"prompts; at most {len(lengths)}",
        f"error: data.max_prompt_tokens: {over} prompt(s) of {data} are longer than 2048 tokens, the longest "
        f"{longest!r} with {lengths[longest]}; set data.max_prompt_tokens={lengths[longest]} and "
        f"rollout.max_model_len={lengths[longest] + 1024} (or more), or drop them"]
    assert not (tmp_path / "run").exists()


def test_four_config_mistakes_in_one_run(base_model, tmp_path, capsys):
    """Mistakes in different sections, and two in one section, are all named, one line each."""
    config = tmp_path / "four.yaml"
    config.write_text(open(CONFIG).read() + "stepz: 3\n")
    call = lambda: train_main(["--config", str(config), f"base_model={base_model}",  # noqa: E731
                               f"run_dir={tmp_path / 'run'}", "rollout.temperature=hot", "advantage.mode=ppo",
                               "rewards.rewards.1.weight=[1]"])
    assert call() == EXIT_USER_ERROR
    assert sorted(error_lines(capsys)) == [
        "error: advantage.mode: expected one of ('gdpo', 'grpo', 'grpo_no_std'), got 'ppo'",
        "error: rewards.rewards.1.weight: expected a number, got [1]",
        "error: rollout.temperature: expected a number, got 'hot'",
        "error: stepz: unknown key (expected one of: advantage, base_model, checkpoint, data, distributed, "
        "environment, logging, policy, rewards, rollout, run_dir, seed, steps)"]
    assert not (tmp_path / "run").exists()


def test_every_malformed_row_and_a_bad_reward_together(base_model, tmp_path, capsys):
    """Two malformed rows of the data file (among good ones) and a reward that is not
    registered: three lines, each row named by its line."""
    rows = [json.loads(line) for line in open("examples/data/tool_demo.jsonl")][:8]
    lines = [json.dumps(row) for row in rows]
    lines[2] = '{"messages": "unclosed'
    lines[5] = json.dumps({k: v for k, v in rows[5].items() if k != "messages"} | {"messages": 7})
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(lines) + "\n")
    call = train(base_model, tmp_path / "run", f"data.train_path={data}", "rewards.rewards.0.name=nope_reward")
    assert call() == EXIT_USER_ERROR
    found = error_lines(capsys)
    assert len(found) == 3, found
    assert found[0].startswith("error: rewards.rewards.0.name: 'nope_reward' is not a registered reward")
    assert found[1].startswith(f"error: data.train_path: {data}:3: not valid JSON (Unterminated string")
    assert found[2] == (f"error: data.train_path: {data}:6: 'messages' must be a string or a non-empty list of "
                        "{'role': str, 'content': str}")


def test_train_config_file_and_command_line(base_model, tmp_path, capsys):
    expect_user_error(capsys, tmp_path, lambda: train_main(["--config", str(tmp_path / "none.yaml")]),
                      f"config file {tmp_path / 'none.yaml'}: not found")
    (tmp_path / "bad.yaml").write_text("run_dir: x\n  steps: [1\n")
    line = expect_user_error(capsys, tmp_path, lambda: train_main(["--config", str(tmp_path / "bad.yaml")]),
                             f"config file {tmp_path / 'bad.yaml'}: not valid YAML")
    assert "line 2" in line  # YAML's multi-line explanation folded into the one line
    (tmp_path / "latin1.yaml").write_bytes("run_dir: caf\xe9\n".encode("latin-1"))
    expect_user_error(capsys, tmp_path, lambda: train_main(["--config", str(tmp_path / "latin1.yaml")]),
                      f"config file {tmp_path / 'latin1.yaml'}: not UTF-8 (invalid continuation byte at byte 12)")
    expect_user_error(capsys, tmp_path, lambda: train_main([]),
                      "gdpo-train: the following arguments are required: --config (see gdpo-train --help)")
    expect_user_error(capsys, tmp_path, lambda: cli_main(["trian", "--config", CONFIG]),
                      "python -m gdpo_megatron: expected a command, one of train, eval, convert, plan, doctor, plot; "
                      "got 'trian'")


def test_the_module_lists_its_commands_on_help():
    """``python -m gdpo_megatron --help``: status 0, one line per console script of setup.py."""
    import re

    scripts = re.findall(r'"gdpo-([a-z]+) = gdpo_megatron\.commands\.([a-z]+):', Path("setup.py").read_text())
    for flag in ("--help", "-h"):
        done = subprocess.run([sys.executable, "-m", "gdpo_megatron", flag], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "GDPO_MALLOC": "system"})
        assert done.returncode == 0 and done.stderr == "", done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == ("usage: python -m gdpo_megatron COMMAND [ARGS ...]   (python -m gdpo_megatron COMMAND "
                            "--help: the command's arguments)")
        listed = [line.split()[0] for line in lines[3:]]
        assert lines[2] == "commands:" and sorted(listed) == sorted(name for name, _ in scripts)
        assert all(line.endswith(f"(gdpo-{name})") for name, line in zip(listed, lines[3:]))


def test_train_paths_that_cannot_be_used(base_model, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "file" / "run"),
                      f"run_dir: cannot create {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file")
    # Permission bits let root write anywhere; /proc still takes no new file, for root or not.
    expect_user_error(capsys, tmp_path, train(base_model, "/proc/x"), "error: run_dir: cannot write /proc/x: ")
    expect_user_error(capsys, tmp_path, train(tmp_path / "no_model", tmp_path / "run"),
                      f"base_model: {tmp_path / 'no_model'} is not a directory")
    no_template = tmp_path / "no_template"
    shutil.copytree(base_model, no_template)
    (no_template / "chat_template.jinja").unlink()
    expect_user_error(capsys, tmp_path, train(no_template, tmp_path / "run"),
                      "has no chat_template; set tokenizer.chat_template to a Jinja template")


def test_train_data_file_mistakes(base_model, tmp_path, capsys):
    lines = Path("examples/data/tool_demo.jsonl").read_bytes().splitlines(keepends=True)[:3]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(lines[0] + '{"prompt": "caf\xe9", "tool_calls": []}\n'.encode("latin-1") + lines[2])
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", f"data.train_path={latin1}"),
                      f"data.train_path: {latin1}:2: not UTF-8 text (byte 0xe9 at column 16)")
    schema = tmp_path / "schema.jsonl"
    record = json.loads(lines[2])
    del record["tool_calls"]
    schema.write_bytes(lines[0] + lines[1] + json.dumps(record).encode() + b"\n")
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", f"data.train_path={schema}"),
                      f"data.train_path: {schema}:3: missing the tool ground truth 'tool_calls' "
                      "(or set data.ground_truth_key)")
    assert not (tmp_path / "run").exists()


def test_train_reward_file_that_fails_to_import(base_model, tmp_path, capsys):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("from gdpo_megatron.rewards import register_reward\n1 / 0\n")
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", f"rewards.reward_files=[{rewards}]"),
                      f"rewards.reward_files.0: importing {rewards} failed: ZeroDivisionError: division by zero")


def test_train_base_model_with_a_truncated_weights_file(base_model, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(base_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    expect_user_error(capsys, tmp_path, train(broken, tmp_path / "run"),
                      f"base_model: {weights}: not a readable safetensors file (Error while deserializing header: "
                      "incomplete metadata, file not fully covered)")
    assert not (tmp_path / "run").exists()


def test_train_run_directory_with_checkpoints(base_model, tmp_path, capsys):
    step = tmp_path / "run" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", "checkpoint.resume=false"),
                      "checkpoint.resume: false, but")
    (step / "trainer_state.json").write_text(json.dumps(
        {"step": 3, "data_position": 24, "config": {}, "world_size": 1}))
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", "data.prompts_per_step=4"),
                      "data.prompts_per_step: the checkpoint of step 3 was taken after 24 prompts, this config "
                      "would resume after 12")
    (step / "trainer_state.json").write_text(json.dumps(
        {"step": 3, "data_position": 24, "config": {}, "world_size": 2, "optimizer_sharding": "dp_reshardable",
         "layout": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}}))
    distributed = train(base_model, tmp_path / "run", "policy.optim.use_distributed_optimizer=true")
    expect_user_error(capsys, tmp_path, distributed,
                      f"{step}: the distributed optimizer's state was saved in megatron-core's dp_reshardable format, "
                      "which reloads under another data-parallel size only, and this run changes "
                      "tensor_model_parallel_size=2 -> 1")


@pytest.fixture
def nothing_heavy(monkeypatch):
    """Fail at the first trainer, model, engine or demo warm-up: the mistake must be caught before them."""
    with warnings.catch_warnings():  # a first import's warnings would land in the captured stderr
        warnings.simplefilter("ignore")
        import gdpo_megatron.demo.warmup
        import gdpo_megatron.commands.train
        import gdpo_megatron.evaluate
        import gdpo_megatron.policy.model

    def tripwire(what):
        def reached(*args, **kwargs):
            raise AssertionError(f"{what} started: the mistake was not caught up front")
        return reached

    monkeypatch.setattr(gdpo_megatron.commands.train, "run", tripwire("the trainer"))
    monkeypatch.setattr(gdpo_megatron.evaluate, "evaluate", tripwire("the vLLM engine"))
    monkeypatch.setattr(gdpo_megatron.policy.model, "build_model", tripwire("a model build"))
    monkeypatch.setattr(gdpo_megatron.demo.warmup, "make_base_model", tripwire("the demo's base model warm-up"))


@pytest.mark.parametrize("override, message", [
    ("rewards.rewards=[{name: x", "override 'rewards.rewards=[{name: x': not valid YAML"),
    ("policy.optim.lr=.inf", "policy.optim.lr: expected a finite number, got inf"),
    ("policy.optim.lr=1e400", "policy.optim.lr: expected a finite number, got '1e400'"),
    ("advantage.conditions.0.threshold=.nan", "advantage.conditions.0.threshold: expected a finite number, got nan"),
    ("advantage.conditions.0.fill=-.inf", "advantage.conditions.0.fill: expected a finite number, got -inf"),
    ("rollout.temperature=.inf", "rollout.temperature: expected a finite number, got inf"),
    ("policy.loss.kl_coef=.inf", "policy.loss.kl_coef: expected a finite number, got inf"),
    ("policy.optim.adam_beta1=1.5", "policy.optim.adam_beta1: expected in [0, 1), got 1.5"),
    ("policy.optim.adam_beta2=-0.1", "policy.optim.adam_beta2: expected in [0, 1), got -0.1"),
    ("policy.optim.weight_decay=-1", "policy.optim.weight_decay: expected >= 0, got -1.0"),
    ("policy.optim.adam_eps=-1e-8", "policy.optim.adam_eps: expected > 0, got -1e-08"),
    ("run_dir=", "run_dir: expected a path, got ''"),
    ("base_model=", "base_model: expected a path, got ''"),
    ("data.train_path=", "data.train_path: expected a path, got ''"),
    ("policy.temperature=0.5", "policy.temperature: unknown key (expected one of: loss, micro_batch_size, "
                               "micro_batch_tokens, model, offload_grads_and_optimizer, old_logprobs, optim, parallel, "
                               "ppo_epochs, precision)"),
    ("data.split=test", "data.train_path: dataset examples/data/tool_demo.jsonl: split 'test' was asked for, but "
                        "a file has no splits"),
    ("rewards.rewards.2.kwargs={max_tokens: -5}", "rewards.rewards.2.kwargs: length: max_tokens must be a positive "
                                                  "integer, got -5"),
    ("rewards.rewards.2.kwargs={max_tokens: many}", "rewards.rewards.2.kwargs: length: max_tokens must be a positive "
                                                    "integer, got 'many'"),
    ("rewards.sandbox_python=python3", "rewards.sandbox_python: expected the absolute path of a Python interpreter, "
                                       "or null, got 'python3'"),
    ("rewards.sandbox_python=/nonexistent/bin/python3", "rewards.sandbox_python: expected a Python interpreter the "
     "sandbox's programs can run, got '/nonexistent/bin/python3': no such file"),
    pytest.param("policy.precision.fp8=e4m3", "policy.precision.fp8='e4m3': FP8 needs a CUDA GPU; use fp8: null on CPU",
                 marks=WITHOUT_CUDA),
    pytest.param("policy.precision.transformer_engine=true", "policy.precision.transformer_engine: the Transformer "
                 "Engine spec needs CUDA", marks=WITHOUT_CUDA),
])
def test_train_settings_refused_before_the_trainer(base_model, tmp_path, capsys, nothing_heavy, override, message):
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", override), message)
    assert not (tmp_path / "run").exists()


def test_train_reward_kwargs_of_other_rewards(base_model, tmp_path, capsys, nothing_heavy):
    math = ["data.family=math", "data.train_path=examples/data/math.jsonl", "advantage.conditions=[]"]
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", *math,
                                              "rewards.rewards=[{name: toolrl_correctness, kwargs: {matching: best}}]"),
                      "rewards.rewards.0.kwargs: toolrl_correctness: matching must be one of ('greedy', 'optimal'), "
                      "got 'best'")
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", *math,
                                              "rewards.rewards=[{name: code_pass, kwargs: {limits: {cpu: 1}}}]"),
                      "rewards.rewards.0.kwargs: code_pass: limits: unknown key 'cpu'")


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path_factory):
    """A machine without bubblewrap: none on PATH, and the sandbox probed again (and after)."""
    from gdpo_megatron.rewards import sandbox

    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("bin")))
    sandbox.isolation.cache_clear()
    yield
    sandbox.isolation.cache_clear()


CODE = ["data.family=code", "data.train_path=examples/data/code.jsonl", "data.prompts_per_step=4",
        "advantage.conditions=[]",
        "rewards.rewards=[{name: code_pass}, {name: length, kwargs: {max_tokens: 50}}]"]
NO_SANDBOX = ("run model-written code, and the strong sandbox cannot run here: bubblewrap (bwrap) is not installed; "
              "install or allow bubblewrap (docs/rewards.md), or ")


def test_train_code_rewards_without_bubblewrap_need_the_opt_in(base_model, tmp_path, capsys, nothing_heavy, no_bwrap):
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", *CODE),
                      "rewards.rewards: code_pass runs model-written code, and the strong sandbox cannot run here: "
                      "bubblewrap (bwrap) is not installed; install or allow bubblewrap (docs/rewards.md), or set "
                      "rewards.allow_weaker_sandbox=true to accept the weaker 'basic' level")
    # Opted in, the sandbox stops nothing: the next check does.
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", *CODE, "rewards.allow_weaker_sandbox=true",
                                              "data.max_prompt_tokens=5"),
                      "data.max_prompt_tokens: 5 prompt(s) of examples/data/code.jsonl are longer than 5 tokens")
    assert not (tmp_path / "run").exists()


def test_train_config_file_with_a_duplicate_key(base_model, tmp_path, capsys, nothing_heavy):
    config = tmp_path / "config.yaml"
    config.write_text(Path(CONFIG).read_text() + "\nsteps: 2\n")
    line = Path(CONFIG).read_text().splitlines().index("steps: 40") + 1
    expect_user_error(capsys, tmp_path, lambda: train_main(["--config", str(config), f"base_model={base_model}",
                                                            f"run_dir={tmp_path / 'run'}"]),
                      f"config file {config}: line {Path(CONFIG).read_text().count(chr(10)) + 2}: duplicate key 'steps' "
                      f"(first at line {line})")


def test_train_chat_template_that_fails(base_model, tmp_path, capsys, nothing_heavy):
    model = tmp_path / "model"
    shutil.copytree(base_model, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    expect_user_error(capsys, tmp_path, train(model, tmp_path / "run"),
                      f"base_model: the chat template of {model} cannot render the prompt 'tool-demo-7-0' "
                      "(TemplateSyntaxError: unexpected '}')")
    (model / "chat_template.jinja").write_text("{{ raise_exception('System role not supported') }}")
    expect_user_error(capsys, tmp_path, train(model, tmp_path / "run"),
                      f"base_model: the chat template of {model} cannot render the prompt 'tool-demo-7-0' "
                      "(TemplateError: System role not supported)")


def test_train_reward_files_that_exit_or_register_no_function(base_model, tmp_path, capsys, nothing_heavy):
    rewards = tmp_path / "my_rewards.py"
    use = f"rewards.reward_files=[{rewards}]"
    rewards.write_text("import sys\nsys.exit('usage: my_rewards.py DATA')\n")  # a script that exits when imported
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", use),
                      f"rewards.reward_files.0: importing {rewards} failed: SystemExit: usage: my_rewards.py DATA")
    rewards.write_text("import sys\nsys.exit()\n")
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", use),
                      f"rewards.reward_files.0: importing {rewards} failed: SystemExit")
    other = tmp_path / "other_rewards.py"
    other.write_text("from gdpo_megatron.rewards import register_reward\nregister_reward('mine')(5)\n")
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", f"rewards.reward_files=[{other}]",
                                              "rewards.rewards.0.name=mine"),
                      f"rewards.reward_files.0: importing {other} failed: ValueError: reward 'mine': expected a "
                      "function, got 5")


WRONG_SIGNATURES = """from gdpo_megatron.rewards import register_reward


@register_reward("cli_two_arguments")
def two_arguments(completion, ground_truth):
    return 1.0


@register_reward("cli_needs_scale")
def needs_scale(completion, num_tokens, ground_truth, scale):
    return scale
"""


def test_train_reward_whose_function_is_no_reward_is_named_with_its_signature(base_model, tmp_path, capsys,
                                                                              nothing_heavy):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(WRONG_SIGNATURES)
    lines = WRONG_SIGNATURES.splitlines()  # Python places a decorated function at its first decorator
    line_of = {name: lines.index(f'@register_reward("{name}")') + 1 for name in ("cli_two_arguments", "cli_needs_scale")}
    module = f"gdpo_megatron_user_rewards.my_rewards_{hashlib.sha1(str(rewards).encode()).hexdigest()[:12]}"
    use = [f"rewards.reward_files=[{rewards}]", "advantage.conditions=[]"]
    # The function cannot take a reward's arguments: the reward (by its name key) and its
    # definition are at fault, not its (empty) kwargs.
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", *use,
                                              "rewards.rewards=[{name: tool_format}, {name: cli_two_arguments}]"),
                      f"rewards.rewards.1.name: reward 'cli_two_arguments' is {module}.two_arguments(completion, "
                      f"ground_truth) ({rewards}:{line_of['cli_two_arguments']}), "
                      "which cannot be called as a reward, fn(completion, num_tokens, ground_truth, **kwargs): too "
                      "many positional arguments")
    # A parameter the config's kwargs must give: the kwargs are at fault.
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", *use,
                                              "rewards.rewards=[{name: tool_format}, {name: cli_needs_scale}]"),
                      f"rewards.rewards.1.kwargs: reward 'cli_needs_scale': kwargs {{}} do not fit {module}.needs_scale"
                      f"(completion, num_tokens, ground_truth, scale) ({rewards}:"
                      f"{line_of['cli_needs_scale']}): missing a "
                      "required argument: 'scale'")


def test_train_data_whose_rows_are_all_left_out(base_model, tmp_path, capsys, nothing_heavy):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": ""}\n{"prompt": "2 + 2?", "answer": null}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the line says why; no warning besides it
        expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", f"data.train_path={data}",
                                                  "data.family=math", "rewards.rewards=[{name: math_correctness}]",
                                                  "advantage.conditions=[]"),
                          f"data.train_path: dataset {data} has no samples: left out 2 of 2 rows, empty answer: "
                          "lines 1, 2")


def as_qwen2_with_head_dim(base_model, tmp_path, head_dim: int) -> Path:
    """A copy of ``base_model`` whose config.json is a Qwen2 one with an explicit ``head_dim``."""
    model = tmp_path / "qwen2"
    shutil.copytree(base_model, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", head_dim=head_dim)
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_a_qwen2_head_dim_that_vllm_ignores_is_refused_up_front(base_model, tmp_path, capsys, nothing_heavy):
    config = json.loads((Path(base_model) / "config.json").read_text())
    split = config["hidden_size"] // config["num_attention_heads"]
    model = as_qwen2_with_head_dim(base_model, tmp_path, split // 2)
    message = (f"config.json head_dim: vLLM's Qwen2 uses hidden_size / num_attention_heads = {split} and cannot "
               f"load head_dim={split // 2}")
    expect_user_error(capsys, tmp_path, train(model, tmp_path / "run"), f"base_model: {message}")
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(model), "--bfcl"]), f"--model: {message}")


def copy_with_tensor(base_model, tmp_path, name: str, change) -> Path:
    """A copy of ``base_model`` whose tensor ``name`` is replaced by ``change(tensor)``."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(base_model, model)
    tensors = load_file(model / "model.safetensors")
    tensors[name] = change(tensors[name])
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_train_base_model_with_weights_of_the_wrong_shape(base_model, tmp_path, capsys, nothing_heavy):
    model = copy_with_tensor(base_model, tmp_path, "model.norm.weight", lambda _: torch.zeros(64))
    expect_user_error(capsys, tmp_path, train(model, tmp_path / "run"),
                      f"base_model: {model / 'model.safetensors'}: tensor 'model.norm.weight' has shape [64], "
                      "config.json gives [128]")


def write_checkpoint(step_dir: Path, state: dict, manifest: dict | None = None) -> None:
    """The cheap parts of a checkpoint: its trainer state and (optionally) its manifest."""
    step_dir.mkdir(parents=True)
    (step_dir / "trainer_state.json").write_text(json.dumps(state))
    if manifest is not None:
        (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_train_run_directory_that_cannot_be_resumed(base_model, tmp_path, capsys, nothing_heavy):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    expect_user_error(capsys, tmp_path, train(base_model, run),
                      f"run_dir: {run / 'checkpoints'} is a file, not a directory")
    (run / "checkpoints").unlink()

    step = run / "checkpoints" / "step_0"
    write_checkpoint(step, {"step": 0, "data_position": None, "config": {}, "world_size": 1})  # gdpo-convert's
    expect_user_error(capsys, tmp_path, train(base_model, run),
                      f"run_dir: {step} is not a training checkpoint (it has no data position; gdpo-convert "
                      "writes such); choose another run_dir")
    shutil.rmtree(step)

    config = json.loads((Path(base_model) / "config.json").read_text())
    other = {"vocab_size": 512, "hidden_size": 64, "ffn_hidden_size": 128, "num_layers": 1, "num_attention_heads": 1}
    write_checkpoint(step, {"step": 0, "data_position": 0, "config": {"policy": {"model": other}}, "world_size": 1})
    expect_user_error(capsys, tmp_path, train(base_model, run),
                      f"run_dir: {step} holds a model of another shape: hidden_size={other['hidden_size']} "
                      f"(base_model: {config['hidden_size']}), ffn_hidden_size=128 (base_model: 256), num_layers=1 "
                      "(base_model: 2), num_attention_heads=1 (base_model: 2); choose another run_dir")
    shutil.rmtree(step)

    write_checkpoint(step, 5)
    expect_user_error(capsys, tmp_path, train(base_model, run),
                      f"{step / 'trainer_state.json'}: expected a JSON object, got int")
    shutil.rmtree(step)

    state = {"step": 0, "data_position": 0, "config": {}, "world_size": 1}
    write_checkpoint(step, state, {"trainer_state.json": {"size": len(json.dumps(state)), "crc32": 0},
                                   "dist/__0_0.distcp": {"size": 100, "crc32": 0}})
    expect_user_error(capsys, tmp_path, train(base_model, run),
                      f"{step / 'dist' / '__0_0.distcp'}: missing from the checkpoint")


# ---- the convention itself ----------------------------------------------------------------------


def test_debug_shows_the_traceback_and_other_ranks_stay_quiet(base_model, tmp_path, capsys, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    assert train_main(["--config", CONFIG, "--debug", "foo=1"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("error: foo: unknown key (expected one of: advantage, "
                                                        "base_model, checkpoint, data, distributed, environment, "
                                                        "logging, policy, rewards, rollout, run_dir, seed, steps)\n")
    monkeypatch.setenv("GDPO_DEBUG", "1")
    assert train_main(["--config", CONFIG, "foo=1"]) == EXIT_USER_ERROR
    assert "Traceback" in capsys.readouterr().err

    monkeypatch.delenv("GDPO_DEBUG")
    monkeypatch.setattr(console, "TORCHRUN_GRACE_S", 0.0)  # no rank 0 here to wait for
    for rank_variable in ("RANK", "SLURM_PROCID"):  # torchrun's and srun's rank 1
        monkeypatch.setenv(rank_variable, "1")
        error_file = tmp_path / f"error-{rank_variable}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert train_main(["--config", CONFIG, "foo=1"]) == EXIT_USER_ERROR
        assert capsys.readouterr() == ("", "")
        # What torchrun's report shows as this rank's failure, read the way torchrun reads it.
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(error_file))
        assert failure.message["extraInfo"]["py_callstack"].startswith("error: foo: unknown key")
        assert failure.timestamp > 0
        monkeypatch.delenv(rank_variable)


def test_a_bug_keeps_its_traceback():
    @console_entry
    def buggy(argv):
        return {}["missing"]

    with pytest.raises(KeyError, match="missing"):
        buggy([])


@pytest.mark.slow  # torchrun and two workers importing torch: ~15 s, more on a loaded machine
def test_torchrun_prints_the_line_once_and_reports_it_as_the_root_cause(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "gdpo_megatron", "train", "--config", CONFIG, f"run_dir={tmp_path / 'run'}",
         "rollout.group_size=1"],
        env=env, capture_output=True, text=True, timeout=300)
    message = "error: rollout.group_size: expected >= 2"
    assert run.returncode != 0
    printed = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(printed) == 1 and printed[0].startswith(message), run.stderr[-3000:]
    root_cause = run.stderr.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {message}" in root_cause and "exitcode  : 2" in root_cause
    assert not (tmp_path / "run").exists()


# ---- gdpo-eval ----------------------------------------------------------------------------------


def test_eval_argument_mistakes(base_model, tmp_path, capsys):
    model = ["--model", str(base_model)]
    expect_user_error(capsys, tmp_path, lambda: eval_main([*model, "--bfcl", "--limit", "-1"]),
                      "gdpo-eval: argument --limit: expected an integer >= 1, got -1 (see gdpo-eval --help)")
    expect_user_error(capsys, tmp_path, lambda: eval_main([*model, "--bfcl", "--rewards", "tool_format,nope_reward"]),
                      "--rewards: 'nope_reward' is not a registered reward")
    expect_user_error(capsys, tmp_path, lambda: eval_main([*model, "--bfcl", "--max-model-len", "4096"]),
                      "--max-model-len: expected <= 1024, the model's max_position_embeddings, got 4096")
    expect_user_error(capsys, tmp_path, lambda: eval_main([*model, "--data", "examples/data/tool.jsonl"]),
                      "gdpo-eval: --data needs --family")
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(tmp_path / "none"), "--bfcl"]),
                      f"--model: {tmp_path / 'none'} is not a directory")
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / "file" / "m.json")
    expect_user_error(capsys, tmp_path, lambda: eval_main([*model, "--bfcl", "--out", out]),
                      f"--out: cannot create {tmp_path / 'file' / 'm.json'}: {tmp_path / 'file'} is a file")


def test_eval_context_defaults_to_the_models_positions(base_model):
    config = json.loads((Path(base_model) / "config.json").read_text())
    assert config["max_position_embeddings"] == 1024
    assert _max_model_len(config, None, 256) == 1024
    assert _max_model_len(config, 512, 256) == 512


def test_eval_checks_prompts_and_tokenizer_before_the_engine(base_model, tmp_path, capsys, nothing_heavy):
    data = ["--data", "examples/data/tool_demo.jsonl", "--family", "tool"]
    model = tmp_path / "model"
    shutil.copytree(base_model, model)
    (model / "chat_template.jinja").unlink()
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(model), *data]),
                      "--model: tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(model), *data]),
                      f"--model: cannot load the tokenizer of {model}")
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(base_model), *data, "--max-model-len", "300",
                                                           "--max-new-tokens", "290", "--limit", "4"]),
                      "--max-model-len: none of the 4 prompts fits in 300 tokens with --max-new-tokens=290 "
                      "(the shortest has")


def test_eval_code_rewards_without_bubblewrap_need_the_opt_in(base_model, tmp_path, capsys, nothing_heavy, no_bwrap):
    code = ["--model", str(base_model), "--data", "examples/data/code.jsonl", "--family", "code",
            "--rewards", "code_pass,code_no_bug", "--max-model-len", "300", "--max-new-tokens", "299"]
    expect_user_error(capsys, tmp_path, lambda: eval_main(code),
                      f"--rewards: code_pass, code_no_bug {NO_SANDBOX}pass --allow-weaker-sandbox to accept the weaker "
                      "'basic' level")
    expect_user_error(capsys, tmp_path, lambda: eval_main([*code, "--allow-weaker-sandbox"]),
                      "--max-model-len: none of the 5 prompts fits in 300 tokens with --max-new-tokens=299")


@pytest.mark.parametrize("option", [["--family", "math"], ["--prompt-key", "question"], ["--system-key", "s"],
                                    ["--ground-truth-key", "g"], ["--system-prompt", ""], ["--split", "test"]])
def test_eval_data_options_need_data(base_model, tmp_path, capsys, nothing_heavy, option):
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(base_model), "--bfcl", *option]),
                      f"gdpo-eval: {option[0]} goes with --data, not --bfcl (see gdpo-eval --help)")


@pytest.mark.parametrize("option, override", [(["--family", "nope"], "data.family=nope"),
                                              (["--family", "tool", "--prompt-key", "a..b"], "data.prompt_key=a..b")])
def test_eval_data_options_are_checked_as_the_configs_data_section(base_model, tmp_path, capsys, nothing_heavy,
                                                                    option, override):
    """--data and its options are the data section: a bad value gets the message gdpo-train gives for it."""
    from gdpo_megatron.config import ConfigError, TrainConfig, load_config
    from gdpo_megatron.preflight.validation import training_prompts

    with pytest.raises(ConfigError) as in_training:
        training_prompts(load_config(TrainConfig, CONFIG, [override]))
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(base_model), "--data",
                                                           "examples/data/tool_demo.jsonl", *option]),
                      str(in_training.value))


def test_eval_split_of_a_file(base_model, tmp_path, capsys, nothing_heavy):
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(base_model), "--data",
                                                           "examples/data/tool_demo.jsonl", "--family", "tool",
                                                           "--split", "test"]),
                      "--data: dataset examples/data/tool_demo.jsonl: split 'test' was asked for, but a file has "
                      "no splits")


def test_eval_kv_cache_holds_one_whole_context(base_model, tmp_path, capsys, nothing_heavy):
    hf = json.loads((Path(base_model) / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4  # fp32 K and V
    least = (512 // 32 + 1) * 32 * per_token / 2**30  # 512 tokens in CPU blocks of 32, and the block vLLM keeps
    expect_user_error(capsys, tmp_path, lambda: eval_main(["--model", str(base_model), "--bfcl", "--max-model-len",
                                                           "512", "--kv-cache-gib", "0.0001"]),
                      f"--kv-cache-gib: 0.0001 holds less than one sequence of --max-model-len 512 tokens, which the "
                      f"engine needs ({least:.3g} GiB); give at least that or a shorter --max-model-len")


# ---- gdpo-convert -------------------------------------------------------------------------------


def test_convert_refuses_a_missing_step_and_a_non_empty_output(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (7, 0, 3):
        (root / f"step_{step}").mkdir(parents=True)
    expect_user_error(capsys, tmp_path, lambda: convert_main(["megatron-to-hf", str(root), str(tmp_path / "hf"),
                                                              "--step", "5"]),
                      f"--step: no step 5 in {root}; steps: 0, 3, 7")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    expect_user_error(capsys, tmp_path, lambda: convert_main(["megatron-to-hf", str(root), str(tmp_path / "hf")]),
                      f"OUT_DIR: {tmp_path / 'hf'} exists and is not empty; give a new or empty directory")
    expect_user_error(capsys, tmp_path, lambda: convert_main(["megatron-to-hf", str(tmp_path / "none"),
                                                              str(tmp_path / "out")]),
                      f"CHECKPOINT_ROOT: {tmp_path / 'none'} is not a directory")


def test_convert_names_the_unreadable_shard(base_model, tmp_path, capsys):
    import transformers

    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(base_model).save_pretrained(sharded, max_shard_size="300KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2
    capsys.readouterr()  # transformers' progress bars
    convert = lambda: convert_main(["hf-to-megatron", str(sharded), str(tmp_path / "megatron")])  # noqa: E731
    shards[1].write_bytes(shards[1].read_bytes()[:100])
    expect_user_error(capsys, tmp_path, convert, f"HF_DIR: {shards[1]}: not a readable safetensors file")
    shards[1].unlink()
    expect_user_error(capsys, tmp_path, convert,
                      f"HF_DIR: {shards[1]}: missing (listed in {sharded / 'model.safetensors.index.json'})")


def test_convert_checks_the_model_before_building_it(base_model, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(base_model, model)
    out = tmp_path / "megatron"
    expect_user_error(capsys, tmp_path, lambda: convert_main(["hf-to-megatron", str(model), str(out), "--tp", "3"]),
                      "--tp/--pp: model.num_attention_heads: expected a multiple of "
                      "parallel.tensor_model_parallel_size=3, got 2")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    expect_user_error(capsys, tmp_path, lambda: convert_main(["hf-to-megatron", str(model), str(out)]),
                      "HF_DIR: config.json architectures: expected one of ['LlamaForCausalLM', 'Qwen2ForCausalLM'], "
                      "got ['MistralForCausalLM']")
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "step_0").mkdir()
    expect_user_error(capsys, tmp_path, lambda: convert_main(["hf-to-megatron", str(base_model), str(out)]),
                      f"CHECKPOINT_ROOT: {out} exists and is not empty")


def test_convert_checks_the_checkpoint_and_tokenizer_before_building(base_model, tmp_path, capsys, nothing_heavy):
    root = tmp_path / "checkpoints"
    state = {"step": 0, "data_position": None, "world_size": 1,
             "config": {"model": {"vocab_size": 512, "hidden_size": 128, "ffn_hidden_size": 256, "num_layers": 2,
                                  "num_attention_heads": 2}}}
    write_checkpoint(root / "step_0", state, {"dist/__0_0.distcp": {"size": 100, "crc32": 0}})
    convert = lambda *extra: lambda: convert_main(["megatron-to-hf", str(root), str(tmp_path / "hf"), *extra])  # noqa: E731
    expect_user_error(capsys, tmp_path, convert(), f"{root / 'step_0' / 'dist' / '__0_0.distcp'}: missing from the "
                                                   "checkpoint")
    (root / "step_0" / "manifest.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    expect_user_error(capsys, tmp_path, convert("--tokenizer", str(tmp_path / "empty")),
                      f"--tokenizer: {tmp_path / 'empty'} holds no tokenizer files (expected some of tokenizer.json, "
                      "tokenizer_config.json,")


def test_convert_weights_of_the_wrong_shape(base_model, tmp_path, capsys, nothing_heavy):
    model = copy_with_tensor(base_model, tmp_path, "model.layers.1.mlp.down_proj.weight", lambda t: t.T.contiguous())
    expect_user_error(capsys, tmp_path, lambda: convert_main(["hf-to-megatron", str(model), str(tmp_path / "out")]),
                      f"HF_DIR: {model / 'model.safetensors'}: tensor 'model.layers.1.mlp.down_proj.weight' has shape "
                      "[256, 128], config.json gives [128, 256]")


# ---- gdpo-plot ----------------------------------------------------------------------------------


def test_plot_mistakes(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS_FILE).write_text('{"step": 1, "reward/a/mean": 0.5}\n{"reward/a/mean": 0.7}\n'
                                    '{"step": 3, "reward/a/mean": 0.9}\n')
    expect_user_error(capsys, tmp_path, lambda: plot_main([str(run)]),
                      f"{run / METRICS_FILE}:2: expected a JSON object with an integer 'step', got "
                      "'{\"reward/a/mean\": 0.7}'")
    expect_user_error(capsys, tmp_path, lambda: plot_main([str(tmp_path / "none")]),
                      f"{tmp_path / 'none' / METRICS_FILE}: no metrics file")
    expect_user_error(capsys, tmp_path, lambda: plot_main([str(run), "--labels", "a", "b"]),
                      "labels: expected 1 labels, got 2")


def test_plot_labels_and_outputs(tmp_path, capsys):
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run.mkdir()
        (run / METRICS_FILE).write_text('{"step": 1, "reward/a/mean": 0.5}\n')
    expect_user_error(capsys, tmp_path, lambda: plot_main([*map(str, runs), "--labels"]),
                      "gdpo-plot: argument --labels: expected at least one argument (see gdpo-plot --help)")
    (runs[0] / "rewards.png").mkdir()
    expect_user_error(capsys, tmp_path, lambda: plot_main([str(runs[0])]),
                      f"RUN_DIR: {runs[0] / 'rewards.png'} is a directory (expected a file name)")


# ---- gdpo-plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize("option, message", [
    (["--gpu-memory", "inf"], "--gpu-memory: expected a finite number > 0 GiB, got inf"),
    (["--overhead", "inf"], "--overhead: expected a finite number >= 0 GiB, got inf"),
])
def test_plan_infinite_sizes(tmp_path, capsys, option, message):
    from gdpo_megatron.commands.plan import main as plan_main

    args = ["--config", "configs/gdpo_7b.yaml", "--gpus-per-node", "8", "--gpu-memory", "80"]
    expect_user_error(capsys, tmp_path, lambda: plan_main([*args, *option]), message)


# ---- python -m gdpo_megatron.demo ---------------------------------------------------------------


def test_demo_mistakes_are_one_line_before_the_warm_up(base_model, tmp_path, capsys, nothing_heavy):
    from gdpo_megatron.demo.__main__ import main as demo_main

    paths = [f"base_model={tmp_path / 'base'}", f"run_dir={tmp_path / 'run'}"]
    expect_user_error(capsys, tmp_path, lambda: demo_main(["fooo=1"]),
                      "fooo: unknown key (expected one of: advantage,")
    expect_user_error(capsys, tmp_path, lambda: demo_main(["rollout.group_size"]),
                      "override 'rollout.group_size': expected key.sub=value")
    expect_user_error(capsys, tmp_path, lambda: demo_main([*paths, "data.train_path=nowhere.jsonl"]),
                      "data.train_path: nowhere.jsonl does not exist")
    (tmp_path / "file").write_text("x")
    expect_user_error(capsys, tmp_path, lambda: demo_main([f"base_model={tmp_path / 'base'}",
                                                           f"run_dir={tmp_path / 'file'}"]),
                      f"run_dir: {tmp_path / 'file'} is a file, not a directory")
    expect_user_error(capsys, tmp_path, lambda: demo_main([*paths, "rewards.rewards.0.name=nope"]),
                      "rewards.rewards.0.name: 'nope' is not a registered reward")
