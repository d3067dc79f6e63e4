"""Processes of sandboxed runs: who runs them, and killing and reaping what is left of them.

As root, runs execute as user ids of their own, two per caller process (:func:`sandbox_uid`), so
that a run's processes can be found and killed by user id, and two runs started side by side (an
assert test's judge and program) cannot reach each other. A process left after a run escaped it:
:func:`damage` finds, kills and reaps it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

from gdpo_megatron.rewards.sandbox.limits import SandboxError

# How long a killed process may take to be gone before that is an error. The kernel ends a PID
# namespace's init only once every process in it is gone; on a loaded machine (load 14, two
# cores) that took over 5 s for a run that had forked 31 processes.
REAP_TIMEOUT_S = 30.0
# Sandbox user ids: _UID_BASE + user * _UID_STRIDE + the pid of the process running the sandbox.
_UID_BASE, _UID_STRIDE = 10_000_000, 1 << 22  # the stride is above the largest pid (PID_MAX_LIMIT)
SANDBOX_USERS = 2  # per caller: runs started side by side run as different users
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_libc = ctypes.CDLL(None, use_errno=True)
_adopting = [0, False]  # runs in flight that need this process to adopt their orphans; it did before them


def adopt_orphans() -> None:
    """Make this process a child subreaper while a run is in flight: processes of the run that
    are orphaned on the host (bubblewrap's init outlives its monitor) come back to it, to be
    reaped. The first run sets it; :func:`stop_adopting` after the last restores what it was."""
    if _adopting[0] == 0:
        state = ctypes.c_int(0)
        _libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(state), 0, 0, 0)
        _adopting[1] = bool(state.value)
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _adopting[0] += 1


def stop_adopting() -> None:
    """A run that called :func:`adopt_orphans` is over, all its processes reaped."""
    _adopting[0] -= 1
    if _adopting[0] == 0 and not _adopting[1]:
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def damage() -> str | None:
    """What is wrong with this process after its sandboxed runs ended, or ``None``.

    Between runs it has no child process left: each run kills and reaps everything it
    started. A child found here escaped a run (or the sandbox failed); it is killed and
    reaped, and the process should be replaced, since whatever escaped may have changed it.
    """
    left = children()
    for pid in left:
        kill_pid(pid)
        reap(pid)
    return f"{len(left)} process(es) of a sandboxed run outlived it" if left else None


def children() -> list[int]:
    """This process's child processes (zombies included): read from each of its threads'
    ``children`` list where the kernel has one, else found by a scan of every process."""
    try:
        return [int(pid) for task in os.scandir("/proc/self/task")
                for pid in Path(task.path, "children").read_text().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN, or a thread that just ended
        pass
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def sandbox_uid(pid: int, user: int = 0) -> int:
    """User id that sandbox user ``user`` of process ``pid`` runs programs as (when it is root)."""
    return _UID_BASE + user * _UID_STRIDE + pid


def kill_sandbox_processes(pid: int) -> None:
    """SIGKILL every process of the sandbox users of ``pid``, and reap those that are this
    process's children (a child subreaper gets the orphans)."""
    for user in range(SANDBOX_USERS):
        kill_user(sandbox_uid(pid, user))


def kill_user(uid: int) -> None:
    """SIGKILL every process of user ``uid`` and reap those that are this process's children.

    A child that switches to that user and calls ``kill(-1)`` reaches exactly those
    processes, atomically with respect to their forks. Zombies of other parents are theirs
    to reap.
    """
    if any(state != "Z" for _, state, _ in _processes_of(uid)):
        child = os.fork()
        if child == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(child, 0)
    deadline = time.monotonic() + REAP_TIMEOUT_S
    me = os.getpid()
    while time.monotonic() < deadline:
        left = [(p, state) for p, state, parent in _processes_of(uid) if state != "Z" or parent == me]
        if not left:
            return
        for p, state in left:
            if state == "Z":
                try:
                    os.waitpid(p, 0)
                except ChildProcessError:  # reaped meanwhile
                    pass
        time.sleep(0.001)  # the others are still dying


def _processes_of(uid: int) -> list[tuple[int, str, int]]:
    """(pid, state, parent pid) of every process whose real user is ``uid``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                real_uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            if real_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        found.append((int(entry.name), fields[0], int(fields[1])))
    return found


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def reap(pid: int) -> None:
    """Wait for child ``pid`` to exit (it was killed) and reap it; nothing if it is not ours."""
    deadline = time.monotonic() + REAP_TIMEOUT_S
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                raise SandboxError(f"sandbox: process {pid} survives SIGKILL")
            time.sleep(0.001)
    except ChildProcessError:  # reaped by its own parent
        pass


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_prefix(pid: int) -> str:
    """How the working directories and cgroups of process ``pid``'s runs are named."""
    return f"gdpo-sandbox-{pid}-"
