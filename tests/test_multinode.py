"""GDPO over two hosts in one Slurm job: exact, and a lost host ends the job cleanly and it resumes.

The hosts are network namespaces of this machine with their own hostnames and slurmd, joined by
a veth pair (:class:`support.slurm_cluster.TwoHostSlurm`); the jobs are the project's own
``slurm/gdpo_tiny_cpu.sh`` with ``sbatch --nodes=2``: ranks, world size and rendezvous address
come from Slurm's environment, and gloo runs over the link between the hosts.

* Exact: a run over the two hosts logs the same rewards, advantages and losses and ends with the
  same weights, bit for bit, as the same layout on one host: data-parallel over the hosts, and a
  tensor-parallel group that spans them; for single tool calls (configs/tiny_cpu.yaml) and for
  multi-turn trajectories through a user's environment (configs/multi_turn_cpu.yaml).
* A lost host, killed (its processes and slurmd die, in a step or while a checkpoint is
  written) or cut off (its link goes down): the rank left prints one line naming the lost rank
  and host and exits within ``distributed.timeout_s``, or is aborted by SIGABRT as NCCL's
  watchdog does; the last complete checkpoint is intact, byte for byte; Slurm requeues the job
  (killed host) or the user resubmits it (cut-off host) on the host left, where it resumes at
  data-parallel size 1 from exactly that checkpoint.
* A host whose trainer process dies while the host lives (slurmd answers): ``launch.sh``
  requeues the job once per checkpoint; it resumes on both hosts, and fails when the trainer
  dies again before the next checkpoint.

Without Slurm or network namespaces only the first test runs (a lost peer on loopback).
"""
from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import re
import signal
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gdpo_megatron.checkpoint.state import TMP_PREFIX, complete_steps, step_dir
from gdpo_megatron.commands.train import EXIT_PEER_LOST
from support.metrics_file import computed, records
from support.slurm_cluster import TwoHostSlurm, cluster, missing, sweep_stale_hosts

SCRIPT = "slurm/gdpo_tiny_cpu.sh"
TIMEOUT_S = 10  # distributed.timeout_s of the runs: a silent peer is given up after this long
# A small step (4 prompts x 4 completions of up to 64 tokens); every run writes its Hugging Face
# export at the end.
TINY = ("data.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=64", "policy.micro_batch_size=4",
        "logging.progress_bar=false", "checkpoint.keep_last=4", f"distributed.timeout_s={TIMEOUT_S}")
# The multi-turn config at its smallest (2 prompts x 4 trajectories of the demo model through
# examples/environments/city_desk.py, up to 2 messages per user turn), named first to replace the
# script's config. Its data, environment file and run directory resolve from the job's working
# directory, the repository on the shared filesystem, on both hosts; each rank runs the
# environments of the trajectories it generates (a generous time per environment step: one that
# timed out under load would fail its trajectory in one run only).
MULTI_TURN = ("--config", "configs/multi_turn_cpu.yaml", "data.prompts_per_step=2", "policy.micro_batch_size=4",
              "environment.step_timeout_s=60", "logging.progress_bar=false")
CONFIGS = {"tool calls": TINY, "multi-turn": MULTI_TURN}
TWO_HOSTS = ("--nodes=2", "--ntasks-per-node=1")
ONE_HOST = ("--nodes=1", "--ntasks-per-node=2", "--nodelist=h1")
FIRST_STEPS_TIMEOUT_S = 240
# A rank that lost a peer exits right after its line: nothing of its clean-up waits on the peer.
EXIT_AFTER_LINE_S = 5


# --- a lost peer on loopback: what the rank left reports ---------------------------------------

def _lost_peer_rank(rank: int, port: int, fault: str, results) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from gdpo_megatron.distributed.peers import Peers, describe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=3))
    peers = Peers.gather()
    if rank == 1:
        if fault == "exit":
            os._exit(1)
        time.sleep(5)  # alive and silent past the 3 s timeout
        os._exit(0)
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001 - what the rank left sees
        lost = peers.lost(e)
        results.put((describe(lost), lost.reason, time.monotonic() - started))
    else:
        results.put(None)


@pytest.mark.parametrize("fault, reason", [("exit", "its connection closed"), ("silent", "no answer within 3 s")])
def test_a_lost_peer_is_named_with_its_host(fault, reason):
    """The rank left names the lost rank and its host, for a peer that died (its connection
    closed at once) and for one that stopped answering (given up after the group's timeout)."""
    import socket

    from gdpo_megatron.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_lost_peer_rank, args=(r, port, fault, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        who, got_reason, waited = results.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
    assert who == f"rank 1 (host {socket.gethostname()})"
    assert got_reason == reason
    assert waited < (1 if fault == "exit" else 3 + 2)


# --- the cluster ---------------------------------------------------------------------------------

def _skip_without_two_hosts() -> None:
    reason = missing(two_hosts=True)
    if reason:
        pytest.skip(reason)
    sweep_stale_hosts()


@pytest.fixture(scope="module")
def two_hosts():
    """A two-host cluster shared by the exactness tests."""
    _skip_without_two_hosts()
    with cluster(TwoHostSlurm) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def base_model(demo_base_model):
    """The demo's base model, warmed up so that rewards differ inside a group: the advantages
    are not all zero, and the weights move."""
    return Path(demo_base_model)


def _submit(hosts, options, base_model, run_dir, *overrides, config=TINY) -> str:
    return hosts.sbatch(SCRIPT, *config, f"base_model={base_model}", f"run_dir={run_dir}", *overrides,
                        options=options)


def _finished(hosts, job: str) -> str:
    info = hosts.wait_job(job)
    log = hosts.log(job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}\n{hosts.daemon_logs()}"
    return log


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "hf" / "model.safetensors")


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# --- exact: two hosts = one host -----------------------------------------------------------------

@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("layout, overrides", [
    ("data-parallel over the hosts", ()),
    ("a tensor-parallel group spanning the hosts", ("policy.parallel.tensor_model_parallel_size=2",)),
])
def test_two_hosts_train_exactly_as_one_host(two_hosts, base_model, tmp_path, layout, overrides, config):
    steps = 2
    runs = {"two hosts": tmp_path / "two-hosts", "one host": tmp_path / "one-host"}
    link_bytes = two_hosts.link_bytes("h2")
    jobs = {name: _submit(two_hosts, options, base_model, runs[name], f"steps={steps}", *overrides,
                          config=CONFIGS[config])
            for name, options in (("two hosts", TWO_HOSTS), ("one host", ONE_HOST))}
    logs = {"two hosts": _finished(two_hosts, jobs["two hosts"])}
    # The ranks' collectives went over the link (Slurm's own messages are a few kB).
    assert two_hosts.link_bytes("h2") - link_bytes > 2**20
    logs["one host"] = _finished(two_hosts, jobs["one host"])
    config_file = "configs/multi_turn_cpu.yaml" if config == "multi-turn" else "configs/tiny_cpu.yaml"
    assert f"job {jobs['two hosts']} (restart 0): 2 tasks on h[1-2], config {config_file}," in logs["two hosts"]
    assert f"job {jobs['one host']} (restart 0): 2 tasks on h1, config {config_file}," in logs["one host"]

    two, one = (records(runs[name]) for name in ("two hosts", "one host"))
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, steps + 1))
    for a, b in zip(two, one):
        # Rewards, advantages, losses, gradient norms, tokens, and for trajectories the model's
        # turns, how they ended and the prefix cache's hits over the turns: the same numbers, bit
        # for bit. Every reduction runs in the same order over the same ranks, and each rank's
        # engine (in-process, fed the same requests) and environments do the same work
        # wherever it runs; only the wire differs.
        assert computed(a) == computed(b)
    assert all(r["advantage/abs_mean"] > 0 for r in two)  # the weights move: the comparison below means something
    if config == "multi-turn":
        for r in two:
            # Trajectories: the model went again after the environment's replies, every environment
            # and reward answered.
            assert r["rollout/model_turns_mean"] > 1 and r["rollout/ended_failed_frac"] == 0
            assert all(r[f"reward/{name}/failures"] == 0
                       for name in ("multi_turn_format", "multi_turn_state", "multi_turn_efficiency"))
    weights = {name: _weights(run) for name, run in runs.items()}
    assert _max_difference(weights["two hosts"], weights["one host"]) == 0.0
    assert _max_difference(weights["two hosts"], load_file(base_model / "model.safetensors")) > 0


# --- a lost host ---------------------------------------------------------------------------------

def _trainer_pids(hosts, host: str) -> list[int]:
    return hosts.processes(host, r"^\S*python\S* -m gdpo_megatron train ")


def _running_trainers(hosts) -> dict[str, list[int]]:
    """The trainer process of each host, which must be there (a fault must hit a running job)."""
    trainers = {host: _trainer_pids(hosts, host) for host in hosts.nodes}
    assert all(trainers.values()), trainers
    return trainers


def _checksums(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under ``directory``, by path inside it."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _run_to_checkpoint(hosts, base_model, run_dir: Path, step: int, steps: int, options=(),
                       hold: dict[str, list[int]] | None = None) -> str:
    """A two-host job that saves every ``step`` steps, once it has saved step ``step``. With
    ``hold`` (an empty dict) the trainers are stopped (SIGSTOP) as soon as that checkpoint is
    seen, their pids put in ``hold``: a fault injected next hits step ``step + 1`` however
    loaded the machine is (SIGCONT them after it)."""
    job = _submit(hosts, (*TWO_HOSTS, *options), base_model, run_dir, f"steps={steps}",
                  f"checkpoint.save_every={step}", "checkpoint.export_hf=true")
    latest = run_dir / "checkpoints" / "latest"

    def saved() -> bool:
        if hold is not None:
            hold.update({host: _trainer_pids(hosts, host) for host in hosts.nodes if not hold.get(host)})
        if latest.exists() and latest.read_text().strip() == f"step_{step}":
            for pids in (hold or {}).values():
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
            return True
        return hosts.state(job) not in ("PENDING", "RUNNING")

    hosts.wait_for(saved, f"checkpoint {step}", FIRST_STEPS_TIMEOUT_S, interval_s=0.05 if hold is not None else 0.2)
    assert hosts.state(job) == "RUNNING", hosts.log(job)
    return job


def _report_and_exit_times(hosts, job: str, since: float, ranks_on: tuple[str, ...]) -> tuple[float, float]:
    """Seconds from ``since`` until h1's rank printed its line, and until the ranks on the hosts
    ``ranks_on`` had all exited."""
    reported = None

    def exited() -> bool:
        nonlocal reported
        if reported is None and "\nerror:" in hosts.log(job):
            reported = time.monotonic() - since
        return not any(_trainer_pids(hosts, host) for host in ranks_on)

    hosts.wait_for(exited, f"the ranks on {', '.join(ranks_on)} to exit", 3 * TIMEOUT_S, interval_s=0.1)
    exit_s = time.monotonic() - since
    return (exit_s if reported is None else reported), exit_s


def _assert_one_clear_line(log: str, lost: str, checkpoint: int, run_dir: Path) -> str:
    """The rank left said what happened in one line, and nothing else went wrong out loud."""
    lines = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, log
    expected = (rf"error: rank 0 \(h1\) lost {re.escape(lost)} in step \d+ \(Trainer\.[\w.> ]+\): .+; "
                rf"the last complete checkpoint is step {checkpoint} in {re.escape(str(run_dir / 'checkpoints'))}$")
    assert re.fullmatch(expected, lines[0]), lines[0]
    assert "Traceback" not in log and f"Exited with exit code {EXIT_PEER_LOST}" in log, log
    return lines[0]


def _assert_intact(run_dir: Path, step: int, checksums: dict[str, str], cut_short: tuple[str, ...] = ()) -> None:
    """The checkpoint ``step`` is the newest complete one, every file as it was when it was
    complete (``checksums``); the checkpoints the fault cut short are left under their temporary
    names (``cut_short``), and every metrics record is whole."""
    root = run_dir / "checkpoints"
    with pytest.warns(UserWarning, match="ignoring incomplete checkpoint") if cut_short else contextlib.nullcontext():
        assert complete_steps(root)[-1] == step
    assert (root / "latest").read_text().strip() == f"step_{step}"
    assert _checksums(step_dir(root, step)) == checksums
    assert sorted(p.name for p in root.glob(f"{TMP_PREFIX}*")) == [f"{TMP_PREFIX}{name}" for name in cut_short]
    assert (run_dir / "metrics.jsonl").read_text().endswith("\n")
    assert [r["step"] for r in records(run_dir)] == list(range(1, len(records(run_dir)) + 1))


def _resumed(log: str, job: str, step: int, run_dir: Path) -> None:
    assert f"job {job}" in log and "1 tasks on h1" in log, log
    # Loaded on one rank what two saved: the weights and optimizer state reshard over DP.
    assert f"{run_dir}/checkpoints/step_{step}: RNG states not restored (saved by 2 ranks, loading on 1)" in log


def _kill_h2(hosts, trainers: dict[str, list[int]], abort_h1: bool) -> float:
    """Kill h2 (every process, slurmd included); with ``abort_h1`` the rank on h1 dies of SIGABRT
    as NCCL's watchdog ends it when its collective fails. It is held still meanwhile, so that it
    is aborted before it could meet the closed connection and exit on its own. When h2 died."""
    if abort_h1:
        for pid in trainers["h1"]:
            os.kill(pid, signal.SIGSTOP)
    hosts.kill_host("h2")
    killed_at = time.monotonic()
    if abort_h1:
        for pid in trainers["h1"]:
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
    return killed_at


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("when, rank_left", [
    ("in step 3", "exits"),  # gloo: the rank left reports the closed connection, exits with 69
    ("while checkpoint 4 is written", "aborted"),  # NCCL: its watchdog aborts the rank left
])
def test_killed_host_ends_the_job_which_slurm_requeues_and_resumes_on_the_host_left(base_model, tmp_path, when,
                                                                                 rank_left):
    """h2's processes and slurmd die in the middle of step 3, or while checkpoint 4 is being
    written. The rank on h1 meets the closed connection, says so in one line and exits, or
    (NCCL) is aborted by SIGABRT; either way launch.sh waits for Slurm, which declares h2 failed
    and requeues the job; shrunk to one node it resumes at DP 1 from checkpoint 2, exactly: it
    ends with the weights of a one-host run that resumes from a copy of that checkpoint."""
    _skip_without_two_hosts()
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    cut_short = ("step_4",) if "checkpoint 4" in when else ()
    with cluster(TwoHostSlurm, settings={"SlurmdTimeout": 10}) as hosts:
        # srun gives up the lost task 2 s after the rank left exits, long before Slurm declares h2
        # down: launch.sh's wait for that verdict is what keeps the job to be requeued.
        held: dict[str, list[int]] | None = None if cut_short else {}
        job = _run_to_checkpoint(hosts, base_model, run_dir, step=2, steps=4,
                                 options=("--export=ALL,TASK_EXIT_GRACE_S=2",), hold=held)
        checkpoint_2 = _checksums(step_dir(run_dir / "checkpoints", 2))
        trainers = held or _running_trainers(hosts)
        assert all(trainers.values()), trainers
        if cut_short:
            writing = run_dir / "checkpoints" / f"{TMP_PREFIX}step_4"
            hosts.wait_for(writing.exists, "checkpoint 4 to be begun", FIRST_STEPS_TIMEOUT_S, interval_s=0.01)
        lost_at = _kill_h2(hosts, trainers, abort_h1=rank_left == "aborted")
        for pid in trainers["h1"] if held else ():
            os.kill(pid, signal.SIGCONT)  # on into step 3, where h2 is gone
        report_s, exit_s = _report_and_exit_times(hosts, job, lost_at, ("h1",))
        # The reference: the same resume from a copy of checkpoint 2, as its own one-host job
        # (it runs while Slurm makes up its mind about h2).
        shutil.copytree(run_dir / "checkpoints", reference / "checkpoints")
        check = _submit(hosts, ("--nodes=1", "--ntasks-per-node=1", "--nodelist=h1"), base_model, reference,
                        "steps=4", "checkpoint.save_every=2", "checkpoint.export_hf=true")
        # Slurm's own verdict: h2 failed, the job (sbatch --requeue) goes back to the queue.
        hosts.wait_for(lambda: hosts.job_info(job).get("Restarts") == "1" and hosts.state(job) == "PENDING",
                       "Slurm to requeue the job", 60)
        requeued_s = time.monotonic() - lost_at
        log = hosts.log(job)
        if rank_left == "exits":
            _assert_one_clear_line(log, "rank 1 (host h2)", 2, run_dir)
            assert "its connection closed" in log
            assert f"a rank lost a peer (status {EXIT_PEER_LOST}); waiting up to 25 s" in log, log
        else:
            assert "\nerror: rank" not in log, log  # aborted before it could say anything
            assert "a rank lost a peer (signal SIGABRT); waiting up to 25 s" in log, log
        assert "waiting up to 25 s for Slurm to declare a failed node" in log, log
        assert "Node failure on h2" in log or "DUE TO NODE FAILURE" in log, log
        _assert_intact(run_dir, 2, checkpoint_2, cut_short)
        assert hosts.node_states()["h2"].startswith("down")

        # Go on with the host left: the requeued job, shrunk to one node, keeps its id.
        hosts.run("scontrol", "update", f"JobId={job}", "NumNodes=1", "NumTasks=1")
        resume_at = time.monotonic()
        log = _finished(hosts, job)
        resume_s = time.monotonic() - resume_at
        _resumed(log, job, 2, run_dir)
        assert f"job {job} (restart 1): 1 tasks on h1" in log
        assert [r["step"] for r in records(run_dir)][-2:] == [3, 4]
        _resumed(_finished(hosts, check), check, 2, reference)
    assert _max_difference(_weights(run_dir), _weights(reference)) == 0.0
    assert [computed(r) for r in records(run_dir)][-2:] == [computed(r) for r in records(reference)][-2:]
    assert exit_s < TIMEOUT_S and exit_s - report_s < EXIT_AFTER_LINE_S
    said = f"reported after {report_s:.1f} s" if rank_left == "exits" else "was aborted"
    print(f"\nkilled h2 {when}: the rank on h1 {said} and exited after {exit_s:.1f} s; Slurm requeued the job "
          f"after {requeued_s:.1f} s; the resumed job ran {resume_s:.1f} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_dead_trainer_on_a_live_host_is_requeued_once_per_checkpoint(base_model, tmp_path):
    """h2's trainer process dies of SIGABRT in step 3 (a crash, the OOM killer) while h2 and its
    slurmd live: no node fails, so launch.sh requeues the job itself, and it resumes on both hosts
    from checkpoint 2; h2's reward workers exit without a word. When the trainer dies again
    before the next checkpoint (here: as soon as the requeued job runs), the job is not
    requeued a second time: it fails."""
    _skip_without_two_hosts()
    run_dir = tmp_path / "run"
    with cluster(TwoHostSlurm, settings={"SlurmdTimeout": 3 * TIMEOUT_S}) as hosts:
        job = _run_to_checkpoint(hosts, base_model, run_dir, step=2, steps=4,
                                 options=("--export=ALL,TASK_EXIT_GRACE_S=2,NODE_FAIL_WAIT_S=2",))
        checkpoint_2 = _checksums(step_dir(run_dir / "checkpoints", 2))
        for pid in _running_trainers(hosts)["h2"]:
            os.kill(pid, signal.SIGABRT)
        lost_at = time.monotonic()
        report_s, exit_s = _report_and_exit_times(hosts, job, lost_at, ("h1",))
        hosts.wait_for(lambda: hosts.job_info(job).get("Restarts") == "1", "launch.sh to requeue the job", 60)
        log = hosts.log(job)
        _assert_one_clear_line(log, "rank 1 (host h2)", 2, run_dir)
        assert "EOFError" not in log and "BrokenPipeError" not in log, log
        assert f"no node of job {job} failed; requeueing it once from checkpoint step_2" in log, log
        _assert_intact(run_dir, 2, checkpoint_2)

        # The requeued job resumes on both hosts; h2's trainer dies again as soon as it runs, well
        # before checkpoint 4 (two steps later: a tiny step can take less than a poll on a busy machine).
        hosts.wait_for(lambda: "resuming" in hosts.log(job) and all(_trainer_pids(hosts, h) for h in hosts.nodes),
                       "the requeued job's trainers", FIRST_STEPS_TIMEOUT_S, interval_s=0.2)
        for pid in _running_trainers(hosts)["h2"]:
            os.kill(pid, signal.SIGABRT)
        info = hosts.wait_job(job, 120)
        log = hosts.log(job)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", f"{info}\n{log}"
    assert f"job {job} (restart 1): 2 tasks on h[1-2]" in log and "resuming" in log, log
    assert "the job was requeued from checkpoint step_2 before: not requeued" in log, log
    assert (run_dir / "requeued-after-lost-peer").read_text().strip() == "step_2"
    assert exit_s < TIMEOUT_S and exit_s - report_s < EXIT_AFTER_LINE_S
    print(f"\nh2's trainer aborted: the rank on h1 reported after {report_s:.1f} s and exited after {exit_s:.1f} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_cut_off_host_ends_the_job_within_the_timeout_and_a_resubmitted_job_resumes(base_model, tmp_path):
    """h2's link goes down in the middle of step 3: h2 stops answering without dying. The ranks
    on both hosts give each other up after distributed.timeout_s and exit, the one on h1 with its
    line in the job's log, before Slurm's SlurmdTimeout would declare h2 down; the job
    resubmitted on h1 resumes from checkpoint 2."""
    _skip_without_two_hosts()
    run_dir = tmp_path / "run"
    # Slurm notices a silent node after SlurmdTimeout: longer than the collective timeout, so
    # the rank's own report comes first.
    with cluster(TwoHostSlurm, settings={"SlurmdTimeout": 3 * TIMEOUT_S}) as hosts:
        job = _run_to_checkpoint(hosts, base_model, run_dir, step=2, steps=4)
        checkpoint_2 = _checksums(step_dir(run_dir / "checkpoints", 2))
        _running_trainers(hosts)
        hosts.link("h2", up=False)
        lost_at = time.monotonic()
        # Both ranks are alive; each gives the other up (h2's line cannot reach the job's log).
        report_s, exit_s = _report_and_exit_times(hosts, job, lost_at, ("h1", "h2"))
        hosts.wait_for(lambda: "Exited with exit code" in hosts.log(job), "srun to report the rank's exit", 30)
        line = _assert_one_clear_line(hosts.log(job), "rank 1 (host h2)", 2, run_dir)
        assert f": no answer within {TIMEOUT_S} s;" in line
        _assert_intact(run_dir, 2, checkpoint_2)

        hosts.run("scancel", job)
        hosts.wait_job(job, 60)
        resubmitted = _submit(hosts, ("--nodes=1", "--ntasks-per-node=1", "--exclude=h2"), base_model, run_dir,
                              "steps=4", "checkpoint.save_every=2", "checkpoint.export_hf=true")
        resume_at = time.monotonic()
        log = _finished(hosts, resubmitted)
        resume_s = time.monotonic() - resume_at
        _resumed(log, resubmitted, 2, run_dir)
    assert [r["step"] for r in records(run_dir)][-2:] == [3, 4]
    # The rank gives up a collective distributed.timeout_s after it began, which may be before or
    # after the link went down: the line's "no answer within 10 s" tells the timeout, and the
    # report comes within two timeouts of the cut. Then the rank exits at once.
    assert report_s <= exit_s < 2 * TIMEOUT_S and exit_s - report_s < EXIT_AFTER_LINE_S
    print(f"\ncut off h2: the rank on h1 reported after {report_s:.1f} s; both ranks had exited after {exit_s:.1f} s "
          f"(distributed.timeout_s={TIMEOUT_S}); the resubmitted job ran {resume_s:.1f} s")
