"""Run untrusted Python programs (model-written code) with limits, and leave nothing behind.

Every run gets a fresh working directory holding its files, a scrubbed environment, and these
limits: CPU seconds per process (RLIMIT_CPU), address space per process (RLIMIT_AS),
processes (RLIMIT_NPROC), bytes per written file (RLIMIT_FSIZE, which also caps the captured
stdout and stderr), and a wall-clock timeout after which everything it started is killed.

Two isolation levels, the strongest available chosen once per process; :func:`isolation`
reports the level and what it guarantees (the README has the table):

``"bwrap"`` (Debian's ``bubblewrap`` installed and working): the program runs in new user,
  PID, IPC, network, UTS and mount namespaces, with no_new_privs and no capabilities. It sees
  read-only system directories (/usr and the interpreter) and nothing else of the host: no
  /home, /root, /run, /var, /etc or host /tmp, so no host unix socket and no dataset file; its
  only writable place is a tmpfs of ``disk_bytes`` holding the working directory (/tmp).
  When its first process exits, the PID namespace ends and the kernel kills every process it
  started (``setsid`` and double forks included) and reaps them; System V IPC objects end
  with the IPC namespace. As root it also runs as an unprivileged user id of its own (so
  RLIMIT_NPROC counts its processes only), and, where a writable memory cgroup exists, all of
  its processes share one ``memory_bytes`` bound (tmpfs pages included).

``"basic"`` (no working bubblewrap): the same limits and no_new_privs, but the program
  shares the host's namespaces. Network access is blocked only by refusing socket-level
  imports, which code can undo. As root the program runs as an unprivileged user id of its
  own (one per sandbox user of the caller) in a private working directory, and processes
  that leave its process group are killed by a sweep over that user id; it can still write
  to world-writable host directories. As another user it runs as that user: writes anywhere the user may, signals to the caller, and reading
  ``/proc/<parent>/environ`` are NOT contained, and RLIMIT_NPROC counts all of the user's
  processes.

A failure of the sandbox itself (bubblewrap or the interpreter cannot start) raises
:class:`SandboxError`; it is never reported as the program's own result.

Linux only (>= 5.3: pidfd). Call it from a single-threaded process (the reward stage's
workers are): the limits are set between fork and exec.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
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
from dataclasses import dataclass, field
from pathlib import Path

ISOLATION_LEVELS = ("bwrap", "basic")
SANDBOX_DIR = "/tmp"  # the working directory inside the bwrap sandbox (its only writable place)
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 1, 38, 36
_REAP_TIMEOUT_S = 5.0
# Sandbox user ids: _UID_BASE + user * _UID_STRIDE + the pid of the process running the sandbox.
_UID_BASE, _UID_STRIDE = 10_000_000, 1 << 22  # the stride is above the largest pid (PID_MAX_LIMIT)
SANDBOX_USERS = 2  # per caller: runs started side by side run as different users
_BWRAP_PROCESSES = 2  # bubblewrap's own processes in a run: its monitor and the namespace's init
_BLOCKED_MODULES = ("socket", "_socket", "ssl", "_ssl", "select", "selectors", "asyncio",
                    "http", "urllib", "ftplib", "smtplib", "telnetlib", "xmlrpc", "multiprocessing")
_libc = ctypes.CDLL(None, use_errno=True)
_run_counter = itertools.count()
log = logging.getLogger(__name__)

# What each level guarantees, by attack class: (key, what holds when it is True).
GUARANTEES = (
    ("process_tree_ends_with_run", "every process the program started is killed and reaped when the run ends"),
    ("no_new_privs", "no_new_privs: setuid/setgid programs cannot raise privileges"),
    ("private_ipc", "System V IPC and POSIX message queues are private and end with the run"),
    ("no_network", "no network: a network namespace of its own (its own loopback only; abstract unix sockets included)"),
    ("no_host_unix_sockets", "no filesystem unix socket of the host is reachable"),
    ("host_files_hidden", "host files other than system directories (/usr, the interpreter) are invisible"),
    ("writes_confined", "the program can write only to its own working directory"),
    ("disk_bounded", "the working directory holds at most disk_bytes"),
    ("memory_per_run", "memory_bytes bounds all processes of the run together, memory held outside their address "
                       "spaces included (else it bounds each process's address space only: memfd files, shared "
                       "memory and pipe buffers are not bounded)"),
    ("processes_counted_per_run", "the processes limit counts this sandbox's processes only"),
    ("caller_unreachable", "the caller and other host processes cannot be signalled, traced or read"),
    ("runs_separated", "runs started side by side as different sandbox users (an assert test's judge and "
                       "program) cannot see, signal, trace or read each other"),
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): bubblewrap, the interpreter or a limit
    could not be set up. The run has no result."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20  # per written file, stdout and stderr included
    processes: int = 32
    disk_bytes: int = 64 << 20  # the working directory's size (bwrap level)

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_bytes", "output_bytes", "processes", "disk_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limits: {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RunResult:
    returncode: int | None  # negative: killed by that signal; None: killed at the wall timeout
    stdout: str
    stderr: str
    timed_out: bool  # wall-clock or CPU time limit reached
    output_limited: bool  # a write went past ``output_bytes``
    memory_limited: bool = False  # killed for going past the run's memory bound

    @property
    def ok(self) -> bool:
        """The program ran to the end without an error."""
        return self.returncode == 0 and not (self.timed_out or self.output_limited or self.memory_limited)


@dataclass(frozen=True)
class Isolation:
    """The active level and, per attack class of :data:`GUARANTEES`, whether it is contained."""

    level: str
    guarantees: dict[str, bool] = field(default_factory=dict)

    def __str__(self) -> str:
        rows = [f"sandbox level {self.level!r}:"]
        rows += [f"  [{'x' if self.guarantees[key] else ' '}] {text}" for key, text in GUARANTEES]
        return "\n".join(rows)


def run_python(
    code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), level: str | None = None
) -> RunResult:
    """Run ``code`` as ``main.py`` (as ``__main__``) in a fresh directory, feeding it ``stdin``.

    ``level``: the isolation level, default the strongest available (:func:`isolation`).
    """
    return start_python({"main.py": code}, stdin, limits, level).finish(time.monotonic() + limits.wall_s)


def start_python(
    files: dict[str, str], stdin: str = "", limits: SandboxLimits = SandboxLimits(), level: str | None = None,
    pass_fds: tuple[int, ...] = (), user: int = 0,
) -> "SandboxedRun":
    """Start ``main.py`` of ``files`` (name -> text, all written to the working directory).

    ``pass_fds`` stay open in the program under the same numbers (e.g. pipes to another run).
    ``user`` (0 or 1): which of the caller's sandbox users runs it, when the caller is root.
    Runs that live side by side need different users: at the basic level two runs of one
    user can read and signal each other, and a run's end sweeps its user's processes.
    Call ``finish`` on the result to wait for it and clean up.
    """
    level = level or isolation().level
    if level not in ISOLATION_LEVELS or (level == "bwrap" and isolation().level != "bwrap"):
        raise ValueError(f"sandbox level: expected 'basic' or an available level ({isolation().level!r}), got {level!r}")
    if "main.py" not in files:
        raise ValueError(f"sandbox: files must include 'main.py', got {sorted(files)}")
    if user not in range(SANDBOX_USERS):
        raise ValueError(f"sandbox: user must be one of {list(range(SANDBOX_USERS))}, got {user!r}")
    return SandboxedRun(files, stdin, limits, level, pass_fds, user)


class SandboxedRun:
    """One running sandboxed program (see :func:`start_python`)."""

    def __init__(self, files: dict[str, str], stdin: str, limits: SandboxLimits, level: str,
                 pass_fds: tuple[int, ...], user: int = 0):
        self.limits, self.level = limits, level
        self._uid = sandbox_uid(os.getpid(), user) if os.geteuid() == 0 else None
        self._workdir = self._cgroup = None
        self._streams = [tempfile.TemporaryFile() for _ in range(3)]
        # Pipes the sandbox writes to: the interpreter says it started; bubblewrap says which
        # host pid its namespace's init has.
        (self._started, started_w), (self._info, info_w) = os.pipe(), os.pipe()
        ours = [started_w, info_w]
        try:
            inp, self._out, self._err = self._streams
            inp.write(stdin.encode("utf-8"))
            inp.seek(0)
            runner = [_interpreter(), "-I", "-c", _runner(started_w, guard_imports=level == "basic")]
            if level == "bwrap":
                file_fds = {name: _memfd(name, text) for name, text in files.items()}
                ours += file_fds.values()
                args = _bwrap_args(limits, file_fds, info_w) + runner
                cwd, env = "/", _scrubbed_env(SANDBOX_DIR)
                fds = (started_w, info_w, *file_fds.values(), *pass_fds)
                self._cgroup = _MemoryCgroup.create(limits.memory_bytes) if self._uid is not None else None
            else:
                self._workdir = Path(tempfile.mkdtemp(prefix=_workdir_prefix(os.getpid())))
                for name, text in files.items():
                    (self._workdir / name).write_text(text, encoding="utf-8")
                if self._uid is not None:
                    for path in (self._workdir, *self._workdir.iterdir()):
                        os.chown(path, self._uid, self._uid)
                    os.chmod(self._workdir, stat.S_IRWXU)
                args, cwd, env, fds = runner, self._workdir, _scrubbed_env(str(self._workdir)), (started_w, *pass_fds)
            _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the run come back to us
            self._proc = subprocess.Popen(
                args, stdin=inp, stdout=self._out, stderr=self._err, cwd=cwd, env=env, pass_fds=fds,
                start_new_session=True,
                preexec_fn=functools.partial(_child_setup, limits, self._uid, level,
                                             self._cgroup.procs_file if self._cgroup else None),
            )
        except BaseException:
            self._clean_up()
            raise
        finally:
            for fd in ours:
                os.close(fd)

    def finish(self, deadline: float) -> RunResult:
        """Wait until the program exits or ``deadline`` (``time.monotonic()``) passes, kill
        whatever is left of it, and return its result."""
        try:
            exited = _exits_within(self._proc, max(0.0, deadline - time.monotonic()))
            self._kill()
            status = self._proc.returncode
            started = _read_available(self._started).startswith(b"1")
            if self.level == "bwrap" and status > 128:
                status = 128 - status  # bubblewrap exits with 128 + the signal that killed the program
            returncode = status if exited else None
            stdout, stdout_full = _read_capped(self._out, self.limits.output_bytes)
            stderr, stderr_full = _read_capped(self._err, self.limits.output_bytes)
            memory_limited = self._cgroup is not None and self._cgroup.oom_killed()
        finally:
            self._clean_up()
        if not started and exited:
            raise SandboxError(f"sandbox ({self.level}): the interpreter did not start (exit status {status}): "
                               f"{stderr.strip()[-2000:]}")
        timed_out = returncode is None or (returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not memory_limited)
        output_limited = returncode == -signal.SIGXFSZ or stdout_full or stderr_full
        return RunResult(returncode, stdout, stderr, timed_out, output_limited, memory_limited)

    def _kill(self) -> None:
        """Kill the program and everything it started, and return once they are gone.

        bwrap level: killing the namespace's init makes the kernel kill and reap every other
        process of the namespace before init dies. bubblewrap's monitor may exit before init
        is reaped; init then comes to this process (a child subreaper), which reaps it.
        Basic level: the process group, then (as root) a sweep over this run's user id.
        """
        init = None
        if self.level == "bwrap":
            info = _read_available(self._info, 4096)
            init = json.loads(info).get("child-pid") if info.rstrip().endswith(b"}") else None
            if init is not None:
                _kill_pid(init)  # not reaped yet: its parent is bubblewrap's monitor or this process
        _kill_group(self._proc.pid)  # not reaped yet, so its pid still names only its group
        self._proc.kill()
        self._proc.wait()
        if init is not None:
            _reap(init)
        if self.level == "basic" and self._uid is not None:
            _kill_user(self._uid)  # whatever escaped the group

    def _clean_up(self) -> None:
        for f in self._streams:
            f.close()
        for fd in (self._started, self._info):
            os.close(fd)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self._cgroup is not None:
            self._cgroup.remove()


@functools.cache
def isolation() -> Isolation:
    """The strongest level that works here and what it guarantees, probed once per process
    (a fallback to the basic level is logged with its reason)."""
    root = os.geteuid() == 0
    why_not_bwrap = _bwrap_failure()
    if why_not_bwrap is None:
        weaker = {"memory_per_run": root and _memory_cgroup_parent() is not None, "processes_counted_per_run": root}
        return Isolation("bwrap", {key: weaker.get(key, True) for key, _ in GUARANTEES})
    log.warning("code sandbox: level 'basic', weaker isolation (see sandbox.isolation()): %s", why_not_bwrap)
    contained = {"no_new_privs"}
    contained |= {"processes_counted_per_run", "caller_unreachable", "process_tree_ends_with_run",
                  "runs_separated"} if root else set()
    return Isolation("basic", {key: key in contained for key, _ in GUARANTEES})


def damage() -> str | None:
    """What is wrong with this process after its sandboxed runs ended, or ``None``.

    Between runs it has no child process left: each run kills and reaps everything it
    started. A child found here escaped a run (or the sandbox failed); it is killed and
    reaped, and the process should be replaced, since whatever escaped may have changed it.
    """
    left = _children()
    for pid in left:
        _kill_pid(pid)
        _reap(pid)
    return f"{len(left)} process(es) of a sandboxed run outlived it" if left else None


def _children() -> list[int]:
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


def clean_up_after(pid: int) -> None:
    """Kill the sandboxed processes and remove the working directories and cgroups that process
    ``pid`` left behind (when it was killed in the middle of a run)."""
    if os.geteuid() == 0:
        kill_sandbox_processes(pid)
    for leftover in Path(tempfile.gettempdir()).glob(f"{_workdir_prefix(pid)}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    parent = _memory_cgroup_parent() if os.geteuid() == 0 else None
    if parent is not None:
        for leftover in parent[0].glob(f"{_workdir_prefix(pid)}*"):
            _MemoryCgroup(leftover, parent[1]).remove()


def kill_sandbox_processes(pid: int) -> None:
    """SIGKILL every process of the sandbox users of ``pid``, and reap those that are this
    process's children (a child subreaper gets the orphans)."""
    for user in range(SANDBOX_USERS):
        _kill_user(sandbox_uid(pid, user))


def _kill_user(uid: int) -> None:
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
    deadline = time.monotonic() + _REAP_TIMEOUT_S
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


def _workdir_prefix(pid: int) -> str:
    return f"gdpo-sandbox-{pid}-"


def _child_setup(limits: SandboxLimits, uid: int | None, level: str, cgroup_procs: Path | None) -> None:
    """Runs in the child between fork and exec (the session is already new)."""
    if cgroup_procs is not None:
        cgroup_procs.write_text(str(os.getpid()))
    processes = limits.processes + (_BWRAP_PROCESSES if level == "bwrap" else 0)
    for limit, value in (
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_NPROC, (processes, processes)),
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
    if level == "basic":  # bubblewrap sets it itself
        _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _bwrap_args(limits: SandboxLimits, file_fds: dict[str, int], info_fd: int) -> list[str]:
    """bubblewrap's command line: namespaces, read-only system directories, a tmpfs of
    ``disk_bytes`` as the working directory holding ``file_fds`` (name -> fd); it writes the
    namespace init's host pid to ``info_fd``."""
    args = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--hostname", "sandbox", "--info-fd", str(info_fd)]
    for top in sorted(Path("/").iterdir()):
        if top.name in ("usr", "bin", "sbin") or top.name.startswith("lib"):
            if top.is_symlink():
                args += ["--symlink", os.readlink(top), str(top)]
            elif top.is_dir():
                args += ["--ro-bind", str(top), str(top)]
    prefix = Path(_interpreter()).resolve().parent.parent
    if not prefix.is_relative_to("/usr"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_bytes), "--tmpfs", SANDBOX_DIR]
    for name, fd in file_fds.items():
        args += ["--file", str(fd), f"{SANDBOX_DIR}/{name}"]
    return args + ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SANDBOX_DIR]


def _runner(started_fd: int, guard_imports: bool) -> str:
    """``python -c`` text: say on ``started_fd`` that the interpreter runs, optionally refuse
    socket-level imports, then run main.py as ``__main__``."""
    guard = (f"for _m in {_BLOCKED_MODULES!r}: sys.modules[_m] = None\n"
             "del _m\n") if guard_imports else ""
    return (
        "import os, sys\n"
        f"os.write({started_fd}, b'1')\n"
        f"os.close({started_fd})\n"
        f"{guard}"
        "sys.argv = ['main.py']\n"
        "exec(compile(open('main.py', encoding='utf-8').read(), 'main.py', 'exec'), {'__name__': '__main__'})\n"
    )


def _memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name)
    os.write(fd, text.encode("utf-8"))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _MemoryCgroup:
    """A memory cgroup for one run (cgroup v1 or v2), limit ``memory_bytes`` without swap."""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version
        self.procs_file = path / "cgroup.procs"

    @classmethod
    def create(cls, memory_bytes: int) -> "_MemoryCgroup | None":
        parent = _memory_cgroup_parent()
        if parent is None:
            return None
        group = cls(parent[0] / f"{_workdir_prefix(os.getpid())}{next(_run_counter)}", parent[1])
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
        events = self.path / ("memory.oom_control" if self.version == 1 else "memory.events")
        try:
            counts = dict(line.split() for line in events.read_text().splitlines())
        except OSError:
            return False
        return int(counts.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        """Kill anything still in the group, then remove it."""
        deadline = time.monotonic() + _REAP_TIMEOUT_S
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
                    _kill_pid(int(pid))
            except OSError:
                pass
            time.sleep(0.005)


@functools.cache
def _memory_cgroup_parent() -> tuple[Path, int] | None:
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
            probe = own / f"{_workdir_prefix(os.getpid())}probe"
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


@functools.cache
def _bwrap_failure() -> str | None:
    """Why bubblewrap cannot start the interpreter here with every option the bwrap level
    uses, or ``None`` when it can."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        run = SandboxedRun({"main.py": "pass"}, "", SandboxLimits(wall_s=30), "bwrap", ())
        result = run.finish(time.monotonic() + 30)
    except (OSError, SandboxError, subprocess.SubprocessError) as e:
        return f"bwrap failed: {e}"
    if result.returncode != 0:
        return f"bwrap failed (exit status {result.returncode}): {result.stderr.strip()[-2000:]}"
    return None


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


def _reap(pid: int) -> None:
    """Wait for child ``pid`` to exit (it was killed) and reap it; nothing if it is not ours."""
    deadline = time.monotonic() + _REAP_TIMEOUT_S
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                raise SandboxError(f"sandbox: process {pid} survives SIGKILL")
            time.sleep(0.001)
    except ChildProcessError:  # reaped by its own parent
        pass


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_available(fd: int, size: int = 16) -> bytes:
    """Up to ``size`` bytes already in a pipe, without waiting."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return b""


def _read_capped(f, cap: int) -> tuple[str, bool]:
    """The first ``cap`` bytes of a captured stream, and whether it reached the cap."""
    f.seek(0)
    data = f.read(cap)
    return data.decode("utf-8", errors="replace"), len(data) >= cap


def _scrubbed_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


@functools.cache
def _interpreter() -> str:
    """The Python the programs run with: this one, or as root one an unprivileged user can
    run (virtualenvs under /root usually are not): this one if its installation is
    world-readable, else the system's."""
    if os.geteuid() != 0:
        return str(Path(sys.executable).resolve())
    candidates = [Path(sys.executable).resolve()]
    candidates += [Path(p) for p in ("/usr/local/bin/python3", "/usr/bin/python3")]
    for exe in candidates:
        if exe.is_file() and _world_accessible(exe.resolve()):
            return str(exe.resolve())
    raise SandboxError(f"sandbox: running as root, but no Python interpreter other users may run "
                       f"(tried {', '.join(map(str, candidates))}); install python3 system-wide")


def _world_accessible(exe: Path) -> bool:
    """Every directory above ``exe`` is world-searchable and ``exe`` is world-executable."""
    if not os.stat(exe).st_mode & stat.S_IXOTH:
        return False
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in exe.parents)
