"""A run directory through gdpo-train as a user meets it: a new run and its summary, a finished
run rerun, another config refused, a forced resume, Ctrl-C, SIGTERM during a long step, and
metrics after a crash."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from reference_run import CONFIG, ROOT, make_base
from support.metrics_file import records, steps_so_far

pytestmark = pytest.mark.slow

GDPO_TRAIN = str(Path(sys.executable).parent / "gdpo-train")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("base") / "model")


def clean_env() -> dict:
    """This process's environment without what vLLM, run in-process by earlier tests, left in it."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}, "OMP_NUM_THREADS": "1",
            "GDPO_MALLOC": "system"}


def train(base, run_dir, *overrides, wait=True):
    command = [GDPO_TRAIN, "--config", str(CONFIG), f"base_model={base}", f"run_dir={run_dir}", *overrides]
    env = clean_env()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process.communicate(timeout=600) + (process.returncode,) if wait else process


def steps_logged(run_dir) -> list[int]:
    return [r["step"] for r in records(run_dir)]


@pytest.fixture(scope="module")
def finished(base, tmp_path_factory):
    """A 3-step run of the reference config, with what it printed."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    out, err, status = train(base, run_dir)
    assert status == 0, err
    return run_dir, out, err


def test_a_new_run_says_so_and_ends_with_where_its_outputs_are(finished):
    run_dir, out, err = finished
    assert f"gdpo-train: a new run in {run_dir}, 3 steps" in err.splitlines()
    assert "Traceback" not in err and "RotaryEmbedding" not in err + out  # known vLLM noise is filtered
    out = out[out.index("gdpo-train: finished\n"):]  # vLLM's own log lines go to stdout too
    assert out.startswith("gdpo-train: finished\nreward means, first 3 steps -> last 3 steps (of 3):")
    for name in ("distinct_chars", "vowel_share"):
        means = [r[f"reward/{name}/mean"] for r in records(run_dir)]
        assert f"  {name:<20} {sum(means) / 3:8.3f} -> {sum(means) / 3:8.3f}" in out  # 3 steps: both windows
    assert "reward failures: none in 48 calls of each reward" in out.splitlines()  # 3 steps x 4 prompts x 4
    for line in (f"checkpoint: {run_dir}/checkpoints/step_3", f"Hugging Face export: {run_dir}/hf",
                 f"metrics: {run_dir}/metrics.jsonl", f"plot: {run_dir}/rewards.png", f"plot: {run_dir}/diagnostics.png"):
        assert line in out.splitlines()
        assert Path(line.split(": ", 1)[1]).exists()


def test_a_finished_run_says_so_and_leaves_its_export(finished, base):
    run_dir, _, _ = finished
    before = {p: p.stat().st_mtime_ns for p in (run_dir / "hf").iterdir()}
    out, err, status = train(base, run_dir)
    assert status == 0 and "gdpo-train" not in out
    assert err.splitlines() == [f"gdpo-train: {run_dir} has finished step 3 of 3: nothing to train (raise steps to "
                                "train on)"]
    assert {p: p.stat().st_mtime_ns for p in (run_dir / "hf").iterdir()} == before


def test_another_config_is_refused_naming_what_differs(finished, base):
    run_dir, _, _ = finished
    _, err, status = train(base, run_dir, "steps=5", "advantage.mode=grpo", "rewards.rewards.1.weight=2")
    assert status == 2
    assert err.splitlines() == [
        f"error: run_dir: {run_dir} holds step 3 of a run with other settings (advantage.mode: 'gdpo' -> 'grpo'; "
        "rewards.rewards.1.weight: 0.5 -> 2.0); choose a new run_dir, or set checkpoint.resume=force to continue "
        "that run under these settings"]
    assert steps_logged(run_dir) == [1, 2, 3]


def test_a_forced_resume_trains_on_under_the_new_settings(finished, base, tmp_path):
    import shutil

    run_dir = tmp_path / "forced"
    shutil.copytree(finished[0], run_dir)
    out, err, status = train(base, run_dir, "steps=4", "advantage.mode=grpo", "checkpoint.resume=force")
    assert status == 0, err
    assert f"gdpo-train: resuming {run_dir} from step 3 of 4" in err.splitlines()
    assert steps_logged(run_dir) == [1, 2, 3, 4]
    state = json.loads((run_dir / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["config"]["advantage"]["mode"] == "grpo"


def test_ctrl_c_saves_after_the_step_and_a_resume_logs_each_step_once(base, tmp_path):
    run_dir = tmp_path / "run"
    long_run = ("steps=1000", "checkpoint.save_every=2")
    # A crash (SIGKILL) after step 3: the newest checkpoint is step 2, metrics.jsonl has step 3 too.
    process = train(base, run_dir, *long_run, wait=False)
    while len(steps_so_far(run_dir)) < 3 and process.poll() is None:
        time.sleep(0.2)
    process.kill()
    process.communicate()
    crashed = steps_so_far(run_dir)
    assert len(crashed) >= 3 and crashed == list(range(1, len(crashed) + 1))
    checkpoint = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))

    # The rerun resumes from that checkpoint; Ctrl-C then ends it after a step, with a checkpoint.
    # Until the rerun has logged a step of its own, metrics.jsonl still holds the crashed run's.
    rerun_logged = max(checkpoint + 2, len(crashed) + 1)
    process = train(base, run_dir, *long_run, wait=False)
    while len(steps_so_far(run_dir)) < rerun_logged and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert f"gdpo-train: resuming {run_dir} from step {checkpoint} of 1000" in err.splitlines()
    assert "gdpo-train: Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)" in (
        err.splitlines())
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    logged = steps_logged(run_dir)
    assert logged == list(range(1, len(logged) + 1))  # every step once, those redone after the crash too
    assert "gdpo-train: stopped by Ctrl-C; rerun the same command to resume\n" in out
    assert f"checkpoint: {run_dir}/checkpoints/step_{logged[-1]}" in out.splitlines()


@pytest.mark.parametrize("timeout, signals, why", [
    (1, 1, "not finished within 1 s (checkpoint.stop_timeout_s)"),
    (600, 2, "interrupted by a second SIGTERM"),
])
def test_sigterm_during_a_long_step_stops_in_bounded_time_without_saving_it(base, tmp_path, timeout, signals, why):
    """Steps of 2048 rollouts, each longer than 1 s: SIGTERM after step 1 ends the run in step 2
    once checkpoint.stop_timeout_s has passed, or at a second SIGTERM, with the status that
    requeues it, its reward workers gone, and step 1's checkpoint the one to resume from."""
    run_dir = tmp_path / "run"
    process = train(base, run_dir, "steps=1000", "data.prompts_per_step=256", "rollout.group_size=8",
                    "policy.micro_batch_size=64", f"checkpoint.stop_timeout_s={timeout}", wait=False)
    while not steps_so_far(run_dir) and process.poll() is None:
        time.sleep(0.05)
    children = psutil.Process(process.pid).children(recursive=True)
    assert children  # the reward workers
    signalled = time.monotonic()
    for _ in range(signals):
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 75, err
    assert time.monotonic() - signalled < 30
    lines = err.splitlines()
    assert (f"gdpo-train: SIGTERM: finishing this step, then saving a checkpoint (if the step finishes within "
            f"{timeout} s, checkpoint.stop_timeout_s; SIGTERM again stops at once)") in lines
    assert (f"gdpo-train: SIGTERM: step 2 {why}: stopped without saving it; rerun the same command to resume from "
            "the last checkpoint, step 1") in lines
    assert "Traceback" not in err
    assert steps_logged(run_dir) == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_1"]
    # Stopped or killed as the trainer exits; a killed process can take a moment to be gone on a loaded machine.
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


MOSTLY_FAILING = """
from gdpo_megatron.rewards.registry import register_reward


@register_reward("none_unless_weather", bounds=(0.0, 1.0))
def none_unless_weather(completion, num_tokens, ground_truth):
    return 1.0 if ground_truth["tool_calls"][0]["name"] == "get_weather" else None
"""


def test_a_reward_that_mostly_fails_is_named_counted_and_warned_about(base, tmp_path):
    """Also: progress into a log file (stderr not a terminal) is plain lines, no carriage returns."""
    (tmp_path / "failing.py").write_text(MOSTLY_FAILING)
    run_dir = tmp_path / "run"
    out, err, status = train(base, run_dir, "logging.progress_bar=true",
                             f"rewards.reward_files=[tests/data/reference_rewards.py, {tmp_path / 'failing.py'}]",
                             "rewards.rewards=[{name: distinct_chars}, {name: vowel_share}, "
                             "{name: none_unless_weather}]")
    assert status == 0, err
    steps = records(run_dir)
    failures = [r["reward/none_unless_weather/failures"] for r in steps]
    # Each failure scores 0 and each success 1: a step's mean is its share of successes.
    assert [16 * (1 - r["reward/none_unless_weather/mean"]) for r in steps] == pytest.approx(failures)
    assert sum(failures) > 24  # tool_demo.jsonl asks for the weather in few of its prompts
    out = out[out.index("gdpo-train: finished\n"):]
    share = sum(failures) / 48
    assert (f"reward failures, of 48 calls each:\n  none_unless_weather  {sum(failures):8.0f} ({share:.0%}), "
            "0 timed out\n") in out
    assert (f"warning: reward none_unless_weather failed on {share:.0%} of its calls: its scores were mostly its "
            "failure value, not a judgment of the completions; the log names each step's first failure of it"
            ) in out.splitlines()
    reports = [line for line in err.splitlines() if line.startswith("reward 'none_unless_weather' failed on ")]
    assert [int(line.split()[4]) for line in reports] == failures
    assert all(re.search(r"the first, sample 'tool-demo-[0-9-]+' \(rollout [0-9]+\): returned None, expected a "
                         r"finite number$", line) for line in reports)
    assert "Traceback" not in err and "\r" not in err
    progress = [line for line in err.splitlines() if line.startswith("gdpo-train: step ")]
    assert progress[0].startswith("gdpo-train: step 1/3, ") and progress[-1].startswith("gdpo-train: step 3/3, ")
    assert len(progress) <= 3 and all(re.fullmatch(
        r"gdpo-train: step [12]/3, [0-9.]+ s/step, about [0-9]+:[0-5][0-9] left; distinct_chars [0-9.]+, "
        r"vowel_share [0-9.]+, none_unless_weather [0-9.]+", line) for line in progress[:-1])
    assert re.fullmatch(r"gdpo-train: step 3/3, [0-9.]+ s/step; distinct_chars [0-9.]+, vowel_share [0-9.]+, "
                        r"none_unless_weather [0-9.]+", progress[-1])


def test_ctrl_c_during_start_up_stops_it(base, tmp_path):
    run_dir = tmp_path / "run"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's background job is started
    try:
        process = train(base, run_dir, wait=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert process.stderr.readline() == f"gdpo-train: a new run in {run_dir}, 3 steps\n"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "second Ctrl-C" not in err and "Traceback" not in err
    assert (err.splitlines()[-1] == "gdpo-train: stopped by Ctrl-C during start-up, before any step; rerun the same "
            "command to start the run")
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()

    # Once the trainer holds the signals and its reward workers run (the forkserver and two
    # workers: their start ignores the signals Slurm sends every process), the run stops before
    # its first step rather than training one; on a busy machine a step may have begun by the
    # time this test looks, and the run then stops after it, as a Ctrl-C in a step does.
    run_dir = tmp_path / "run2"
    process = train(base, run_dir, "steps=1000", wait=False)
    trainer = psutil.Process(process.pid)
    while len(trainer.children(recursive=True)) < 3:
        assert process.poll() is None
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "error:" not in err
    assert "gdpo-train: stopped by Ctrl-C; rerun the same command to resume\n" in out
    logged = steps_so_far(run_dir)
    if not logged:
        assert ("gdpo-train: Ctrl-C: stopping once start-up is done, before the first step (Ctrl-C again to stop at "
                "once)") in err.splitlines()
        assert not (run_dir / "checkpoints").exists()
    else:
        assert ("gdpo-train: Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)"
                in err.splitlines())
        assert f"checkpoint: {run_dir}/checkpoints/step_{logged[-1]}" in out.splitlines()


def test_the_papers_tool_prompts_train_on_the_cpu(tmp_path):
    """ToolRL's published prompts (1,300-5,400 tokens here), 4 per step: more new prompt tokens in
    one engine step than vLLM's default budget, every rollout seeded."""
    from gdpo_megatron.demo.warmup import make_base_model

    base = make_base_model(tmp_path / "base", steps=0, max_position_embeddings=8192)
    command = [GDPO_TRAIN, "--config", "configs/toolrl_qwen2.5_1.5b.yaml", f"base_model={base}",
               f"run_dir={tmp_path / 'run'}", "data.train_path=examples/data/toolrl/rlla_4k_test.parquet",
               "data.max_prompt_tokens=5400", "rollout.max_model_len=5440", "rollout.max_new_tokens=32",
               "data.prompts_per_step=4", "rollout.group_size=2", "policy.micro_batch_size=2",
               "policy.precision.dtype=fp32", "steps=2", "logging.progress_bar=false", "rewards.num_workers=1"]
    done = subprocess.run(command, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = records(tmp_path / "run")
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["rollout/logprob_mismatch"] < 1e-3 and r["train/num_tokens"] > 0 for r in logged)
    assert "ERROR" not in done.stderr and "Generator does not use offset" not in done.stderr
