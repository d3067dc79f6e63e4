"""Who am I in the job: rank, world size, local rank and rendezvous address, then the process group.

Two launchers are understood, torchrun first:

* torchrun (or anything that exports its variables): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
* Slurm ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``. The master is
  ``MASTER_ADDR`` if exported, else the first host of the step's node list (compressed
  lists such as ``gpu[01-03,07]`` are expanded here, no ``scontrol`` needed); the port is
  ``MASTER_PORT`` if exported, else derived from ``SLURM_JOB_ID`` so every task of a job
  agrees on it without talking.

A process with neither is a world of one on 127.0.0.1.

:func:`init_distributed` is where a rank is launched: given the machine its command decided
on, it places the rank (``device.place_rank``), joins the process group and returns the
placement that the builders take.
"""
from __future__ import annotations

import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from gdpo_megatron.device import Machine, Placement, place_rank

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_TASK_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
# The step's own list first: task 0 of a step runs on the step's first node.
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
# Ports derived from the job id stay below Linux's ephemeral range (32768 and up).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 12000, 20000


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job and where the ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"

    def torchrun_vars(self) -> dict[str, str]:
        """The same facts under torchrun's names (what ``env://`` and other libraries read)."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def resolve_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables from ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        _require(env, TORCHRUN_VARS, "torchrun")
        launch = LaunchEnv(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK"),
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT"),
            launcher="torchrun",
        )
    elif "SLURM_PROCID" in env:
        _require(env, SLURM_TASK_VARS, "Slurm (srun)")
        launch = LaunchEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID"),
            master_addr=env.get("MASTER_ADDR") or _slurm_master_addr(env),
            master_port=_int(env, "MASTER_PORT") if env.get("MASTER_PORT") else _slurm_master_port(env),
            launcher="slurm",
        )
    else:
        launch = LaunchEnv(
            rank=0,
            world_size=1,
            local_rank=0,
            master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
            # any free port: two single-process runs on one machine must not meet
            master_port=_int(env, "MASTER_PORT") if env.get("MASTER_PORT") else free_port(),
            launcher="single",
        )
    _check(launch)
    return launch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(machine: Machine, backend: str | None = None,
                     timeout: timedelta | None = None) -> tuple[LaunchEnv, Placement]:
    """Place this rank on ``machine`` and start the default process group from the launcher's
    environment; the launch facts and the rank's placement.

    Backend: ``machine.backend`` (``nccl`` with CUDA, else ``gloo``) unless given. With CUDA
    the current device is set from the local rank first. The resolved values are exported
    under torchrun's names (see :func:`exported_env`), so libraries that read them (vLLM,
    megatron-core) agree with this process on its rank and its device.
    """
    launch = resolve_launch_env()
    if dist.is_initialized():
        raise RuntimeError("init_distributed: torch.distributed is already initialized in this process")
    placement = place_rank(machine, launch.local_rank)
    os.environ.update(exported_env(launch, placement.device.index if machine.cuda else None))
    dist.init_process_group(
        backend or machine.backend,
        init_method="env://",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timeout,
    )
    return launch, placement


def exported_env(launch: LaunchEnv, cuda_device: int | None) -> dict[str, str]:
    """The variables :func:`init_distributed` exports: torchrun's names for ``launch``, with
    ``LOCAL_RANK`` set to the CUDA device this process uses, when it uses one.

    vLLM's ``external_launcher`` executor takes ``LOCAL_RANK`` as its local rank and the
    worker selects ``cuda:{local rank}`` among the visible devices (after asserting it is below
    their count). With one GPU bound to each task that device is 0 whatever the task's place
    on the node, so exporting ``SLURM_LOCALID`` there would send every task but the first to
    an ordinal that does not exist.
    """
    env = launch.torchrun_vars()
    if cuda_device is not None:
        env["LOCAL_RANK"] = str(cuda_device)
    return env


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm host list, in order.

    ``"gpu[01-03,07],login1"`` -> gpu01, gpu02, gpu03, gpu07, login1. Zero padding follows
    the range's first number; several bracket groups in one name (``r[1-2]n[1-2]``) expand
    to every combination.
    """
    items = _split_top_level(nodelist)
    return [host for item in items for host in _expand_item(item, nodelist)]


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise ValueError(f"node list {nodelist!r}: unbalanced or nested brackets at position {i}")
    if depth:
        raise ValueError(f"node list {nodelist!r}: '[' without a closing ']'")
    items.append(nodelist[start:])
    if not all(item.strip() for item in items):
        raise ValueError(f"node list {nodelist!r}: expected comma-separated host names, found an empty one")
    return [item.strip() for item in items]


def _expand_item(item: str, nodelist: str) -> list[str]:
    parts = re.split(r"\[([^\]]*)\]", item)  # odd positions hold the bracket contents
    choices = [[p] if i % 2 == 0 else _expand_ranges(p, nodelist) for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    out = []
    for piece in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not m:
            raise ValueError(f"node list {nodelist!r}: {piece!r} is not a number or a range like 01-03")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"node list {nodelist!r}: range {piece!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    for name in SLURM_NODELIST_VARS:
        if env.get(name):
            return expand_nodelist(env[name])[0]
    raise ValueError(
        f"Slurm (srun) environment: no master address; set MASTER_ADDR or one of {SLURM_NODELIST_VARS}"
    )


def _slurm_master_port(env: Mapping[str, str]) -> int:
    if not env.get("SLURM_JOB_ID"):
        raise ValueError("Slurm (srun) environment: no master port; set MASTER_PORT or SLURM_JOB_ID")
    return SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN


def _require(env: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise ValueError(
            f"{launcher} environment is incomplete: {', '.join(missing)} not set "
            f"(expected all of {', '.join(names)})"
        )


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {env[name]!r}") from None


def _check(launch: LaunchEnv) -> None:
    where = f"{launch.launcher} environment"
    if launch.world_size < 1:
        raise ValueError(f"{where}: world size must be >= 1, got {launch.world_size}")
    if not 0 <= launch.rank < launch.world_size:
        raise ValueError(f"{where}: rank {launch.rank} is outside [0, {launch.world_size})")
    if launch.local_rank < 0:
        raise ValueError(f"{where}: local rank must be >= 0, got {launch.local_rank}")
    if not 0 < launch.master_port < 65536:
        raise ValueError(f"{where}: master port must be in [1, 65535], got {launch.master_port}")
    if not launch.master_addr:
        raise ValueError(f"{where}: master address is empty")
