"""Run untrusted Python programs (model-written code) with limits, and leave nothing behind.

:func:`run_python` / :func:`start_python` run a program in a fresh working directory with a
scrubbed environment, CPU, wall-time, memory, process, output and disk limits
(:class:`SandboxLimits`), no_new_privs, a session keyring of its own and a system call filter
(:mod:`.seccomp`: no socket but AF_UNIX, no keyrings, io_uring, userfaultfd, ptrace,
namespaces or mounts), and kill and reap everything it started when it ends (:mod:`.run`).

Two isolation levels; :func:`isolation` reports the strongest that works here and what it
guarantees, each guarantee measured by a probe run (:mod:`.levels`; docs/rewards.md has the
table):

``"bwrap"`` (bubblewrap installed and allowed to create user namespaces): the program runs in
  new user, PID, IPC, network, UTS, cgroup and mount namespaces, in a root of read-only system
  directories (/usr and the interpreter), with a /tmp working directory and a /dev/shm of
  ``disk_bytes`` each as its only writable places. As root it also runs as a user id of its
  own, and where a memory cgroup can be created, all of its processes share one
  ``memory_bytes`` bound.
``"basic"`` (no working bubblewrap; to be chosen explicitly, see ``rewards.allow_weaker_sandbox``):
  as root, where the kernel lets it create namespaces, the same root and namespaces built by
  the sandbox itself (:mod:`.namespaces`), minus the user namespace. Otherwise the program
  shares the host's namespaces and files: it runs as its own user id in a private directory as
  root (and writes wherever that user may), as the caller's user otherwise.

Programs run with one Python interpreter (:func:`use_python` chooses it, e.g. a virtual
environment with numpy; by default this one, or as root one that other users may run, often
the system's with the standard library only); :func:`programs_python` says which, and what
packages a program can import there.

A failure of the sandbox itself (bubblewrap or the interpreter cannot start, no level works,
an architecture the filter has no table for) raises :class:`SandboxError`; it is never reported
as the program's own result. Linux only (>= 5.3: pidfd), x86_64 or aarch64. Call it from a
single-threaded process (the reward stage's workers are): the limits are set between fork and exec.
"""
from __future__ import annotations

import time

from gdpo_megatron.rewards.sandbox.levels import (
    GUARANTEES, ISOLATION_LEVELS, Isolation, ProgramsPython, allow_weaker, allowed_setup, bwrap_missing, default_setup,
    isolation, probe, programs_python, use_python,
)
from gdpo_megatron.rewards.sandbox.limits import RunResult, SandboxError, SandboxLimits
from gdpo_megatron.rewards.sandbox.processes import SANDBOX_USERS, damage, kill_sandbox_processes, sandbox_uid
from gdpo_megatron.rewards.sandbox.run import SandboxedRun, Setup, clean_up_after, python_problem

__all__ = [
    "GUARANTEES", "ISOLATION_LEVELS", "Isolation", "ProgramsPython", "RunResult", "allow_weaker", "allowed_setup",
    "default_setup", "SANDBOX_USERS", "SandboxError", "SandboxLimits", "SandboxedRun", "Setup", "bwrap_missing",
    "clean_up_after", "damage", "isolation", "kill_sandbox_processes", "probe", "programs_python", "python_problem", "run_python",
    "sandbox_uid", "start_python", "use_python",
]


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               level: str | None = None) -> RunResult:
    """Run ``code`` as ``main.py`` (as ``__main__``) in a fresh directory, feeding it ``stdin``.

    ``level``: the isolation level, default the strongest available (:func:`isolation`); below
    bwrap that default raises :class:`SandboxError` unless :func:`allow_weaker` chose it (then
    the fallback is logged once).
    """
    return start_python({"main.py": code}, stdin, limits, level).finish(time.monotonic() + limits.wall_s)


def start_python(files: dict[str, str], stdin: str = "", limits: SandboxLimits = SandboxLimits(),
                 level: str | None = None, pass_fds: tuple[int, ...] = (), user: int = 0) -> SandboxedRun:
    """Start ``main.py`` of ``files`` (name -> text, all written to the working directory).

    ``pass_fds`` stay open in the program under the same numbers (e.g. pipes to another run).
    ``user`` (0 or 1): which of the caller's sandbox users runs it, when the caller is root.
    Runs that live side by side need different users: at the basic level without namespaces
    two runs of one user can read and signal each other, and a run's end sweeps its user's
    processes. Call ``finish`` on the result to wait for it and clean up.
    """
    if "main.py" not in files:
        raise ValueError(f"sandbox: files must include 'main.py', got {sorted(files)}")
    if user not in range(SANDBOX_USERS):
        raise ValueError(f"sandbox: user must be one of {list(range(SANDBOX_USERS))}, got {user!r}")
    return SandboxedRun(files, stdin, limits, allowed_setup() if level is None else isolation(level).setup, pass_fds,
                        user)
