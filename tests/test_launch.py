"""Launch environment: Slurm host lists, torchrun/srun resolution, and a real 2-task gloo start."""
import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from gdpo_megatron.device import cuda_device_for
from gdpo_megatron.distributed.launch import (
    LaunchEnv,
    expand_nodelist,
    exported_env,
    resolve_launch_env,
)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node07", ["node07"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("n[1-2],login,x[009-010]", ["n1", "n2", "login", "x009", "x010"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("rack-1-node[001-002]-ib", ["rack-1-node001-ib", "rack-1-node002-ib"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist, match",
    [
        ("", "empty one"),
        ("node[01-03", "without a closing"),
        ("node]", "unbalanced"),
        ("a[1-[2]]", "nested"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "'a-b' is not a number"),
        ("node[]", "'' is not a number"),
        ("a,,b", "empty one"),
    ],
)
def test_bad_nodelist_is_named(nodelist, match):
    with pytest.raises(ValueError, match=match):
        expand_nodelist(nodelist)


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "29400"}
SRUN = {
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "6",
    "SLURM_JOB_ID": "4242817",
    "SLURM_JOB_NODELIST": "big[001-004]",
    "SLURM_NODELIST": "gpu[17-18]",
    "SLURM_STEP_NODELIST": "gpu[17-18]",
}


@pytest.mark.parametrize(
    "environ, expected",
    [
        (TORCHRUN, LaunchEnv(5, 8, 1, "10.0.0.4", 29400, "torchrun")),
        # srun: first host of the step, port 12000 + 4242817 % 20000 = 14817
        (SRUN, LaunchEnv(6, 16, 6, "gpu17", 14817, "slurm")),
        ({**SRUN, "SLURM_STEP_NODELIST": ""}, LaunchEnv(6, 16, 6, "gpu17", 14817, "slurm")),
        (_without(SRUN, "SLURM_STEP_NODELIST", "SLURM_NODELIST"), LaunchEnv(6, 16, 6, "big001", 14817, "slurm")),
        ({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "23456"}, LaunchEnv(6, 16, 6, "head", 23456, "slurm")),
        ({**SRUN, **TORCHRUN}, LaunchEnv(5, 8, 1, "10.0.0.4", 29400, "torchrun")),  # torchrun inside srun
        ({"MASTER_PORT": "31000"}, LaunchEnv(0, 1, 0, "127.0.0.1", 31000, "single")),
    ],
)
def test_resolve_launch_env(environ, expected):
    assert resolve_launch_env(environ) == expected


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"RANK": "0"}, r"torchrun environment is incomplete: WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        (_without(TORCHRUN, "LOCAL_RANK"), r"incomplete: LOCAL_RANK not set"),
        (_without(SRUN, "SLURM_LOCALID"), r"Slurm \(srun\) environment is incomplete: SLURM_LOCALID"),
        (_without(SRUN, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"), r"set MASTER_ADDR or one of"),
        (_without(SRUN, "SLURM_JOB_ID"), r"set MASTER_PORT or SLURM_JOB_ID"),
        ({**SRUN, "SLURM_PROCID": "six"}, r"SLURM_PROCID: expected an integer, got 'six'"),
        ({**SRUN, "SLURM_PROCID": "16"}, r"rank 16 is outside \[0, 16\)"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, r"master port must be in \[1, 65535\], got 70000"),
        ({**SRUN, "SLURM_STEP_NODELIST": "gpu[17-18"}, r"node list 'gpu\[17-18'"),
    ],
)
def test_incomplete_environment_is_named(environ, match):
    with pytest.raises(ValueError, match=match):
        resolve_launch_env(environ)


def test_cuda_device_for_local_rank():
    assert [cuda_device_for(r, 8) for r in range(8)] == list(range(8))
    assert cuda_device_for(5, 1) == 0  # --gpus-per-task=1: each task sees only its own GPU
    with pytest.raises(RuntimeError, match="local rank 4 has no GPU: this task sees 4 CUDA devices"):
        cuda_device_for(4, 4)


def test_exported_local_rank_is_the_device_vllm_will_select():
    """vLLM's external launcher opens ``cuda:{LOCAL_RANK}``: with one GPU per task that is 0."""
    task6 = resolve_launch_env(SRUN)  # SLURM_LOCALID 6
    one_gpu_per_task = exported_env(task6, cuda_device_for(task6.local_rank, 1))
    assert one_gpu_per_task == {"RANK": "6", "WORLD_SIZE": "16", "LOCAL_RANK": "0", "MASTER_ADDR": "gpu17",
                                "MASTER_PORT": "14817"}
    assert exported_env(task6, cuda_device_for(task6.local_rank, 8))["LOCAL_RANK"] == "6"  # all GPUs visible
    assert exported_env(task6, None)["LOCAL_RANK"] == "6"  # no CUDA: the launcher's local rank


WORKER = textwrap.dedent(
    """
    import json, os, torch, torch.distributed as dist
    from gdpo_megatron.device import CPU
    from gdpo_megatron.distributed.launch import init_distributed
    launch, placement = init_distributed(CPU)
    t = torch.tensor([float(dist.get_rank() + 1)], device=placement.device)
    dist.all_reduce(t)
    print(json.dumps({"launch": list(launch.__dict__.values()), "device": str(placement.device),
                      "backend": dist.get_backend(),
                      "world": dist.get_world_size(), "sum": t.item(), "MASTER_PORT": os.environ["MASTER_PORT"]}))
    dist.destroy_process_group()
    """
)


def _port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_two_srun_tasks_start_a_gloo_world():
    # As srun sets them: no MASTER_* variables; the port comes from the job id.
    job_id = next(j for j in itertools.count(os.getpid()) if _port_is_free(12000 + j % 20000))
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in TORCHRUN}
    base.update(
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        SLURM_JOB_ID=str(job_id),
        SLURM_NTASKS="2",
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NODELIST="localhost",
        SLURM_STEP_NODELIST="localhost",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER],
            env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    port = 12000 + job_id % 20000
    for r, res in enumerate(results):
        assert res["launch"] == [r, 2, r, "localhost", port, "slurm"] and res["device"] == "cpu"
        assert (res["backend"], res["world"], res["sum"], res["MASTER_PORT"]) == ("gloo", 2, 3.0, str(port))


GPU_WORKER = textwrap.dedent(
    """
    import json, os, torch, torch.distributed as dist
    from gdpo_megatron.device import CUDA
    from gdpo_megatron.distributed.launch import init_distributed
    _, placement = init_distributed(CUDA)
    t = torch.ones(2, device=placement.device)
    dist.all_reduce(t)
    print(json.dumps({"backend": dist.get_backend(), "device": torch.cuda.current_device(), "sum": t.sum().item(),
                      "LOCAL_RANK": os.environ["LOCAL_RANK"]}))
    dist.destroy_process_group()
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("local_id", ["0", "3"])
def test_one_srun_task_starts_nccl_on_its_gpu(local_id):
    """As under ``--gpus-per-task=1``: the task sees one GPU whatever its place on the node."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in TORCHRUN}
    port = next(p for p in itertools.count(12000 + os.getpid() % 20000) if _port_is_free(p))
    env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID=local_id, SLURM_NODELIST="localhost",
               MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    out = subprocess.run([sys.executable, "-c", GPU_WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"backend": "nccl", "device": 0, "sum": 2.0,
                                                               "LOCAL_RANK": "0"}


def test_single_process_takes_a_free_port():
    from gdpo_megatron.distributed.launch import resolve_launch_env

    env = resolve_launch_env({})
    assert (env.rank, env.world_size, env.launcher, env.master_addr) == (0, 1, "single", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", env.master_port))  # nothing listens there
