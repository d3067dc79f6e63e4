"""`sbatch slurm/gdpo_tiny_cpu.sh` under a real Slurm: controller and node daemon on localhost.

The module starts munged, slurmctld and slurmd from Debian's slurm-wlm / munge packages with
a generated one-node configuration (2 CPUs, the task/affinity plugin, no cgroups, everything
under a temporary directory), submits the real job script with 2 tasks and checks what the run
left behind.
Every daemon and job is stopped at the end, also when a test fails. Skipped where the daemons
are not installed (``apt-get install slurm-wlm munge``); needs root (SlurmUser=root).
Without Slurm: the job scripts' headers agree with the trainer's exit status and the memory plan.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gdpo_megatron.commands import plan
from gdpo_megatron.commands.train import EXIT_REQUEUE
from gdpo_megatron.distributed.launch import free_port

REPO = Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "scancel", "srun")
SBIN = "/usr/sbin:/sbin"
NODE = "localhost"  # the node's name is also its address: the tasks rendezvous on it
# A requeued job may start again once its credentials expire (default 120 s) and the next
# scheduling pass (sched_interval, default 60 s) sees it.
CRED_EXPIRE_S = 5
START_TIMEOUT_S = 30
FIRST_STEP_TIMEOUT_S = 150
JOB_TIMEOUT_S = 300
# Launcher variables a pytest process may carry from other tests; the job must not inherit them.
FOREIGN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN)


def _missing_tools() -> list[str]:
    return [name for name in DAEMONS + CLIENTS if _which(name) is None]


def _slurm_conf(root: Path, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=gdpo-test
SlurmctldHost={NODE}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=10
NodeName={NODE} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """munged + slurmctld + slurmd of one 2-CPU node, all state under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.jobs: list[str] = []
        self.env = {k: v for k, v in os.environ.items() if k not in FOREIGN_VARS and not k.startswith("SLURM_")}
        self.env.update(
            SLURM_CONF=str(self.conf),
            PATH=os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", ""), SBIN]),
            OMP_NUM_THREADS="1",
            WANDB_MODE="offline",
            # Tasks float over the node's CPUs (what srun reads as --cpu-bind) unless a job binds.
            SLURM_CPU_BIND="none",
        )

    def start(self) -> None:
        # munged wants a private key file and a socket directory everyone may traverse.
        self.root.chmod(0o755)
        for sub in ("state", "spool"):
            (self.root / sub).mkdir()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(_slurm_conf(self.root, free_port(), free_port()))

        socket_path = self.root / "munge.socket"
        self._spawn("munged", "-F", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
                    f"--seed-file={self.root}/munged.seed")
        self.wait_for(lambda: socket_path.exists(), "munged to create its socket")
        self._spawn("slurmctld", "-D", "-f", str(self.conf))
        self.wait_for(lambda: self.run("scontrol", "ping", check=False).returncode == 0, "slurmctld to answer")
        self._spawn("slurmd", "-D", "-N", NODE, "-f", str(self.conf))
        self.wait_for(lambda: self.run("sinfo", "-h", "-n", NODE, "-o", "%T").stdout.strip() == "idle",
                   f"node {NODE} to become idle")

    def stop(self) -> None:
        """Cancel the jobs, wait for them to end, then stop the daemons (newest first)."""
        if self.jobs and self.daemons:
            self.run("scancel", "--full", *self.jobs, check=False)
            try:
                self.wait_for(lambda: all(self.state(job) not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED")
                                       for job in self.jobs), "the jobs to end")
            except (TimeoutError, RuntimeError):
                pass  # the daemons go anyway
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([_which(cmd[0]), *cmd[1:]], env=self.env, cwd=REPO, capture_output=True,
                              text=True, timeout=30, check=check)

    def sbatch(self, script: str, *args: str) -> str:
        """Submit ``script`` (relative to the repository) with ``args``; return the job id."""
        out = self.run("sbatch", "--parsable", f"--output={self.root}/job-%j.out", script, *args).stdout
        job = out.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job_info(self, job: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def state(self, job: str) -> str:
        return self.job_info(job).get("JobState", "UNKNOWN")

    def wait_job(self, job: str, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
        """Wait until ``job`` has ended; return its ``scontrol show job`` fields."""
        self.wait_for(lambda: self.state(job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                               "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"),
                   f"job {job} to end", timeout_s)
        return self.job_info(job)

    def log(self, job: str) -> str:
        path = self.root / f"job-{job}.out"
        return path.read_text(errors="replace") if path.exists() else f"(no output file {path})"

    def daemon_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted([*self.root.glob("*.log"), *self.root.glob("*.out")]))

    def _spawn(self, name: str, *args: str) -> None:
        out = open(self.root / f"{name}.out", "w")
        self.daemons.append(subprocess.Popen([_which(name), *args], env=self.env, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True))
        out.close()

    def wait_for(self, ready, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll ``ready()`` until true; raise if a daemon died or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self.daemons if p.poll() is not None]
            if dead:
                raise RuntimeError(f"waiting for {what}: {', '.join(dead)} exited\n{self.daemon_logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s} s for {what}\n{self.daemon_logs()}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm():
    missing = _missing_tools()
    if missing:
        pytest.skip(f"Slurm / munge not installed ({', '.join(missing)} missing): "
                    "apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs its daemons as root (SlurmUser=root)")
    # Not under pytest's private (0700) temporary tree: munged needs a socket path that
    # every user may traverse.
    root = Path(tempfile.mkdtemp(prefix="gdpo-slurm-"))
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """The demo's tiny Llama and tokenizer, untrained (the run only has to work, not learn)."""
    from gdpo_megatron.demo.warmup import make_base_model

    return make_base_model(tmp_path_factory.mktemp("base") / "model", steps=0)


def _logged_steps(run_dir: Path) -> list[int]:
    """Steps of the complete metrics records, in the order written (a restart would repeat some)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    *complete, _being_written = path.read_text().split("\n")
    return [json.loads(line)["step"] for line in complete]


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_cpu_job_trains_requeues_on_usr1_and_resumes(slurm, base_model, tmp_path):
    """Two tasks train; SIGUSR1 (what ``--signal`` sends before the time limit) makes the
    trainer save and exit, the script requeues the job, and the rerun resumes to the end."""
    run_dir, steps = tmp_path / "run", 6
    job = slurm.sbatch("slurm/gdpo_tiny_cpu.sh", f"base_model={base_model}", f"run_dir={run_dir}",
                       f"steps={steps}", "rollout.max_new_tokens=32", "checkpoint.save_every=0", "checkpoint.keep_last=3",
                       "checkpoint.export_hf=false")
    slurm.wait_for(lambda: _logged_steps(run_dir) or slurm.state(job) not in ("PENDING", "RUNNING"),
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
    assert _logged_steps(run_dir) == list(range(1, steps + 1)), log
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
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


def test_job_scripts_agree_with_the_trainer_and_the_plan(capsys):
    launch = (REPO / "slurm" / "launch.sh").read_text()
    assert int(re.search(r"^EXIT_REQUEUE=(\d+)$", launch, re.MULTILINE).group(1)) == EXIT_REQUEUE
    for script, config in (("slurm/gdpo_7b.sh", "configs/gdpo_7b.yaml"), ("slurm/gdpo_tiny_cpu.sh",
                                                                          "configs/tiny_cpu.yaml")):
        options = _sbatch_options(script)
        assert options["requeue"] == "" and options["open-mode"] == "append", script
        assert re.fullmatch(r"USR1@\d+", options["signal"]), script
        assert f"launch_training {config} " in (REPO / script).read_text()
    gpu = _sbatch_options("slurm/gdpo_7b.sh")
    assert gpu["ntasks-per-node"] == gpu["gpus-per-node"]  # one task per GPU
    assert plan.main(["--config", "configs/gdpo_7b.yaml", "--nodes", gpu["nodes"],
                      "--gpus-per-node", gpu["gpus-per-node"], "--gpu-memory", "80"]) == 0
    assert "fits" in capsys.readouterr().out
