"""The system call filter every sandboxed program runs under: a seccomp BPF program built here.

A denylist, as flatpak's: everything is allowed except

* ``socket`` / ``socketpair`` of any family but AF_UNIX (EAFNOSUPPORT): no network, netlink,
  packet or AF_VSOCK socket, whatever namespace the run has (a network namespace does not
  cover vsock, a channel to the hypervisor on VMs);
* the kernel keyrings (``keyctl``, ``add_key``, ``request_key``), io_uring, userfaultfd,
  memfd_secret, bpf, perf events and the new mount API (ENOSYS, so that libraries fall back);
* ptrace, reading or comparing other processes (``process_vm_*``, ``kcmp``, ``pidfd_getfd``),
  namespaces (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag, ``clone3``, whose
  flags a filter cannot read: glibc falls back to ``clone``), mounts, and administrative calls
  (EPERM or ENOSYS);
* with ``shared_ipc`` (a run in the host's IPC namespace), System V IPC and POSIX message
  queues, whose objects would outlive the run on the host and whose ids can be guessed;
* any call of another ABI (i386 ``int 0x80``, arm32) kills the process: their numbers mean
  other calls, which the table below does not name. x32 calls on x86_64 get ENOSYS.

Tables exist for x86_64 and aarch64 (``tests/test_sandbox_seccomp.py`` checks them against the
kernel headers); on another architecture :func:`build` raises :class:`SandboxError`, so the
sandbox refuses to run rather than run unfiltered. The program is ``struct sock_filter[]``
in native byte order, as ``bwrap --seccomp FD`` reads it and ``PR_SET_SECCOMP`` takes it.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass

from gdpo_megatron.rewards.sandbox.limits import SandboxError

# name: (x86_64, aarch64) numbers; None where the architecture has no such call. Sources:
# arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h (aarch64).
NUMBERS = {
    "socket": (41, 198), "socketpair": (53, 199), "clone": (56, 220), "ioctl": (16, 29),
    "clone3": (435, 435),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "userfaultfd": (323, 282), "memfd_secret": (447, 447), "bpf": (321, 280), "perf_event_open": (298, 241),
    "lookup_dcookie": (212, 18), "pidfd_getfd": (438, 438),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "acct": (163, 89), "syslog": (103, 116), "quotactl": (179, 60),
    "quotactl_fd": (443, 443), "open_by_handle_at": (304, 265), "fanotify_init": (300, 262),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171), "vhangup": (153, 58),
    "move_pages": (279, 239), "migrate_pages": (256, 238), "mbind": (237, 235),
    "set_mempolicy": (238, 237), "get_mempolicy": (239, 236),
    "uselib": (134, None), "ustat": (136, None), "sysfs": (139, None), "_sysctl": (156, None),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None),
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197), "semget": (64, 190),
    "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192), "msgget": (68, 186), "msgsnd": (69, 189),
    "msgrcv": (70, 188), "msgctl": (71, 187), "mq_open": (240, 180), "mq_unlink": (241, 181),
}
ARCHITECTURES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column in NUMBERS, AUDIT_ARCH_*

NOT_AVAILABLE = ("add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter", "io_uring_register",
                  "userfaultfd", "memfd_secret", "bpf", "perf_event_open", "lookup_dcookie", "pidfd_getfd",
                  "clone3", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr")
NOT_PERMITTED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "unshare", "setns", "mount", "umount2",
                  "pivot_root", "chroot", "swapon", "swapoff", "reboot", "kexec_load", "kexec_file_load",
                  "init_module", "finit_module", "delete_module", "acct", "syslog", "quotactl", "quotactl_fd",
                  "open_by_handle_at", "fanotify_init", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
                  "vhangup", "move_pages", "migrate_pages", "mbind", "set_mempolicy", "get_mempolicy", "uselib",
                  "ustat", "sysfs", "_sysctl", "iopl", "ioperm", "modify_ldt")
HOST_IPC = ("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd",
            "msgrcv", "msgctl", "mq_open", "mq_unlink")  # refused (ENOSYS) with shared_ipc

AF_UNIX = 1
CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # push input into a terminal
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]. Both
# architectures are little-endian: an int argument is the low word of args[i].
_NR, _ARCH = 0, 4
_LD_W_ABS, _JEQ, _JSET, _JGE, _JA, _RET = 0x20, 0x15, 0x45, 0x35, 0x05, 0x06
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def _arg(i: int) -> int:
    return 16 + 8 * i


def syscall_number(name: str, machine: str | None = None) -> int:
    """The number of system call ``name`` on ``machine`` (default: this one)."""
    column, _ = _architecture(machine or platform.machine())
    number = NUMBERS[name][column]
    if number is None:
        raise SandboxError(f"sandbox: {machine or platform.machine()} has no system call {name!r}")
    return number


def build(machine: str | None = None, shared_ipc: bool = False) -> bytes:
    """The filter for ``machine`` (default: this one); ``shared_ipc``: the run shares the host's
    IPC namespace, so creating IPC objects is refused too."""
    machine = machine or platform.machine()
    column, audit_arch = _architecture(machine)
    refused = {**{name: errno.ENOSYS for name in NOT_AVAILABLE}, **{name: errno.EPERM for name in NOT_PERMITTED}}
    if shared_ipc:
        refused.update({name: errno.ENOSYS for name in HOST_IPC})
    numbers = {name: NUMBERS[name][column] for name in refused if NUMBERS[name][column] is not None}
    a = _Assembler()
    a.load(_ARCH)
    a.jump_if(_JEQ, audit_arch, "native")
    a.ret(RET_KILL_PROCESS)
    a.label("native")
    a.load(_NR)
    if machine == "x86_64":
        a.jump_if(_JGE, X32_SYSCALL_BIT, errno.ENOSYS)
    a.jump_if(_JEQ, NUMBERS["socket"][column], "socket")
    a.jump_if(_JEQ, NUMBERS["socketpair"][column], "socket")
    a.jump_if(_JEQ, NUMBERS["clone"][column], "clone")
    a.jump_if(_JEQ, NUMBERS["ioctl"][column], "ioctl")
    for name, number in sorted(numbers.items(), key=lambda item: item[1]):
        a.jump_if(_JEQ, number, refused[name])
    a.ret(RET_ALLOW)
    a.label("socket")  # socket(int domain, ...), socketpair(int domain, ...)
    a.load(_arg(0))
    a.jump_if(_JEQ, AF_UNIX, "allow")
    a.ret(RET_ERRNO | errno.EAFNOSUPPORT)
    a.label("clone")  # clone(unsigned long flags, ...) on both architectures
    a.load(_arg(0))
    a.jump_if(_JSET, CLONE_NEW, errno.EPERM)
    a.ret(RET_ALLOW)
    a.label("ioctl")  # ioctl(int fd, unsigned int request, ...)
    a.load(_arg(1))
    a.jump_if(_JEQ, TIOCSTI, errno.EPERM)
    a.jump_if(_JEQ, TIOCLINUX, errno.EPERM)
    a.label("allow")
    a.ret(RET_ALLOW)
    for code in (errno.EPERM, errno.ENOSYS):
        a.label(code)
        a.ret(RET_ERRNO | code)
    return a.assemble()


def _architecture(machine: str) -> tuple[int, int]:
    try:
        return ARCHITECTURES[machine]
    except KeyError:
        raise SandboxError(f"sandbox: no system call table for the {machine!r} architecture (known: "
                           f"{', '.join(ARCHITECTURES)}); it refuses to run programs unfiltered") from None


class _Assembler:
    """Classic BPF with forward jumps to labels. A conditional jump is ``jxx k, 0, 1; ja label``:
    ``ja`` takes a 32-bit offset, where ``jt``/``jf`` reach 255 instructions only."""

    def __init__(self):
        self.code: list[list[int]] = []  # [code, jt, jf, k]
        self.labels: dict[object, int] = {}
        self.jumps: list[tuple[int, object]] = []

    def load(self, offset: int) -> None:
        self.code.append([_LD_W_ABS, 0, 0, offset])

    def ret(self, value: int) -> None:
        self.code.append([_RET, 0, 0, value])

    def jump_if(self, condition: int, k: int, label: object) -> None:
        self.code.append([condition, 0, 1, k])
        self.jumps.append((len(self.code), label))
        self.code.append([_JA, 0, 0, 0])

    def label(self, name: object) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        for at, label in self.jumps:
            offset = self.labels[label] - at - 1
            assert offset >= 0, f"backward jump to {label!r}"
            self.code[at][3] = offset
        assert len(self.code) <= 4096, "longer than BPF_MAXINSNS"
        return b"".join(struct.pack("=HBBI", *instruction) for instruction in self.code)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


@dataclass(frozen=True)
class Loadable:
    """A filter ready to install between fork and exec: its memory is allocated beforehand."""

    program: bytes
    _buffer: ctypes.Array
    _fprog: _SockFprog

    @classmethod
    def of(cls, program: bytes) -> "Loadable":
        buffer = ctypes.create_string_buffer(program, len(program))
        return cls(program, buffer, _SockFprog(len(program) // 8, ctypes.addressof(buffer)))

    def install(self, libc: ctypes.CDLL) -> None:
        """no_new_privs (which lets an unprivileged process install a filter), then the filter,
        on the calling thread; children and exec'd programs keep both."""
        for args in ((_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), (_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                                                          ctypes.byref(self._fprog), 0, 0)):
            if libc.prctl(*args) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"prctl({args[0]}): {os.strerror(error)}")
