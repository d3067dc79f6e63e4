"""The sandbox's system call filter, for both architectures it has tables for.

The numbers are checked against the kernel headers installed here (linux-libc-dev), and the
filter's decisions by a classic-BPF interpreter written here, so aarch64's filter is checked
on any machine. tests/test_sandbox.py attacks the filter installed for real.
"""
import errno
import re
import struct
from pathlib import Path

import pytest

from gdpo_megatron.rewards.sandbox import SandboxError, seccomp

HEADERS = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
           "aarch64": Path("/usr/include/asm-generic/unistd.h")}  # aarch64 uses the generic table
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "i386": 0x40000003, "arm": 0x40000028}
KILL, ALLOW = 0x80000000, 0x7FFF0000
AF_UNIX, AF_INET, AF_VSOCK = 1, 2, 40
SIGCHLD, CLONE_NEWUSER, CLONE_NEWNET, CLONE_VM, CLONE_THREAD = 17, 0x10000000, 0x40000000, 0x100, 0x10000


def errno_of(action):
    assert action & 0xFFFF0000 == 0x00050000, hex(action)  # SECCOMP_RET_ERRNO
    return action & 0xFFFF


def run_bpf(program: bytes, nr: int, arch: int, args=(0,) * 6) -> int:
    """What a classic-BPF seccomp program returns for one call (the subset a filter uses)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[a & (2 ** 64 - 1) for a in args])
    code = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, a = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # ld [k]
            a = struct.unpack_from("<I", data, k)[0]
        elif op == 0x06:  # ret k
            return k
        elif op == 0x05:  # ja
            pc += k
        elif op in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: a == k, 0x35: a >= k, 0x45: a & k != 0}[op]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unexpected instruction {op:#x} at {pc}")
        pc += 1


def header_numbers(machine):
    text = HEADERS[machine].read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define __NR(?:3264)?_(\w+)\s+(\d+)\s*$", text, re.M)}


@pytest.mark.parametrize("machine", seccomp.ARCHITECTURES)
def test_the_tables_are_the_kernels(machine):
    if not HEADERS[machine].exists():
        pytest.skip(f"no kernel headers at {HEADERS[machine]} (Debian: linux-libc-dev)")
    column = seccomp.ARCHITECTURES[machine][0]
    known = header_numbers(machine)
    ours = {name: numbers[column] for name, numbers in seccomp.NUMBERS.items()}
    assert ours == {name: known.get(name) for name in ours}


@pytest.mark.parametrize("machine", seccomp.ARCHITECTURES)
@pytest.mark.parametrize("shared_ipc", [False, True])
def test_the_filters_decisions(machine, shared_ipc):
    program = seccomp.build(machine, shared_ipc=shared_ipc)
    arch = AUDIT_ARCH[machine]

    def decide(name, *args):
        return run_bpf(program, seccomp.syscall_number(name, machine), arch, args + (0,) * (6 - len(args)))

    refused = {**{n: errno.ENOSYS for n in seccomp.NOT_AVAILABLE}, **{n: errno.EPERM for n in seccomp.NOT_PERMITTED}}
    if shared_ipc:
        refused.update({n: errno.ENOSYS for n in seccomp.HOST_IPC})
    for name, code in refused.items():
        if seccomp.NUMBERS[name][seccomp.ARCHITECTURES[machine][0]] is not None:
            assert errno_of(decide(name)) == code, name
    for name in ("socket", "socketpair"):
        assert decide(name, AF_UNIX, 1) == ALLOW
        assert errno_of(decide(name, AF_INET, 1)) == errno.EAFNOSUPPORT
        assert errno_of(decide(name, AF_VSOCK, 1)) == errno.EAFNOSUPPORT
    assert decide("clone", SIGCHLD) == ALLOW  # fork
    assert decide("clone", CLONE_VM | CLONE_THREAD | 0x3D0F00) == ALLOW  # a thread
    for flag in (CLONE_NEWUSER, CLONE_NEWNET):
        assert errno_of(decide("clone", flag | SIGCHLD)) == errno.EPERM
    assert errno_of(decide("ioctl", 0, 0x5412)) == errno.EPERM  # TIOCSTI
    assert decide("ioctl", 0, 0x541B) == ALLOW  # FIONREAD
    # Every other call is allowed; another ABI's calls kill the process.
    column = seccomp.ARCHITECTURES[machine][0]
    named = {numbers[column] for name, numbers in seccomp.NUMBERS.items()
             if name in refused or name in ("socket", "socketpair", "clone", "ioctl")}
    assert [nr for nr in range(600) if nr not in named and run_bpf(program, nr, arch) != ALLOW] == []
    for other in ("i386", "arm", "aarch64" if machine == "x86_64" else "x86_64"):
        assert run_bpf(program, 39, AUDIT_ARCH[other]) == KILL
    if machine == "x86_64":  # the x32 ABI: x86_64's arch, numbers from 0x40000000
        assert errno_of(run_bpf(program, 0x40000000 | 39, arch)) == errno.ENOSYS


def test_an_architecture_without_a_table_is_refused_not_run_unfiltered():
    with pytest.raises(SandboxError, match="no system call table for the 'riscv64' architecture.*refuses to run"):
        seccomp.build("riscv64")
    with pytest.raises(SandboxError, match="riscv64"):
        seccomp.syscall_number("keyctl", "riscv64")
    with pytest.raises(SandboxError, match="aarch64 has no system call 'iopl'"):
        seccomp.syscall_number("iopl", "aarch64")
