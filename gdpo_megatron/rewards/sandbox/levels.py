"""Which isolation level runs programs here, and what it guarantees, measured.

:func:`isolation` probes a level once per process: it runs a program there that reports what it
sees (its namespaces, user id, the root directory, writable mounts, its working directory's
size, whether it can create sockets or call keyctl, io_uring, userfaultfd, kcmp, unshare), and
each guarantee of :data:`GUARANTEES` is derived from that report, so what the sandbox reports
has been checked, not assumed. A level where the system call filter or no_new_privs does not
hold is not used at all, nor is a root of its own (``bwrap``, or ``basic`` in namespaces of its
own) whose namespaces or guarantees do not measure as they must (:data:`OWN_ROOT_GUARANTEES`:
e.g. a ``bwrap`` on PATH that shares the host's network).

The default is the strongest level that works: ``bwrap`` where bubblewrap runs, else ``basic``
(with namespaces of its own as root where the kernel lets root create them), and
:func:`bwrap_missing` says why in words a user can act on. Below ``bwrap``, runs that name no
level are refused unless the caller chose the weaker level (:func:`allow_weaker`;
``rewards.allow_weaker_sandbox`` in a config), and then log the fallback once per process.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass

from gdpo_megatron.rewards.sandbox import seccomp
from gdpo_megatron.rewards.sandbox.namespaces import DEVICES
from gdpo_megatron.rewards.sandbox.limits import SandboxError, SandboxLimits
from gdpo_megatron.rewards.sandbox.processes import sandbox_uid
from gdpo_megatron.rewards.sandbox.run import SANDBOX_DIR, SandboxedRun, Setup, choose_python, interpreter, system_layout

ISOLATION_LEVELS = ("bwrap", "basic")
log = logging.getLogger(__name__)

# What a level guarantees, by attack class: (key, what holds when it is True).
GUARANTEES = (
    ("process_tree_ends_with_run", "every process the program started is killed and reaped when the run ends"),
    ("no_new_privs", "no_new_privs: setuid/setgid programs cannot raise privileges"),
    ("syscalls_filtered", "a seccomp filter refuses kernel keyrings (keyctl, add_key, request_key), io_uring, "
                          "userfaultfd, memfd_secret, bpf, ptrace, kcmp, namespaces, mounts and other ABIs' calls"),
    ("no_network", "no socket but AF_UNIX can be created: no network, netlink, packet or vsock socket"),
    ("private_ipc", "System V IPC and POSIX message queues are private and end with the run, or are refused"),
    ("no_host_unix_sockets", "no unix socket of the host is reachable, abstract or in a file"),
    ("host_files_hidden", "host files other than system directories (/usr, the interpreter) are invisible"),
    ("writes_confined", "the program can write only to its working directory and its own /dev/shm"),
    ("disk_bounded", "its working directory and /dev/shm hold at most disk_bytes each"),
    ("memory_per_run", "memory_bytes bounds all processes of the run together, memory held outside their address "
                       "spaces included (else it bounds each process's address space only: memfd files, shared "
                       "memory and pipe buffers are not bounded)"),
    ("processes_counted_per_run", "the processes limit counts this sandbox's processes only"),
    ("caller_unreachable", "the caller and other host processes cannot be signalled, traced or read"),
    ("runs_separated", "runs started side by side as different sandbox users (an assert test's judge and "
                       "program) cannot see, signal, trace or read each other"),
)
# What a level with a root and namespaces of its own (bwrap, basic in namespaces of its own) must
# measure to hold, with every namespace of _NAMESPACES its own, or it is not used.
OWN_ROOT_GUARANTEES = ("process_tree_ends_with_run", "private_ipc", "no_host_unix_sockets", "host_files_hidden",
                       "writes_confined", "disk_bounded", "caller_unreachable", "runs_separated")
_NAMESPACES = ("pid", "ipc", "net", "mnt", "uts")
_FAMILIES = {"AF_INET": (2, 1), "AF_INET6": (10, 1), "AF_NETLINK": (16, 2), "AF_PACKET": (17, 2),
             "AF_VSOCK": (40, 1)}  # name: (family, a socket type it takes)
# Calls the probe makes, with harmless arguments, and the errno the filter answers.
_CALLS = {"keyctl": (0, -3, 0), "add_key": (0, 0, 0, 0, -3), "io_uring_setup": (1, 0), "userfaultfd": (0,),
          "kcmp": (0, 0, 0, 0, 0), "unshare": (0x10000000,)}
# The mounts a run with a root of its own may write to: its own tmpfs, /proc, and device nodes.
_WRITABLE_OWN = {SANDBOX_DIR, "/dev/shm", "/proc", "/dev/pts", *(f"/dev/{name}" for name in DEVICES)}
_PROBE_LIMITS = SandboxLimits(wall_s=30.0, cpu_s=10)

# bubblewrap's messages (bubblewrap.c, 0.8.0 on): why it fails, in words a user can act on.
_BWRAP_FAILURES = (
    (r"does not support user namespaces", "the kernel has no user namespaces"),
    (r"No permissions to creat|Creating new namespace failed: Operation not permitted",
     "user namespaces are refused (sysctl kernel.unprivileged_userns_clone=0, or a container's seccomp profile)"),
    (r"max_\*_namespaces exceeded|Creating new namespace failed: No space left",
     "user namespaces are disabled (sysctl user.max_user_namespaces=0)"),
    (r"setting up [ug]id map", "AppArmor restricts user namespaces (sysctl kernel.apparmor_restrict_unprivileged_userns=1)"),
    (r"Can't mount proc", "a container's masked /proc paths keep bwrap from mounting /proc "
                          "(Docker: --security-opt systempaths=unconfined)"),
    (r"(Failed to mount tmpfs|Can't mount|Can't bind mount|Can't remount|setting up newroot)\S*.*"
     r"(Permission denied|Operation not permitted)", "mounts in new namespaces are refused (a container's "
                                                     "SELinux or AppArmor policy)"),
    (r"PR_SET_SECCOMP", "the kernel has no seccomp filter support"),
)


@dataclass(frozen=True)
class Isolation:
    """A level as probed here: per attack class of :data:`GUARANTEES`, whether it is contained."""

    setup: Setup
    guarantees: dict[str, bool]
    why_not_bwrap: str | None = None  # at the basic level: why bubblewrap cannot run here
    why_host_namespaces: str | None = None  # at the basic level as root: why it has no namespaces of its own

    @property
    def level(self) -> str:
        return self.setup.level

    def describe(self) -> str:
        """The level and, below bwrap, why: one line."""
        if self.level == "bwrap":
            return "bwrap"
        where = "namespaces of its own" if self.setup.namespaces else "the host's namespaces"
        why = "; ".join(f"{what}: {reason}" for what, reason in (("no bwrap", self.why_not_bwrap),
                                                                 ("no namespaces", self.why_host_namespaces))
                        if reason)
        return f"basic, in {where}" + (f" ({why})" if why else "")

    def __str__(self) -> str:
        rows = [f"sandbox level {self.describe()}:"]
        rows += [f"  [{'x' if self.guarantees[key] else ' '}] {text}" for key, text in GUARANTEES]
        return "\n".join(rows)


@functools.cache
def isolation(level: str | None = None) -> Isolation:
    """Level ``level`` as probed here, by default the strongest that works; raises
    :class:`SandboxError` when it cannot run here."""
    if level not in (None, *ISOLATION_LEVELS):
        raise ValueError(f"sandbox level: expected one of {ISOLATION_LEVELS}, got {level!r}")
    if level == "basic":
        return _basic()
    if level == "bwrap":
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise _BwrapCannotRun("bubblewrap (bwrap) is not installed")
        try:
            return probe(Setup("bwrap", bwrap))
        except IsolationNotHeld as e:
            raise _BwrapCannotRun(f"{bwrap} does not isolate as bubblewrap must ({e.why})") from None
        except SandboxError as e:
            raise _BwrapCannotRun(explain_bwrap_failure(str(e))) from None
    # The strongest: bwrap (probed once, whichever way it is asked for), else the basic level with the reason.
    try:
        return isolation("bwrap")
    except _BwrapCannotRun as e:
        return dataclasses.replace(isolation("basic"), why_not_bwrap=e.why)


class _BwrapCannotRun(SandboxError):
    def __init__(self, why: str):
        super().__init__(f"sandbox: the bwrap level cannot run here: {why}")
        self.why = why


class IsolationNotHeld(SandboxError):
    """A level ran, but what it must isolate did not measure as isolated."""

    def __init__(self, setup: Setup, why: str):
        super().__init__(f"sandbox ({setup.level}): the measured isolation does not hold: {why}")
        self.why = why


_allow_weaker = False  # whether runs that name no level may fall back to basic (allow_weaker)


def allow_weaker(allowed: bool) -> None:
    """Whether runs that name no level may run at the basic level where bubblewrap cannot run;
    when not (the default), they raise :class:`SandboxError` there instead (a reward stage sets
    this from ``rewards.allow_weaker_sandbox``)."""
    global _allow_weaker
    _allow_weaker = allowed


@functools.cache
def default_setup() -> Setup:
    """How runs that name no level are isolated: the strongest level here; below bwrap, logged
    once per process with the reason (:func:`allowed_setup` refuses it where not allowed)."""
    chosen = isolation()
    if chosen.level != "bwrap":
        log.warning("code sandbox: weaker isolation, level %s (see sandbox.isolation())", chosen.describe())
    return chosen.setup


def allowed_setup() -> Setup:
    """:func:`default_setup`, refused with :class:`SandboxError` below bwrap unless
    :func:`allow_weaker` allows it."""
    setup = default_setup()
    if setup.level != "bwrap" and not _allow_weaker:
        raise SandboxError(f"sandbox: the strong sandbox cannot run here ({bwrap_missing()}) and the weaker "
                           "basic level was not chosen (rewards.allow_weaker_sandbox=true in a config; "
                           "sandbox.allow_weaker(True), or level='basic', from Python)")
    return setup


def use_python(path: str | None) -> None:
    """Run programs with the Python interpreter at ``path`` (a virtual environment's brings its
    packages), or with the default one (``None``: this interpreter, or as root the first of it,
    /usr/local/bin/python3 and /usr/bin/python3 that other users may run); raise
    :class:`SandboxError` saying why it cannot be used. The levels are probed again with it."""
    if choose_python(path):
        isolation.cache_clear()
        default_setup.cache_clear()


@dataclass(frozen=True)
class ProgramsPython:
    """The interpreter programs run with, as a program sees it in the sandbox."""

    path: str
    version: str
    packages: dict[str, str]  # distribution name: version

    def __str__(self) -> str:
        if not self.packages:
            return f"{self.path} (Python {self.version}, standard library only)"
        numpy = self.packages.get("numpy")
        return (f"{self.path} (Python {self.version}, {len(self.packages)} packages, "
                f"{f'numpy {numpy}' if numpy else 'no numpy'})")


def programs_python() -> ProgramsPython:
    """What a program gets here, measured by running one at the strongest level: the
    interpreter, its version and the packages it can import; raises :class:`SandboxError`."""
    limits = SandboxLimits(wall_s=60.0, cpu_s=30)
    result = SandboxedRun({"main.py": _PACKAGES}, "", limits, isolation().setup).finish(time.monotonic() + limits.wall_s)
    try:
        version, packages = json.loads(result.stdout)
    except ValueError:
        raise SandboxError(f"sandbox: could not list the packages of {interpreter()} (exit status "
                           f"{result.returncode}): {result.stderr.strip()[-2000:]}") from None
    return ProgramsPython(interpreter(), version, packages)


def bwrap_missing() -> str | None:
    """Why the strong level (bubblewrap) cannot run here, or ``None`` when it can."""
    return isolation().why_not_bwrap


def _basic() -> Isolation:
    """The basic level: in namespaces of its own where root can create them, else in the host's."""
    why = None
    if os.geteuid() == 0:
        try:
            return probe(Setup("basic", namespaces=True))
        except SandboxError as e:
            why = str(e)
    return dataclasses.replace(probe(Setup("basic")), why_host_namespaces=why)


def probe(setup: Setup) -> Isolation:
    """Run the probe under ``setup`` and derive its guarantees; raise :class:`SandboxError` when
    it cannot run there, or what every level must hold (the filter, no_new_privs) does not."""
    calls = {name: (seccomp.syscall_number(name), args) for name, args in _CALLS.items()}
    run = SandboxedRun({"main.py": _PROBE.format(families=_FAMILIES, calls=calls, sandbox_dir=SANDBOX_DIR,
                                                 namespaces=_NAMESPACES)},
                       "", _PROBE_LIMITS, setup)
    result = run.finish(time.monotonic() + _PROBE_LIMITS.wall_s)
    try:
        seen = json.loads(result.stdout)
    except ValueError:
        raise SandboxError(f"sandbox ({setup.level}): the probe failed (exit status {result.returncode}): "
                           f"{result.stderr.strip()[-2000:]}") from None
    expected = {name: errno.ENOSYS if name in seccomp.NOT_AVAILABLE else errno.EPERM for name in _CALLS}
    broken = [f"{name} answered {seen['calls'][name]}" for name in _CALLS if seen["calls"][name] != expected[name]]
    broken += [f"{family} sockets can be created" for family in seen["sockets"] if family != "AF_UNIX"]
    broken += [] if "AF_UNIX" in seen["sockets"] else ["AF_UNIX sockets cannot be created"]
    broken += [] if seen["no_new_privs"] else ["no_new_privs is not set"]
    if broken:
        raise SandboxError(f"sandbox ({setup.level}): the system call filter does not hold: {', '.join(broken)}")
    guarantees = _guarantees(seen, run.memory_charged)
    if setup.has_init:
        shared = [name for name in _NAMESPACES if seen["namespaces"][name] == os.readlink(f"/proc/self/ns/{name}")]
        missing = [key for key in OWN_ROOT_GUARANTEES if not guarantees[key]]
        if shared or missing:
            raise IsolationNotHeld(setup, "; ".join(
                ([f"the host's {', '.join(shared)} namespace{'s' if len(shared) > 1 else ''}"] if shared else [])
                + ([f"not held: {', '.join(missing)}"] if missing else [])))
    return Isolation(setup, guarantees)


def _guarantees(seen: dict, memory_charged: bool) -> dict[str, bool]:
    """Each guarantee, from what the probe saw (the filter and no_new_privs already checked)."""
    ours = {name: os.readlink(f"/proc/self/ns/{name}") for name in _NAMESPACES}
    private = {name: seen["namespaces"][name] != ours[name] for name in _NAMESPACES}
    own_user = os.geteuid() == 0 and seen["uid"] == sandbox_uid(os.getpid())
    binds, symlinks = system_layout()
    shown = {path.split("/")[1] for path in binds} | {link.split("/")[1] for _, link in symlinks}
    hidden = set(seen["root"]) <= shown | {"dev", "proc", SANDBOX_DIR.strip("/")}
    confined = set(seen["writable"]) <= _WRITABLE_OWN
    bounded = confined and all(0 < size <= _PROBE_LIMITS.disk_bytes for size in seen["sizes"].values())
    separated = (private["pid"] and private["mnt"]) or own_user
    return {
        "process_tree_ends_with_run": private["pid"] or own_user,
        "no_new_privs": True,
        "syscalls_filtered": True,
        "no_network": True,
        "private_ipc": private["ipc"] or seen["ipc_refused"],
        "no_host_unix_sockets": private["net"] and hidden,
        "host_files_hidden": hidden,
        "writes_confined": confined,
        "disk_bounded": bounded,
        "memory_per_run": memory_charged,
        "processes_counted_per_run": own_user,
        "caller_unreachable": separated,
        "runs_separated": separated,
    }


def explain_bwrap_failure(message: str) -> str:
    """Why bubblewrap failed, from an error carrying bubblewrap's stderr: the cause a user can act
    on (when bubblewrap's message names one) and bubblewrap's own line."""
    said = re.findall(r"bwrap: [^\n]*", message)
    detail = said[-1].strip() if said else message.strip()[-500:]
    for pattern, why in _BWRAP_FAILURES:
        if re.search(pattern, message):
            return f"{why} ({detail})"
    return f"bwrap failed: {detail}"


# Lists what the interpreter gives a program: its version and the distributions it can import.
_PACKAGES = """
import importlib.metadata, json, sys
packages = {(d.metadata["Name"] or "?").lower(): d.version for d in importlib.metadata.distributions()}
print(json.dumps([sys.version.split()[0], dict(sorted(packages.items()))]))
"""

# The probe program (standard library only); it prints one JSON object.
_PROBE = r'''
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def answer(number, args):
    return 0 if libc.syscall(ctypes.c_long(number), *map(ctypes.c_long, args)) >= 0 else ctypes.get_errno()

def created(family, kind):
    fd = libc.socket(family, kind, 0)
    if fd >= 0:
        os.close(fd)
    return fd >= 0

def writable_mounts():
    found = []
    for line in open("/proc/self/mountinfo"):
        fields = line.split()
        if "rw" in fields[5].split(","):
            found.append(fields[4])
    return found

def ipc_refused():
    segment = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if segment >= 0:
        libc.shmctl(segment, 0, None)  # IPC_RMID
    return segment < 0 and ctypes.get_errno() == 38  # ENOSYS: the filter's

status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
sizes = {{}}
for path in ({sandbox_dir!r}, "/dev/shm", "."):
    if os.path.isdir(path):
        fs = os.statvfs(path)
        sizes[path] = fs.f_blocks * fs.f_frsize
print(json.dumps({{
    "no_new_privs": status["NoNewPrivs"].strip() == "1",
    "uid": os.getuid(),
    "namespaces": {{name: os.readlink(f"/proc/self/ns/{{name}}") for name in {namespaces!r}}},
    "sockets": [name for name, (family, kind) in {families!r}.items() if created(family, kind)]
               + (["AF_UNIX"] if created(1, 1) else []),
    "calls": {{name: answer(number, args) for name, (number, args) in {calls!r}.items()}},
    "ipc_refused": ipc_refused(),
    "root": sorted(os.listdir("/")),
    "writable": writable_mounts(),
    "sizes": sizes,
}}))
'''
