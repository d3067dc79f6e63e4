"""A memory cgroup per run: one ``memory_bytes`` bound for all of a run's processes, as root.

A run's cgroup is created under this process's own memory cgroup (cgroup v1, or v2 where the
memory controller is delegated to child groups), limited to ``memory_bytes`` without swap, and
removed after the run; tmpfs pages, memfd files, shared memory and pipe buffers the run's
processes allocate are charged to it.
"""
from __future__ import annotations

import functools
import itertools
import os
import time
from pathlib import Path

from gdpo_megatron.rewards.sandbox.limits import SandboxError
from gdpo_megatron.rewards.sandbox.processes import REAP_TIMEOUT_S, kill_pid, run_prefix

_groups = itertools.count()


class MemoryCgroup:
    """A memory cgroup for one run (cgroup v1 or v2), limit ``memory_bytes`` without swap."""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version
        self.procs_file = path / "cgroup.procs"

    @classmethod
    def create(cls, memory_bytes: int) -> "MemoryCgroup | None":
        parent = memory_cgroup_parent()
        if parent is None:
            return None
        group = cls(parent[0] / f"{run_prefix(os.getpid())}{next(_groups)}", parent[1])
        try:
            group.path.mkdir()
            if group.version == 1:
                (group.path / "memory.limit_in_bytes").write_text(str(memory_bytes))
                swap = group.path / "memory.memsw.limit_in_bytes"  # memory + swap, when swap accounting is on
                if swap.exists():
                    swap.write_text(str(memory_bytes))
            else:
                (group.path / "memory.max").write_text(str(memory_bytes))
                (group.path / "memory.swap.max").write_text("0")
        except OSError as e:
            group.remove()
            raise SandboxError(f"sandbox: could not set up the memory cgroup {group.path}: {e}") from e
        return group

    def oom_killed(self) -> bool:
        return self._count("memory.oom_control" if self.version == 1 else "memory.events", "oom_kill") > 0

    def charged(self) -> bool:
        """Whether processes in the group have faulted memory in (so they ran under its bound)."""
        return self._count("memory.stat", "pgfault") > 0

    def _count(self, file: str, key: str) -> int:
        try:
            counts = dict(line.split()[:2] for line in (self.path / file).read_text().splitlines())
        except OSError:
            return 0
        return int(counts.get(key, 0))

    def remove(self) -> None:
        """Kill anything still in the group, then remove it."""
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while self.path.exists():
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SandboxError(f"sandbox: processes left in {self.path} survive SIGKILL") from None
            try:
                for pid in self.procs_file.read_text().split():
                    kill_pid(int(pid))
            except OSError:
                pass
            time.sleep(0.005)


@functools.cache
def memory_cgroup_parent() -> tuple[Path, int] | None:
    """This process's own memory cgroup directory and the cgroup version, if run groups can be
    created under it with a memory limit (root with a writable v1 memory hierarchy, or a v2
    group whose memory controller is delegated to its children)."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields, fstype, options = left.split(), right.split()[0], right.split()[-1]
            if fstype == "cgroup" and "memory" in options.split(","):
                mounts[1] = (fields[3], fields[4])
            elif fstype == "cgroup2":
                mounts.setdefault(2, (fields[3], fields[4]))
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            version = 1 if "memory" in controllers.split(",") else 2 if controllers == "" else None
            if version not in mounts:
                continue
            root, mount_point = mounts[version]
            own = Path(mount_point) / os.path.relpath(path, root)
            limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
            probe = own / f"{run_prefix(os.getpid())}probe"
            try:
                if version == 2 and "memory" not in (own / "cgroup.subtree_control").read_text().split():
                    continue
                probe.mkdir()
                try:
                    usable = (probe / limit_file).exists() and os.access(probe / "cgroup.procs", os.W_OK)
                finally:
                    probe.rmdir()
            except OSError:
                continue
            if usable:
                return own, version
    return None
