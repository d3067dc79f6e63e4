"""The sharded reward stage: values in config order, and misbehaving rewards that hang,
raise, return garbage or kill their worker are scored as failures, counted, and survived."""
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from gdpo_megatron.config import from_dict
from gdpo_megatron.config.rewards import RewardsConfig, RewardSpec
from gdpo_megatron.rewards import get_reward, sandbox
from gdpo_megatron.rewards.stage import RewardStage

BAD_REWARDS = '''
import math, os, time
from gdpo_megatron.rewards import register_reward

@register_reward("stage_hangs_on_odd")
def hangs_on_odd(completion, num_tokens, ground_truth):
    if ground_truth["i"] % 2:
        time.sleep(3600)
    return ground_truth["i"] / 2

@register_reward("stage_raises_on_3")
def raises_on_3(completion, num_tokens, ground_truth):
    if ground_truth["i"] == 3:
        raise ValueError("no reward for rollout 3")
    return float(ground_truth["i"])

@register_reward("stage_exits_on_4")
def exits_on_4(completion, num_tokens, ground_truth):
    if ground_truth["i"] == 4:
        os._exit(3)
    return 1.0

@register_reward("stage_garbage_on_2_and_5")
def garbage_on_2_and_5(completion, num_tokens, ground_truth):
    return {2: "1.0", 5: math.nan}.get(ground_truth["i"], 2.0)
'''

SPECS = [
    RewardSpec("stage_hangs_on_odd", failure_value=-1.0, timeout_s=1.0),
    RewardSpec("stage_raises_on_3", failure_value=-5.0),
    RewardSpec("stage_exits_on_4", failure_value=-2.0),
    RewardSpec("stage_garbage_on_2_and_5", failure_value=-3.0),
    RewardSpec("length", weight=0.5, kwargs={"max_tokens": 3}),
    RewardSpec("math_correctness"),
]
N = 6
COMPLETIONS = ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{2}", "no answer", "<answer>1/2</answer>", "\\boxed{3}"]
NUM_TOKENS = [1, 2, 3, 4, 5, 6]
METADATA = [{"i": i, "answer": "\\frac{1}{2}"} for i in range(N)]


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "misbehaving.py"
    path.write_text(BAD_REWARDS)
    with RewardStage(SPECS, num_workers=2, timeout_s=20.0, reward_files=[path]) as stage:
        yield stage


def expected_rewards():
    """What each reward should score, written out from the definitions above."""
    rows = []
    for i, (text, tokens, meta) in enumerate(zip(COMPLETIONS, NUM_TOKENS, METADATA)):
        rows.append([
            -1.0 if i % 2 else i / 2,
            -5.0 if i == 3 else float(i),
            -2.0 if i == 4 else 1.0,
            -3.0 if i in (2, 5) else 2.0,
            1.0 if tokens <= 3 else 0.0,
            get_reward("math_correctness")(text, tokens, meta),  # computed here, in the test process
        ])
    return torch.tensor(rows, dtype=torch.float32)


def test_failures_are_scored_counted_and_survived(stage):
    start = time.monotonic()
    rewards, metrics = stage.score(COMPLETIONS, NUM_TOKENS, METADATA)
    elapsed = time.monotonic() - start
    # Three 1 s hangs on two workers: well under a minute, however loaded the machine.
    assert elapsed < 60

    expected = expected_rewards()
    assert expected[:, 5].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # math-verify: 1/2 == 0.5
    torch.testing.assert_close(rewards, expected, rtol=0, atol=0)

    failures = {"stage_hangs_on_odd": 3, "stage_raises_on_3": 1, "stage_exits_on_4": 1,
                "stage_garbage_on_2_and_5": 2, "length": 0, "math_correctness": 0}
    for k, name in enumerate(stage.names):
        column = expected[:, k].double()
        assert metrics[f"reward/{name}/failures"] == failures[name]
        assert metrics[f"reward/{name}/timeouts"] == (3 if name == "stage_hangs_on_odd" else 0)
        assert metrics[f"reward/{name}/mean"] == pytest.approx(column.mean().item())
        assert metrics[f"reward/{name}/std"] == pytest.approx(math.sqrt(((column - column.mean()) ** 2).mean().item()))


def test_stage_keeps_working_after_replacing_workers(stage):
    even = [0, 2, 4]
    rewards, metrics = stage.score([COMPLETIONS[i] for i in even], [NUM_TOKENS[i] for i in even],
                                   [METADATA[i] for i in even])
    torch.testing.assert_close(rewards, expected_rewards()[even], rtol=0, atol=0)
    assert metrics["reward/stage_hangs_on_odd/failures"] == 0
    assert metrics["reward/stage_exits_on_4/failures"] == 1


def test_names_follow_the_config_order(stage):
    assert stage.names == [s.name for s in SPECS]


def test_empty_batch(stage):
    rewards, metrics = stage.score([], [], [])
    assert rewards.shape == (0, len(SPECS)) and metrics["reward/length/failures"] == 0


def test_mismatched_inputs_are_named(stage):
    with pytest.raises(ValueError, match="2 completions, 1 token counts"):
        stage.score(["a", "b"], [1], [{}, {}])


@pytest.mark.skipif(not sandbox.isolation().guarantees["process_tree_ends_with_run"],
                    reason="the active sandbox level does not guarantee it")
def test_sandboxed_program_of_a_killed_worker_is_killed_too():
    word = f"gdpo-stage-test-{os.getpid()}"
    code = f"```python\nimport os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {word!r}])\n```"
    spec = RewardSpec("code_pass", timeout_s=1.0, failure_value=-1.0, kwargs={"limits": {"wall_s": 600, "cpu_s": 600}})
    with RewardStage([spec], num_workers=1, allow_weaker_sandbox=True) as stage:  # whatever level runs here
        killed = stage._workers[0].process.pid
        rewards, metrics = stage.score([code], [1], [{"tests": [{"input": "", "output": ""}]}])
    assert rewards.tolist() == [[-1.0]] and metrics["reward/code_pass/timeouts"] == 1
    assert _live_processes_with(word) == []
    assert list(Path(tempfile.gettempdir()).glob(f"gdpo-sandbox-{killed}-*")) == []  # its working directory


def _live_processes_with(word):
    """Processes (not zombies) whose command line contains ``word``, waiting up to 5 s for
    those that are dying."""
    deadline = time.monotonic() + 5
    while True:
        alive = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                        found = word.encode() in f.read()
                    with open(f"/proc/{entry.name}/stat") as f:
                        if found and f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            alive.append(int(entry.name))
                except (FileNotFoundError, ProcessLookupError):
                    pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_a_missing_reward_file_is_named():
    with pytest.raises(FileNotFoundError, match="rewards.py"):
        RewardStage([RewardSpec("length")], reward_files=["/nonexistent/rewards.py"])


def test_a_stage_built_from_a_rewards_section_takes_its_settings(tmp_path):
    path = tmp_path / "hangs.py"
    path.write_text(
        "import time\n"
        "from gdpo_megatron.rewards import register_reward\n"
        "@register_reward('stage_section_hangs_on_1')\n"
        "def hangs_on_1(completion, num_tokens, ground_truth):\n"
        "    if ground_truth['i'] == 1:\n"
        "        time.sleep(3600)\n"
        "    return float(ground_truth['i'])\n"
    )
    section = from_dict(RewardsConfig, {
        "rewards": [{"name": "stage_section_hangs_on_1", "failure_value": -1.0},
                    {"name": "length", "kwargs": {"max_tokens": 3}}],
        "num_workers": 1, "timeout_s": 1.0, "reward_files": [str(path)],
    }, "rewards")
    with RewardStage.from_config(section) as stage:
        assert stage.names == ["stage_section_hangs_on_1", "length"] and len(stage._workers) == 1
        rewards, metrics = stage.score(["a", "b", "c"], [1, 5, 3], [{"i": 0}, {"i": 1}, {"i": 2}])
    # rollout 1 runs past the section's timeout_s (its spec sets none) and scores its failure_value
    assert rewards.tolist() == [[0.0, 1.0], [-1.0, 0.0], [2.0, 1.0]]
    assert metrics["reward/stage_section_hangs_on_1/timeouts"] == 1


def worker_only_failure(tmp_path) -> RewardStage:
    """A stage whose reward file imports in the trainer but raises in every worker."""
    path = tmp_path / "worker_only_failure.py"
    path.write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is not None:  # in a worker, not in the trainer\n"
        "    raise ImportError('missing dependency in the workers')\n"
    )
    return RewardStage([RewardSpec("length")], num_workers=1, reward_files=[path])


def test_a_reward_file_failing_in_the_workers_stops_the_stage_with_its_error(tmp_path):
    stage = worker_only_failure(tmp_path)
    with pytest.raises(RuntimeError, match="could not start(.|\n)*missing dependency in the workers"):
        stage.score(["x"], [1], [{}])
    with pytest.raises(RuntimeError, match="after close"):
        stage.score(["x"], [1], [{}])


def test_a_worker_that_died_while_idle_is_replaced(stage):
    for worker in stage._workers:  # e.g. the out-of-memory killer between two steps
        worker.process.kill()
        worker.process.join()
    rewards, metrics = stage.score(COMPLETIONS[:1], NUM_TOKENS[:1], METADATA[:1])
    torch.testing.assert_close(rewards, expected_rewards()[:1], rtol=0, atol=0)
    assert all(metrics[f"reward/{name}/failures"] == 0 for name in stage.names)


DAMAGING_REWARDS = '''
import subprocess
from gdpo_megatron.rewards import register_reward
from gdpo_megatron.rewards.sandbox import SandboxLimits, run_python

@register_reward("stage_sandbox_fails_on_1")
def sandbox_fails_on_1(completion, num_tokens, ground_truth):
    limits = SandboxLimits(memory_bytes=1 << 20) if ground_truth["i"] == 1 else SandboxLimits()
    return float(run_python("print(7)", "", limits).stdout)

@register_reward("stage_leaves_a_process_on_2")
def leaves_a_process_on_2(completion, num_tokens, ground_truth):
    if ground_truth["i"] == 2:  # as if a sandboxed program had escaped its run
        subprocess.Popen(["sleep", "300", ground_truth["word"]])
    return 1.0
'''


def test_sandbox_failures_are_failures_and_damaged_workers_are_replaced(tmp_path):
    path = tmp_path / "damaging.py"
    path.write_text(DAMAGING_REWARDS)
    word = f"gdpo-stage-escaped-{os.getpid()}"
    specs = [RewardSpec("stage_sandbox_fails_on_1", failure_value=-1.0), RewardSpec("stage_leaves_a_process_on_2"),
             RewardSpec("length", kwargs={"max_tokens": 2})]
    metadata = [{"i": i, "word": word} for i in range(4)]
    with RewardStage(specs, num_workers=1, reward_files=[path]) as stage:
        first = stage._workers[0].process.pid
        rewards, metrics = stage.score(["a"] * 4, [1, 2, 3, 1], metadata)
        replacements = [first, stage._workers[0].process.pid]
    assert rewards.tolist() == [[7.0, 1.0, 1.0], [-1.0, 1.0, 1.0], [7.0, 1.0, 0.0], [7.0, 1.0, 1.0]]
    assert metrics["reward/stage_sandbox_fails_on_1/failures"] == 1
    assert metrics["reward/stage_leaves_a_process_on_2/failures"] == 0
    assert replacements[0] != replacements[1]
    assert _live_processes_with(word) == []


def test_zombies_a_program_leaves_do_not_fail_later_programs():
    """A program that forks 31 children and exits, then correct programs that start processes."""
    forker = "```python\nimport os\nfor _ in range(31):\n    if os.fork() == 0:\n        os._exit(0)\nprint(3)\n```"
    correct = "```python\nimport subprocess\na, b = map(int, input().split())\nsubprocess.run(['true'], check=True)\nprint(a + b)\n```"
    spec = RewardSpec("code_pass", kwargs={"limits": {"processes": 32, "wall_s": 20.0}})
    truth = {"tests": [{"input": "1 2\n", "output": "3\n"}]}
    with RewardStage([spec], num_workers=1, allow_weaker_sandbox=True) as stage:  # whatever level runs here
        rewards, metrics = stage.score([forker] + [correct] * 3, [1] * 4, [truth] * 4)
    assert rewards.tolist() == [[1.0]] * 4
    assert metrics["reward/code_pass/failures"] == 0


def test_rollouts_submitted_one_by_one_in_any_order_score_as_a_batch(stage):
    batch = stage.begin(N)
    for i in reversed(range(N)):
        batch.submit(i, COMPLETIONS[i], NUM_TOKENS[i], METADATA[i])
    rewards, metrics = batch.collect()
    torch.testing.assert_close(rewards, expected_rewards(), rtol=0, atol=0)
    assert metrics["reward/stage_hangs_on_odd/timeouts"] == 3 and metrics["reward/stage_exits_on_4/failures"] == 1


def test_a_submitted_rollout_is_scored_before_collect_is_called(tmp_path):
    marker = tmp_path / "scored"
    path = tmp_path / "marking.py"
    path.write_text(
        "from pathlib import Path\n"
        "from gdpo_megatron.rewards import register_reward\n"
        "@register_reward('stage_marks')\n"
        "def marks(completion, num_tokens, ground_truth):\n"
        f"    Path({str(marker)!r}).write_text(completion)\n"
        "    return 7.0\n"
    )
    with RewardStage([RewardSpec("stage_marks")], num_workers=1, reward_files=[path]) as stage:
        stage.score(["warm-up"], [1], [{}])  # the worker is up (as in training, started at build)
        batch = stage.begin(1)
        batch.submit(0, "first", 1, {})
        deadline = time.monotonic() + 60
        while marker.read_text() != "first" and time.monotonic() < deadline:  # the caller is busy
            time.sleep(0.05)
        assert marker.read_text() == "first"  # scored before collect() was called
        rewards, _ = batch.collect()
    assert rewards.tolist() == [[7.0]]


def test_bad_submissions_are_named(stage):
    batch = stage.begin(2)
    batch.submit(0, "x", 1, METADATA[0])
    with pytest.raises(ValueError, match="rollout 0 .* submitted twice"):
        batch.submit(0, "x", 1, METADATA[0])
    with pytest.raises(ValueError, match="rollout 2 is out of"):
        batch.submit(2, "x", 1, METADATA[0])
    with pytest.raises(ValueError, match="1 of 2 rollouts"):
        batch.collect()
    batch.submit(1, "x", 1, METADATA[1])
    assert batch.collect()[0].shape == (2, len(SPECS))


def test_a_stage_that_cannot_start_fails_at_collect_not_at_submit(tmp_path):
    stage = worker_only_failure(tmp_path)
    batch = stage.begin(3)
    for i in range(3):
        time.sleep(0.2)
        batch.submit(i, "x", 1, {})  # never raises mid-generation
    with pytest.raises(RuntimeError, match="could not start(.|\n)*missing dependency in the workers"):
        batch.collect()


BOUNDED_REWARDS = '''
from gdpo_megatron.rewards import register_reward

@register_reward("stage_bounded_raises_on_1", bounds=(-3, 3))
def bounded_raises_on_1(completion, num_tokens, ground_truth):
    if ground_truth["i"] == 1:
        raise RecursionError("as a completion nested too deeply might make it")
    return 1.0

@register_reward("stage_out_of_bounds_on_0", bounds=(0, 1))
def out_of_bounds_on_0(completion, num_tokens, ground_truth):
    return 2.0 if ground_truth["i"] == 0 else 0.5

@register_reward("stage_unbounded_raises_on_1")
def unbounded_raises_on_1(completion, num_tokens, ground_truth):
    if ground_truth["i"] == 1:
        raise ValueError("no reward for rollout 1")
    return -7.0
'''


def test_a_failure_scores_the_declared_low_bound_and_a_value_outside_the_bounds_fails(tmp_path):
    path = tmp_path / "bounded.py"
    path.write_text(BOUNDED_REWARDS)
    specs = [RewardSpec("stage_bounded_raises_on_1"), RewardSpec("stage_out_of_bounds_on_0"),
             RewardSpec("stage_unbounded_raises_on_1")]
    with RewardStage(specs, num_workers=1, reward_files=[path]) as stage:
        rewards, metrics = stage.score(["a", "b"], [1, 1], [{"i": 0}, {"i": 1}])
    # Failing pays the bound's low end (not 0, above an honest -3); undeclared bounds fail to 0.
    assert rewards.tolist() == [[1.0, 0.0, -7.0], [-3.0, 0.5, 0.0]]
    assert [metrics[f"reward/{spec.name}/failures"] for spec in specs] == [1, 1, 1]


REPORTED_REWARDS = '''
import time
from gdpo_megatron.rewards import register_reward

@register_reward("stage_none_but_on_0", bounds=(0, 1))
def none_but_on_0(completion, num_tokens, ground_truth):
    return 1.0 if ground_truth["i"] == 0 else None

@register_reward("stage_too_high_on_2", bounds=(0, 1))
def too_high_on_2(completion, num_tokens, ground_truth):
    return 7.5 if ground_truth["i"] == 2 else 0.5

@register_reward("stage_sleeps_on_1", bounds=(-1, 1))
def sleeps_on_1(completion, num_tokens, ground_truth):
    if ground_truth["i"] == 1:
        time.sleep(3600)
    return 0.0

@register_reward("stage_divides_by_i")
def divides_by_i(completion, num_tokens, ground_truth):
    return 1 / ground_truth["i"]
'''


def test_each_failing_reward_is_reported_by_name_with_the_first_failures_sample(tmp_path, caplog):
    path = tmp_path / "reported.py"
    path.write_text(REPORTED_REWARDS)
    specs = [RewardSpec("stage_none_but_on_0"), RewardSpec("stage_too_high_on_2"),
             RewardSpec("stage_sleeps_on_1", timeout_s=1.0), RewardSpec("stage_divides_by_i"), RewardSpec("length")]
    ids = ["row-a", "row-b", "row-c", "row-d"]
    with RewardStage(specs, num_workers=1, reward_files=[path]) as stage:
        batch = stage.begin(len(ids))
        for i, sample_id in enumerate(ids):
            batch.submit(i, "x", 1, {"i": i}, sample_id)
        with caplog.at_level("WARNING", logger="gdpo_megatron.rewards.stage"):
            rewards, metrics = batch.collect()
    assert [metrics[f"reward/{spec.name}/failures"] for spec in specs] == [3, 1, 1, 1, 0]
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 4  # one per failing reward, none for length
    assert reports[0] == ("reward 'stage_none_but_on_0' failed on 3 of 4 rollouts, each scoring its failure value "
                          "0; the first, sample 'row-b' (rollout 1): returned None, expected a finite number")
    assert reports[1] == ("reward 'stage_too_high_on_2' failed on 1 of 4 rollouts, each scoring its failure value 0; "
                          "the first, sample 'row-c' (rollout 2): returned 7.5, outside its declared bounds [0, 1]")
    assert reports[2] == ("reward 'stage_sleeps_on_1' failed on 1 of 4 rollouts, 1 timed out, each scoring its "
                          "failure value -1; the first, sample 'row-b' (rollout 1): timed out after 1 s")
    first, *frames = reports[3].splitlines()
    assert first == ("reward 'stage_divides_by_i' failed on 1 of 4 rollouts, each scoring its failure value 0; the "
                     "first, sample 'row-a' (rollout 0): raised ZeroDivisionError: division by zero")
    # The reward's own frame, the line that raised; not the stage's worker loop.
    line = REPORTED_REWARDS.splitlines().index('    return 1 / ground_truth["i"]') + 1
    assert frames[:2] == [f'  File "{path}", line {line}, in divides_by_i', '    return 1 / ground_truth["i"]']
    assert "_worker_main" not in reports[3]



SCORE_ONE_PROGRAM = """
import json, sys
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.rewards import RewardStage

if __name__ == "__main__":
    correct = "```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```"
    truth = {"tests": [{"input": "1 2\\n", "output": "3\\n"}]}
    with RewardStage([RewardSpec("code_pass", failure_value=-1.0)], num_workers=1,
                     allow_weaker_sandbox=sys.argv[1] == "allow") as stage:
        rewards, metrics = stage.score([correct], [1], [truth])
    print(json.dumps([rewards.tolist(), metrics["reward/code_pass/failures"]]))
"""


@pytest.mark.parametrize("choice, expected", [("refuse", [[[-1.0]], 1.0]), ("allow", [[[1.0]], 0.0])])
def test_code_rewards_fail_below_the_strong_sandbox_unless_it_was_chosen(tmp_path, choice, expected):
    """Preflight refuses such a config; if the strong level still fails in a worker (here: no
    bubblewrap on the PATH of a fresh process, whose reward workers inherit it), the call fails
    with the reason, counted, instead of running the program at the basic level."""
    script = tmp_path / "score.py"
    script.write_text(SCORE_ONE_PROGRAM)
    env = {**os.environ, "PATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), choice], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
    if choice == "refuse":
        assert "the strong sandbox cannot run here" in done.stderr


TRAINER_THAT_DIES = '''
import os, signal, sys, time
from pathlib import Path
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.rewards.stage import RewardStage

if __name__ == "__main__":
    started = Path(sys.argv[2])
    stage = RewardStage([RewardSpec("stage_sleeps")], num_workers=2, reward_files=[sys.argv[1]])
    stage.score(["warm-up"], [1], [{}])  # both workers are up
    print(" ".join(str(w.process.pid) for w in stage._workers), flush=True)
    batch = stage.begin(1)
    batch.submit(0, "busy", 1, {})  # one worker in a reward call, the other idle
    while not started.exists():
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a trainer
'''


def test_workers_of_a_trainer_that_died_exit_quietly(tmp_path):
    """The trainer dies: its idle worker (its pipe closed) and its busy one (its reply has
    nowhere to go) exit without a word; a job's log gets no tracebacks from them."""
    started = tmp_path / "started"
    rewards = tmp_path / "sleeping.py"
    rewards.write_text(
        "import time\n"
        "from pathlib import Path\n"
        "from gdpo_megatron.rewards import register_reward\n"
        "@register_reward('stage_sleeps')\n"
        "def sleeps(completion, num_tokens, ground_truth):\n"
        "    if completion == 'busy':\n"
        f"        Path({str(started)!r}).touch()\n"
        "        time.sleep(1)\n"
        "    return 1.0\n"
    )
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER_THAT_DIES)
    # The workers inherit the trainer's stdout and stderr: the run ends when they have exited.
    done = subprocess.run([sys.executable, str(trainer), str(rewards), str(started)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == -9, done.stderr
    workers = [int(pid) for pid in done.stdout.split()]
    assert len(workers) == 2 and started.exists()
    assert done.stderr == ""
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
