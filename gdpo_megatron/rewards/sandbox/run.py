"""One sandboxed run: start a Python program under a :class:`Setup`, wait for it, leave nothing behind.

A run gets its files in a working directory of its own, a scrubbed environment, the limits of
:class:`~gdpo_megatron.rewards.sandbox.limits.SandboxLimits` (RLIMIT_CPU, RLIMIT_AS,
RLIMIT_NPROC, RLIMIT_FSIZE; as root a memory cgroup and a user id of its own), a session
keyring of its own, and the system call filter of :mod:`~gdpo_megatron.rewards.sandbox.seccomp`
with no_new_privs. Where it runs:

* ``bwrap``: under bubblewrap, in new user, PID, IPC, network, UTS, cgroup and mount namespaces,
  in a root of read-only system directories, ``/dev``, ``/proc``, and a ``/tmp`` (the working
  directory) and ``/dev/shm`` tmpfs of ``disk_bytes`` each;
* ``basic`` with ``namespaces`` (root): the same root and namespaces but the user namespace,
  built by :mod:`~gdpo_megatron.rewards.sandbox.namespaces`;
* ``basic`` without: in the host's namespaces, in a private directory of the host's temporary
  directory; the filter also refuses System V IPC and POSIX message queues there.

When the run ends (or its wall time passes), everything it started is killed and reaped: its
PID namespace's init (the kernel then kills the rest), its process group and, at the basic level
without namespaces as root, every process of its user id. A failure of the sandbox itself raises
:class:`SandboxError`. Call it from a single-threaded process: the limits are set between fork
and exec.
"""
from __future__ import annotations

import ctypes
import functools
import json
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

from gdpo_megatron.rewards.sandbox import namespaces, seccomp
from gdpo_megatron.rewards.sandbox.cgroup import MemoryCgroup, memory_cgroup_parent
from gdpo_megatron.rewards.sandbox.limits import RunResult, SandboxError, SandboxLimits
from gdpo_megatron.rewards.sandbox.processes import (
    adopt_orphans, kill_group, kill_pid, kill_sandbox_processes, kill_user, reap, run_prefix, sandbox_uid, stop_adopting,
)

SANDBOX_DIR = "/tmp"  # the working directory where a run has a root of its own (its writable places: it, /dev/shm)
_PR_SET_PDEATHSIG = 1
_KEYCTL_JOIN_SESSION_KEYRING = 1
_BWRAP_PROCESSES = 2  # bubblewrap's own processes in a run: its monitor and the namespace's init
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class Setup:
    """How runs are isolated: the level, bubblewrap's path (``bwrap``), and whether the basic
    level runs in namespaces of its own (root only)."""

    level: str
    bwrap: str | None = None
    namespaces: bool = False

    @property
    def has_init(self) -> bool:
        """The run has a PID namespace whose init reports its exit status as bubblewrap's does."""
        return self.level == "bwrap" or self.namespaces


class SandboxedRun:
    """One running sandboxed program: ``files`` (name -> text, ``main.py`` runs as ``__main__``)
    in the working directory, ``stdin`` fed to it, ``pass_fds`` open in it under the same numbers.
    ``user`` (0 or 1): which of the caller's sandbox users runs it, when the caller is root.
    Call :meth:`finish` to wait for it and clean up."""

    def __init__(self, files: dict[str, str], stdin: str, limits: SandboxLimits, setup: Setup,
                 pass_fds: tuple[int, ...] = (), user: int = 0):
        self.limits, self.setup = limits, setup
        self._adopting = False
        self.memory_charged = False  # after finish: the run's processes ran under its memory cgroup
        self._uid = sandbox_uid(os.getpid(), user) if os.geteuid() == 0 else None
        self._workdir = self._cgroup = None
        self._streams = [tempfile.TemporaryFile() for _ in range(3)]
        # Pipes the sandbox writes to: the interpreter says it started; the waiter (bubblewrap
        # or ours) says which host pid the namespace's init has.
        (self._started, started_w), (self._info, info_w) = os.pipe(), os.pipe()
        ours = [started_w, info_w]
        try:
            syscall_filter = _syscall_filter(shared_ipc=not setup.has_init)  # raises on an unknown architecture
            inp, self._out, self._err = self._streams
            inp.write(stdin.encode("utf-8"))
            inp.seek(0)
            runner = [interpreter(), "-I", "-c", _runner(started_w)]
            if self._uid is not None:
                self._cgroup = MemoryCgroup.create(limits.memory_bytes)
            if setup.level == "bwrap":
                file_fds = {name: _memfd(name, text.encode("utf-8")) for name, text in files.items()}
                filter_fd = _memfd("seccomp", syscall_filter.program)  # bubblewrap reads it to the end: one per run
                ours += [*file_fds.values(), filter_fd]
                args = _bwrap_args(setup.bwrap, limits, file_fds, info_w, filter_fd) + runner
                cwd, env = "/", _scrubbed_env(SANDBOX_DIR)
                fds = (started_w, info_w, filter_fd, *file_fds.values(), *pass_fds)
            else:
                self._workdir = Path(tempfile.mkdtemp(prefix=run_prefix(os.getpid())))
                if setup.namespaces:  # the new root is mounted on the (empty) working directory
                    cwd, env = "/", _scrubbed_env(SANDBOX_DIR)
                else:
                    namespaces.write_files(self._workdir, files, self._uid)
                    cwd, env = self._workdir, _scrubbed_env(str(self._workdir))
                args, fds = runner, (started_w, *pass_fds)
            adopt_orphans()
            self._adopting = True
            child_setup = functools.partial(
                _child_setup, limits, self._uid, setup, self._cgroup.procs_file if self._cgroup else None,
                syscall_filter, seccomp.syscall_number("keyctl"),
                functools.partial(namespaces.enter, str(self._workdir), *system_layout(), files, self._uid,
                                  limits.disk_bytes, info_w) if setup.namespaces else None)
            try:
                self._proc = subprocess.Popen(args, stdin=inp, stdout=self._out, stderr=self._err, cwd=cwd, env=env,
                                              pass_fds=fds, start_new_session=True, preexec_fn=child_setup)
            except (OSError, subprocess.SubprocessError) as e:
                stderr, _ = _read_capped(self._err, 4096)
                raise SandboxError(f"sandbox ({setup.level}): could not start the run: {stderr.strip() or e}") from e
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
            if self.setup.has_init and status > 128:
                status = 128 - status  # the init exits with 128 + the signal that killed the program
            returncode = status if exited else None
            stdout, stdout_full = _read_capped(self._out, self.limits.output_bytes)
            stderr, stderr_full = _read_capped(self._err, self.limits.output_bytes)
            memory_limited = self._cgroup is not None and self._cgroup.oom_killed()
            self.memory_charged = self._cgroup is not None and self._cgroup.charged()
        finally:
            self._clean_up()
        if not started and exited:
            raise SandboxError(f"sandbox ({self.setup.level}): the interpreter did not start (exit status {status}): "
                               f"{stderr.strip()[-2000:]}")
        timed_out = returncode is None or (returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not memory_limited)
        output_limited = returncode == -signal.SIGXFSZ or stdout_full or stderr_full
        return RunResult(returncode, stdout, stderr, timed_out, output_limited, memory_limited)

    def _kill(self) -> None:
        """Kill the program and everything it started, and return once they are gone.

        With a PID namespace: killing its init makes the kernel kill and reap every other
        process of the namespace before init dies. The waiter (bubblewrap's monitor, or ours)
        may exit before init is reaped; init then comes to this process (a child subreaper),
        which reaps it. Without: the process group, then (as root) a sweep over the run's user id.
        """
        init = None
        if self.setup.has_init:
            info = _read_available(self._info, 4096)
            init = json.loads(info).get("child-pid") if info.rstrip().endswith(b"}") else None
            if init is not None:
                kill_pid(init)  # not reaped yet: its parent is the waiter or this process
        kill_group(self._proc.pid)  # not reaped yet, so its pid still names only its group
        self._proc.kill()
        self._proc.wait()
        if init is not None:
            reap(init)
        if not self.setup.has_init and self._uid is not None:
            kill_user(self._uid)  # whatever escaped the group

    def _clean_up(self) -> None:
        for f in self._streams:
            f.close()
        for fd in (self._started, self._info):
            os.close(fd)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self._cgroup is not None:
            self._cgroup.remove()
        if self._adopting:
            stop_adopting()
            self._adopting = False


def clean_up_after(pid: int) -> None:
    """Kill the sandboxed processes and remove the working directories and cgroups that process
    ``pid`` left behind (when it was killed in the middle of a run)."""
    if os.geteuid() == 0:
        kill_sandbox_processes(pid)
    for leftover in Path(tempfile.gettempdir()).glob(f"{run_prefix(pid)}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    parent = memory_cgroup_parent() if os.geteuid() == 0 else None
    if parent is not None:
        for leftover in parent[0].glob(f"{run_prefix(pid)}*"):
            MemoryCgroup(leftover, parent[1]).remove()


def _child_setup(limits: SandboxLimits, uid: int | None, setup: Setup, cgroup_procs: Path | None,
                 syscall_filter: seccomp.Loadable, keyctl: int, enter_namespaces) -> None:
    """Runs in the child between fork and exec (the session is already new). A failure is
    written to the run's stderr (``Popen`` reports only that this function raised)."""
    try:
        if cgroup_procs is not None:
            cgroup_procs.write_text(str(os.getpid()))
        if enter_namespaces is not None:
            enter_namespaces()  # returns in the program's process, pid 2 of the run's PID namespace
        processes = limits.processes + (_BWRAP_PROCESSES if setup.level == "bwrap" else 0)
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
        # A new session keyring, the run's user's own: the caller's keys are not the run's to possess.
        if _libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
            raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")
        # After the user switch, which clears it: die with the process that started us.
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if setup.level == "basic":  # bubblewrap installs the filter itself, after its own set-up
            syscall_filter.install(_libc)
    except BaseException as e:
        os.write(2, f"sandbox: {e}\n".encode("utf-8", errors="replace"))
        raise


def _bwrap_args(bwrap: str, limits: SandboxLimits, file_fds: dict[str, int], info_fd: int,
                filter_fd: int) -> list[str]:
    """bubblewrap's command line: namespaces, the filter read from ``filter_fd``, read-only system
    directories, tmpfs of ``disk_bytes`` on ``/dev/shm`` and the working directory holding
    ``file_fds`` (name -> fd); it writes the namespace init's host pid to ``info_fd``."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--info-fd", str(info_fd), "--seccomp", str(filter_fd)]
    binds, symlinks = system_layout()
    for target, link in symlinks:
        args += ["--symlink", target, link]
    for path in binds:
        args += ["--ro-bind", path, path]
    size = str(limits.disk_bytes)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
             "--size", size, "--tmpfs", SANDBOX_DIR]
    for name, fd in file_fds.items():
        args += ["--file", str(fd), f"{SANDBOX_DIR}/{name}"]
    return args + ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SANDBOX_DIR]


def system_layout() -> tuple[list[str], list[tuple[str, str]]]:
    """What a run's own root shows of the host, read-only: the directories to bind (/usr, /bin,
    /sbin, /lib*, and the interpreter's installation and virtual environment when they are
    elsewhere) and the (target, link) of those of them that are symlinks."""
    return _system_layout(interpreter())


@functools.cache
def _system_layout(python: str) -> tuple[list[str], list[tuple[str, str]]]:
    binds, symlinks = [], []
    for top in sorted(Path("/").iterdir()):
        if top.name in ("usr", "bin", "sbin") or top.name.startswith("lib"):
            if top.is_symlink():
                symlinks.append((os.readlink(top), str(top)))
            elif top.is_dir():
                binds.append(str(top))
    for prefix in dict.fromkeys((Path(python).parent.parent, Path(python).resolve().parent.parent)):
        if not prefix.is_relative_to("/usr"):
            binds.append(str(prefix))
    return binds, symlinks


@functools.cache
def _syscall_filter(shared_ipc: bool) -> seccomp.Loadable:
    return seccomp.Loadable.of(seccomp.build(shared_ipc=shared_ipc))


def _runner(started_fd: int) -> str:
    """``python -c`` text: say on ``started_fd`` that the interpreter runs, then run main.py as
    ``python main.py`` would: in the ``__main__`` module itself (``sys.modules['__main__']``, so
    that pickle finds its functions: ``multiprocessing.Pool.map(f)``), with ``__file__`` and
    ``sys.argv`` naming it and no name of this runner left in its namespace."""
    return (
        "import os\n"
        f"os.write({started_fd}, b'1')\n"
        f"os.close({started_fd})\n"
        "del os\n"
        "__file__ = 'main.py'\n"
        "__import__('sys').argv[:] = [__file__]\n"
        "exec(compile(open(__file__, encoding='utf-8').read(), __file__, 'exec'))\n"
    )


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _exits_within(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` seconds; woken by a pidfd, not by polling,
    and without reaping it."""
    fd = os.pidfd_open(proc.pid)
    try:
        exited, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(exited)


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


_chosen_python: str | None = None  # choose_python's


def choose_python(path: str | None) -> bool:
    """Run programs with the interpreter at ``path`` (``None``: the default, see
    :func:`interpreter`); raise :class:`SandboxError` saying why it cannot be used. A virtual
    environment's interpreter is run as it is named, so its packages come with it. Whether
    that changed the interpreter."""
    global _chosen_python
    if path == _chosen_python:
        return False
    if path is not None:
        problem = python_problem(path)
        if problem is not None:
            raise SandboxError(f"sandbox: the interpreter {path} cannot run programs: {problem}")
    _chosen_python = path
    return True


def python_problem(path: str) -> str | None:
    """Why the interpreter at ``path`` cannot run the sandbox's programs, or ``None``."""
    exe = Path(path)
    if not exe.is_absolute():
        return "not an absolute path"
    if not exe.is_file():
        return "no such file"
    if any(Path(place) in (exe.parent.parent, *exe.parent.parent.parents) for place in (SANDBOX_DIR, "/dev", "/proc")):
        return f"runs replace {SANDBOX_DIR}, /dev and /proc with their own, so it must live elsewhere"
    if not os.access(exe, os.X_OK):
        return "not executable"
    if os.geteuid() == 0 and not (_world_accessible(exe) and _world_accessible(exe.resolve())):
        return ("other users cannot run it (as root, programs run as users of their own): the file or a directory "
                "above it lacks o+x")
    try:
        ran = subprocess.run([path, "-I", "-c", "import sys; print(sys.version_info >= (3, 8))"], capture_output=True,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"it does not run: {e}"
    if ran.stdout.strip() != "True":
        return f"it is not Python 3.8 or later: {(ran.stderr or ran.stdout).strip()[-500:]}"
    return None


def interpreter() -> str:
    """The Python the programs run with: the one chosen (:func:`choose_python`), else this one,
    or as root one an unprivileged user can run (virtualenvs under /root usually are not): this
    one if its installation is world-readable, else the system's."""
    return _chosen_python or _default_interpreter()


@functools.cache
def _default_interpreter() -> str:
    if os.geteuid() != 0:
        return str(Path(sys.executable).resolve())
    candidates = [Path(sys.executable).resolve()]
    candidates += [Path(p) for p in ("/usr/local/bin/python3", "/usr/bin/python3")]
    for exe in candidates:
        if exe.is_file() and _world_accessible(exe.resolve()):
            return str(exe.resolve())
    raise SandboxError(f"sandbox: running as root, but no Python interpreter other users may run "
                       f"(tried {', '.join(map(str, candidates))}); install python3 system-wide or choose one "
                       "(rewards.sandbox_python)")


def _world_accessible(exe: Path) -> bool:
    """Every directory above ``exe`` is world-searchable and ``exe`` is world-executable."""
    if not os.stat(exe).st_mode & stat.S_IXOTH:
        return False
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in exe.parents)
