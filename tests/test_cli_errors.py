"""Every user mistake at the console gets one line naming the key or file, status 2, and writes nothing.

The entry points run in this process (no engine, no process group starts); one case goes
through torchrun for real, where the line must appear once and be torchrun's root cause.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gdpo_megatron.checkpoint.convert_cli import main as convert_main
from gdpo_megatron.cli import main as cli_main
from gdpo_megatron.cli import plot_main, train_main
from gdpo_megatron import errors
from gdpo_megatron.errors import EXIT_USER_ERROR, console_entry
from gdpo_megatron.evaluate import _max_model_len
from gdpo_megatron.evaluate import main as eval_main
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
    ("data.family=poetry", "data.family: expected one of ('math', 'tool', 'code', 'toolrl'), got 'poetry'"),
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
    ("rewards.reward_files=[nowhere.py]", "rewards.reward_files.0: nowhere.py does not exist"),
])
def test_train_config_mistakes(base_model, tmp_path, capsys, override, message):
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "run", override), message)
    assert not (tmp_path / "run").exists()


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
                      "python -m gdpo_megatron.cli: expected a command, one of train, plot; got 'trian'")


def test_train_paths_that_cannot_be_used(base_model, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    expect_user_error(capsys, tmp_path, train(base_model, tmp_path / "file" / "run"),
                      f"run_dir: cannot create {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file")
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


# ---- the convention itself ----------------------------------------------------------------------


def test_debug_shows_the_traceback_and_other_ranks_stay_quiet(base_model, tmp_path, capsys, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    assert train_main(["--config", CONFIG, "--debug", "foo=1"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("error: foo: unknown key (expected one of: advantage, "
                                                        "base_model, checkpoint, data, dynamic_sampling, logging, "
                                                        "policy, rewards, rollout, run_dir, seed, steps)\n")
    monkeypatch.setenv("GDPO_DEBUG", "1")
    assert train_main(["--config", CONFIG, "foo=1"]) == EXIT_USER_ERROR
    assert "Traceback" in capsys.readouterr().err

    monkeypatch.delenv("GDPO_DEBUG")
    monkeypatch.setattr(errors, "TORCHRUN_GRACE_S", 0.0)  # no rank 0 here to wait for
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
         "-m", "gdpo_megatron.cli", "train", "--config", CONFIG, f"run_dir={tmp_path / 'run'}",
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
