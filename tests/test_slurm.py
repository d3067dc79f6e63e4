"""`sbatch slurm/gdpo_tiny_cpu.sh` under a real Slurm: controller and node daemon on localhost.

The module starts munged, slurmctld and slurmd from Debian's slurm-wlm / munge packages with
a generated one-node configuration (2 CPUs, the task/affinity plugin, no cgroups, everything
under a temporary directory: :class:`support.slurm_cluster.LocalSlurm`), submits the real job
script with 2 tasks and checks what the run left behind.
Every daemon and job is stopped at the end, also when a test fails. Skipped where the daemons
are not installed (``apt-get install slurm-wlm munge``); needs root (SlurmUser=root).
Without Slurm: the job scripts' headers agree with the trainer's exit statuses and the memory plan.
(Two hosts in one job: tests/test_multinode.py.)
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from gdpo_megatron.commands import plan
from gdpo_megatron.commands.train import EXIT_PEER_LOST, EXIT_REQUEUE
from gdpo_megatron.config import ModelConfig
from gdpo_megatron.preflight.plan import total_params
from support.metrics_file import records, steps_so_far
from support.slurm_cluster import LocalSlurm, cluster, missing

REPO = Path(__file__).resolve().parents[1]
NODE = LocalSlurm.nodes[0]
FIRST_STEP_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def slurm():
    reason = missing()
    if reason:
        pytest.skip(reason)
    with cluster(LocalSlurm) as local:
        yield local


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """The demo's tiny Llama and tokenizer, untrained (the run only has to work, not learn)."""
    from gdpo_megatron.demo.warmup import make_base_model

    return make_base_model(tmp_path_factory.mktemp("base") / "model", steps=0)


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_cpu_job_trains_requeues_on_usr1_and_resumes(slurm, base_model, tmp_path):
    """Two tasks train; SIGUSR1 (what ``--signal`` sends before the time limit) makes the
    trainer save and exit, the script requeues the job, and the rerun resumes to the end."""
    run_dir, steps = tmp_path / "run", 6
    job = slurm.sbatch("slurm/gdpo_tiny_cpu.sh", f"base_model={base_model}", f"run_dir={run_dir}",
                       f"steps={steps}", "rollout.max_new_tokens=32", "checkpoint.save_every=0", "checkpoint.keep_last=3",
                       "checkpoint.export_hf=false")
    slurm.wait_for(lambda: steps_so_far(run_dir) or slurm.state(job) not in ("PENDING", "RUNNING"),
                   "the first training step", FIRST_STEP_TIMEOUT_S)
    slurm.run("scancel", "--signal=USR1", job)  # to the tasks, not the batch shell, like --signal=USR1@T
    info = slurm.wait_job(job)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    assert info["NumTasks"] == "2" and info["NodeList"] == NODE
    assert info["Restarts"] == "1", log
    assert f"job {job} (restart 0): 2 tasks on {NODE}" in log and f"job {job} (restart 1)" in log
    assert f"requeueing job {job}" in log

    # Every step exactly once, in order: the rerun continued from the saved step.
    assert steps_so_far(run_dir) == list(range(1, steps + 1)), log
    for record in records(run_dir):
        # 8 prompts x group size 8 over both data-parallel ranks, every reward scored
        assert record["rollout/tokens_generated"] / record["rollout/completion_tokens_mean"] == pytest.approx(64)
        for name in ("tool_format", "tool_correctness", "length"):
            assert record[f"reward/{name}/failures"] == 0

    checkpoints = run_dir / "checkpoints"
    saved = sorted(int(p.name.removeprefix("step_")) for p in checkpoints.glob("step_*"))
    assert len(saved) == 2 and saved[-1] == steps and saved[0] < steps, saved  # the interrupted one + the last
    assert (checkpoints / "latest").read_text().strip() == f"step_{steps}"
    for step in saved:
        state = json.loads((checkpoints / f"step_{step}" / "trainer_state.json").read_text())
        assert state["world_size"] == 2 and state["step"] == step
        assert sorted(p.name for p in (checkpoints / f"step_{step}" / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]


CPUS_JOB = """#!/bin/bash
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
export SLURM_CPU_BIND=cores  # as clusters that bind each task to its cores
source slurm/launch.sh
run_tasks python -c 'import os; print("cpus of the task:", len(os.sched_getaffinity(0)))'
"""


@pytest.mark.slurm
def test_tasks_get_the_jobs_cpus_per_task(slurm, tmp_path):
    """Slurm >= 22.05 srun does not take --cpus-per-task from sbatch: launch.sh must pass it on,
    or where tasks are bound to cores the task (and its reward workers) gets one core."""
    script = tmp_path / "cpus.sh"
    script.write_text(CPUS_JOB)
    job = slurm.sbatch(str(script))
    info = slurm.wait_job(job, 60)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert "cpus of the task: 2" in log, log


def _sbatch_options(script: str) -> dict[str, str]:
    """``#SBATCH --name=value`` lines of a job script (``""`` for flags)."""
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", (REPO / script).read_text(), re.MULTILINE))


GPU_JOBS = (("slurm/gdpo_7b.sh", "configs/gdpo_7b.yaml"),
            ("slurm/gdpo_32b_multinode.sh", "configs/gdpo_32b_multinode.yaml"))


def test_job_scripts_agree_with_the_trainer(capsys):
    launch = (REPO / "slurm" / "launch.sh").read_text()
    assert int(re.search(r"^EXIT_REQUEUE=(\d+)$", launch, re.MULTILINE).group(1)) == EXIT_REQUEUE
    assert int(re.search(r"^EXIT_PEER_LOST=(\d+)$", launch, re.MULTILINE).group(1)) == EXIT_PEER_LOST
    for script, config in (*GPU_JOBS, ("slurm/gdpo_tiny_cpu.sh", "configs/tiny_cpu.yaml")):
        options = _sbatch_options(script)
        assert options["requeue"] == "" and options["open-mode"] == "append", script
        assert re.fullmatch(r"USR1@\d+", options["signal"]), script
        assert f"launch_training {config} " in (REPO / script).read_text()


@pytest.mark.parametrize("args, line", [
    (("--config",), "launch_training: --config needs a config file"),
    (("--config", "configs/none.yaml", "steps=2"),
     f"launch_training: config configs/none.yaml not found in {REPO} (submit from the repository root)"),
])
def test_a_job_names_the_config_it_cannot_run(args, line):
    """A script's config, or the one its submitter named first, must exist before anything runs."""
    done = subprocess.run(["bash", "-c", 'source slurm/launch.sh && launch_training configs/tiny_cpu.yaml "$@"',
                           "job", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False)
    assert (done.returncode, done.stderr.strip(), done.stdout) == (2, line, "")


@pytest.mark.parametrize("script, config", GPU_JOBS)
def test_gpu_jobs_fit_the_gpus_they_ask_for(script, config, capsys):
    """gdpo-plan, for the nodes and GPUs of the script's header: the layout fits 80 GB GPUs (an
    H100 reports 79.2 GiB)."""
    gpu = _sbatch_options(script)
    assert gpu["ntasks-per-node"] == gpu["gpus-per-node"]  # one task per GPU
    assert plan.main(["--config", config, "--nodes", gpu["nodes"], "--gpus-per-node", gpu["gpus-per-node"],
                      "--gpu-memory", "79.2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^in 79.2 GiB +fits", out, re.MULTILINE), out


def test_the_32b_shape_is_qwen2_5_32b():
    # Qwen2.5-32B's checkpoint: 32,763,876,352 parameters (untied embeddings, QKV biases).
    assert total_params(ModelConfig.preset("qwen2.5-32b")) == 32_763_876_352
