"""Run untrusted Python programs (model-written code) with limits, and clean up after them.

Every run gets a fresh temporary working directory (removed afterwards), a scrubbed
environment, its own session/process group, and these limits: CPU seconds (RLIMIT_CPU),
address space (RLIMIT_AS), processes (RLIMIT_NPROC), bytes per written file (RLIMIT_FSIZE,
which also caps the captured stdout and stderr: they are files), and a wall-clock timeout
after which the whole process tree is killed.

Two isolation levels, chosen once per process by probing (see :func:`isolation`):

``"namespaces"`` (running as root with a Python interpreter other users can execute):
  the program runs as an unprivileged user id of its own, in a new network namespace (no
  interface but a down loopback: every connection fails) and a new mount namespace whose
  world-writable directories (/tmp, /var/tmp, /dev/shm, /run/lock) are fresh, private
  tmpfs mounts. Contained: network access; writing anywhere but its working directory
  (the user id owns nothing else, and writes to those world-writable places vanish with
  the namespace; other world-writable directories, if a host has any, are not covered);
  reading the parent's environment (``/proc/<pid>/environ`` is denied to
  another user); signalling the parent or any other process; fork bombs (RLIMIT_NPROC
  counts the processes of that user id only); processes that escape the process group
  (``setsid``, double fork) are killed by a sweep over the user id, and reaped by the
  calling process, which becomes a child subreaper. Not contained: reading world-readable
  files (keep datasets with expected outputs unreadable to other users), and CPU/memory
  contention with the host within the limits.

``"basic"`` (any other case): the same limits, but the program runs as the calling user
  and network access is blocked by refusing to import socket-level modules
  (``network_isolation() == "import-guard"``), which code can undo. NOT contained at this
  level: writes outside the working directory, reading ``/proc/<parent>/environ``, signals
  to the caller, and processes that leave the process group. RLIMIT_NPROC counts all of
  the user's processes (and does not apply to root). Run the trainer as root in a container
  to get the namespaces level.

Linux only (>= 5.3: pidfd). Call it from a single-threaded process (the reward stage's
workers are): the limits are set between fork and exec.
"""
from __future__ import annotations

import ctypes
import functools
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ISOLATION_LEVELS = ("namespaces", "basic")
_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_REC, _MS_PRIVATE, _MS_BIND = 0x4000, 1 << 18, 0x1000
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_REAP_TIMEOUT_S = 5.0
_PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_UID_BASE = 10_000_000  # sandbox user ids are _UID_BASE + pid of the process running the sandbox
_BLOCKED_MODULES = ("socket", "_socket", "ssl", "_ssl", "select", "selectors", "asyncio",
                    "http", "urllib", "ftplib", "smtplib", "telnetlib", "xmlrpc", "multiprocessing")
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20  # per written file, stdout and stderr included
    processes: int = 32

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_bytes", "output_bytes", "processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limits: {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RunResult:
    returncode: int | None  # negative: killed by that signal; None: killed at the wall timeout
    stdout: str
    stderr: str
    timed_out: bool  # wall-clock or CPU time limit reached
    output_limited: bool  # a write went past ``output_bytes``

    @property
    def ok(self) -> bool:
        """The program ran to the end without an error."""
        return self.returncode == 0 and not self.timed_out and not self.output_limited


def run_python(
    code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), level: str | None = None
) -> RunResult:
    """Run ``code`` as ``main.py`` in a fresh directory, feeding it ``stdin``.

    ``level``: the isolation level, default the strongest available (:func:`isolation`).
    """
    level = level or isolation()
    if level not in ISOLATION_LEVELS or (level == "namespaces" and isolation() != "namespaces"):
        raise ValueError(f"sandbox level: expected 'basic' or an available level ({isolation()!r}), got {level!r}")
    uid = sandbox_uid(os.getpid()) if level == "namespaces" else None
    workdir = Path(tempfile.mkdtemp(prefix=_workdir_prefix(os.getpid())))
    try:
        (workdir / "main.py").write_text(code, encoding="utf-8")
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, stat.S_IRWXU)
            _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            args = [_interpreter_for_other_users(), "-I", "main.py"]
        else:
            args = [sys.executable, "-I", "-c", _import_guard_runner()]
        with tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            inp.write(stdin.encode("utf-8"))
            inp.seek(0)
            proc = subprocess.Popen(
                args, stdin=inp, stdout=out, stderr=err, cwd=workdir, env=_scrubbed_env(workdir),
                start_new_session=True, preexec_fn=functools.partial(_child_setup, limits, uid, str(workdir)),
            )
            exited = False
            try:
                exited = _exits_within(proc, limits.wall_s)
            finally:
                _kill_group(proc.pid)  # not reaped yet, so its pid still names only its group
                proc.kill()  # in case it left its group; no-op if it has exited
                status = proc.wait()
                if uid is not None:
                    kill_sandbox_processes(os.getpid())  # whatever escaped the group
            returncode = status if exited else None
            stdout, stdout_full = _read_capped(out, limits.output_bytes)
            stderr, stderr_full = _read_capped(err, limits.output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    timed_out = returncode is None or returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    output_limited = returncode == -signal.SIGXFSZ or stdout_full or stderr_full
    return RunResult(returncode, stdout, stderr, timed_out, output_limited)


@functools.cache
def isolation() -> str:
    """``"namespaces"`` or ``"basic"`` (see the module docstring), probed once per process."""
    if os.geteuid() != 0 or _interpreter_for_other_users() is None:
        return "basic"
    probe_uid = sandbox_uid(os.getpid())
    with tempfile.TemporaryDirectory(prefix="gdpo-sandbox-probe-") as d:
        os.chown(d, probe_uid, probe_uid)
        try:
            rc = subprocess.run(
                [_interpreter_for_other_users(), "-I", "-c", "pass"], cwd=d, env=_scrubbed_env(Path(d)),
                preexec_fn=functools.partial(_child_setup, SandboxLimits(), probe_uid, d),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
            ).returncode
        except (OSError, subprocess.SubprocessError):
            return "basic"
    return "namespaces" if rc == 0 else "basic"


def network_isolation() -> str:
    """``"netns"`` (own network namespace) or ``"import-guard"`` (socket modules refused)."""
    return "netns" if isolation() == "namespaces" else "import-guard"


def sandbox_uid(pid: int) -> int:
    """User id the sandboxed programs started by process ``pid`` run as (namespaces level)."""
    return _UID_BASE + pid


def clean_up_after(pid: int) -> None:
    """Kill the sandboxed processes and remove the working directories that process ``pid``
    left behind (when it was killed in the middle of a run)."""
    kill_sandbox_processes(pid)
    for leftover in Path(tempfile.gettempdir()).glob(f"{_workdir_prefix(pid)}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def kill_sandbox_processes(pid: int) -> None:
    """SIGKILL and reap every process of the sandbox user of ``pid`` (only the namespaces level
    runs programs as that user; the check needs no probe, so any process may call this).

    A child that switches to that user and calls ``kill(-1)`` reaches exactly those
    processes, atomically with respect to their forks. Orphans were re-parented to the
    caller (a child subreaper while it ran them), which reaps them so they do not hold
    process slots; zombies of other parents are theirs to reap.
    """
    uid = sandbox_uid(pid)
    if not any(state != "Z" for _, state, _ in _processes_of(uid)):
        return  # none can appear: only the user's own processes create more of them
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
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    me = os.getpid()
    while time.monotonic() < deadline:
        left = [(p, state, parent) for p, state, parent in _processes_of(uid) if state != "Z" or parent == me]
        if not left:
            return
        for p, state, _ in left:
            if state == "Z":
                try:
                    os.waitpid(p, 0)
                except ChildProcessError:  # reaped meanwhile
                    pass
        time.sleep(0.001)  # the others are still dying


def _processes_of(uid: int) -> list[tuple[int, str, int]]:
    """(pid, state, parent pid) of every process whose effective user is ``uid``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append((int(entry.name), fields[0], int(fields[1])))
    return found


def _workdir_prefix(pid: int) -> str:
    return f"gdpo-sandbox-{pid}-"


def _child_setup(limits: SandboxLimits, uid: int | None, workdir: str) -> None:
    """Runs in the child between fork and exec (the session is already new)."""
    if uid is not None:
        _check(_libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS), "unshare")
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "make mounts private")
        for path in _PRIVATE_TMPFS:
            if os.path.isdir(path):
                _check(_libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, b"size=64m,mode=1777"), f"tmpfs {path}")
        # The working directory (the cwd, under one of the directories just hidden) shows
        # through again at its own path.
        os.makedirs(workdir, exist_ok=True)
        _check(_libc.mount(b".", workdir.encode(), None, _MS_BIND, None), "bind the working directory")
        os.chdir(workdir)
    for limit, value in (
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_NPROC, (limits.processes, limits.processes)),
        (resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    # After the user switch, which clears it: die with the process that started us.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox: {what} failed: {os.strerror(err)}")


def _exits_within(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` seconds; woken by a pidfd, not by polling,
    and without reaping it."""
    fd = os.pidfd_open(proc.pid)
    try:
        exited, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(exited)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(f, cap: int) -> tuple[str, bool]:
    """The first ``cap`` bytes of a captured stream, and whether it reached the cap."""
    f.seek(0)
    data = f.read(cap)
    return data.decode("utf-8", errors="replace"), len(data) >= cap


def _scrubbed_env(workdir: Path) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def _import_guard_runner() -> str:
    """``python -c`` text that refuses socket-level imports, then runs main.py as __main__."""
    return (
        "import sys\n"
        f"for _m in {_BLOCKED_MODULES!r}: sys.modules[_m] = None\n"
        "del _m\n"
        "sys.argv = ['main.py']\n"
        "exec(compile(open('main.py', encoding='utf-8').read(), 'main.py', 'exec'), {'__name__': '__main__'})\n"
    )


@functools.cache
def _interpreter_for_other_users() -> str | None:
    """A Python 3 interpreter an unprivileged user can run: this one if its installation is
    world-readable (virtualenvs under /root usually are not), else the system's."""
    candidates = [Path(sys.executable).resolve()]
    candidates += [Path(p) for p in ("/usr/local/bin/python3", "/usr/bin/python3")]
    for exe in candidates:
        if exe.is_file() and _world_accessible(exe.resolve()):
            return str(exe)
    return None


def _world_accessible(exe: Path) -> bool:
    """Every directory above ``exe`` is world-searchable and ``exe`` is world-executable."""
    if not os.stat(exe).st_mode & stat.S_IXOTH:
        return False
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in exe.parents)
