"""The basic level's namespaces, for a root caller without bubblewrap: what bubblewrap would do.

:func:`enter` runs in the child ``Popen`` started (root, between fork and exec):

1. It unshares mount, IPC, network, UTS and PID namespaces (the new network namespace has only
   a loopback, and it is down).
2. It forks. The parent stays outside as the run's *waiter*: it writes the host pid of its child
   to ``info_fd`` (``{"child-pid": N}``, as bubblewrap's ``--info-fd``), closes every other
   descriptor, and exits with that child's status. The child is pid 1 of the new PID namespace,
   the run's *init*: when it exits, the kernel kills every process left in the namespace.
3. Init builds a new root, as bubblewrap does: a tmpfs holding read-only binds of ``binds`` and
   the ``symlinks``, a ``/dev`` with null, zero, full, random, urandom and tty, a ``/dev/shm``
   and a ``/tmp`` tmpfs of ``disk_bytes`` each (``/tmp`` holds ``files``, owned by ``uid``), a
   ``/proc`` of the new namespace. It moves into it (``pivot_root``), detaches the host's root,
   and makes the new root and ``/dev`` read-only.
4. It forks again and waits, reaping every orphan, until that child exits; then it exits with its
   status (128 + the signal that killed it, as bubblewrap's init). The child returns from
   :func:`enter` in ``/tmp`` and becomes the program (the caller drops to ``uid``).

``root`` is an empty host directory the new root is mounted on (in the new mount namespace
only). An error raises ``OSError`` naming the step.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import stat
from pathlib import Path

from gdpo_megatron.rewards.sandbox import seccomp

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MNT_DETACH = 2
_KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}  # kept by a read-only remount
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # bubblewrap's --dev
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def enter(root: str, binds: list[str], symlinks: list[tuple[str, str]], files: dict[str, str], uid: int,
          disk_bytes: int, info_fd: int) -> None:
    """Steps 1-4 above; returns in the program's process."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWPID), "unshare")
    init = os.fork()
    if init:
        os.write(info_fd, json.dumps({"child-pid": init}).encode())
        _wait_and_exit(init)
    _libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL when the waiter dies
    _new_root(root, binds, symlinks, files, uid, disk_bytes)
    program = os.fork()
    if program:
        _wait_and_exit(program)


def _new_root(root: str, binds: list[str], symlinks: list[tuple[str, str]], files: dict[str, str], uid: int,
              disk_bytes: int) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing of this namespace propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for target, link in symlinks:
        os.symlink(target, root + link)
    for path in binds:
        os.makedirs(root + path)
        _bind_read_only(path, root + path)
    dev = root + "/dev"
    os.mkdir(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        os.close(os.open(f"{dev}/{name}", os.O_CREAT | os.O_WRONLY, 0o444))
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{fd}", f"{dev}/{name}")
    os.symlink("/proc/self/fd", f"{dev}/fd")
    os.mkdir(f"{dev}/shm")
    _mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={disk_bytes}")
    os.mkdir(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,uid={uid},gid={uid},size={disk_bytes}")
    write_files(Path(root, "tmp"), files, uid)
    os.chdir(root)
    _check(_libc.syscall(ctypes.c_long(seccomp.syscall_number("pivot_root")), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")  # it was stacked on the new one
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    socket.sethostname("sandbox")
    os.chdir("/tmp")


def write_files(directory: Path, files: dict[str, str], uid: int | None) -> None:
    """``files`` in ``directory``, which becomes private to ``uid`` (when given)."""
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
    if uid is not None:
        for path in (directory, *directory.iterdir()):
            os.chown(path, uid, uid)
        os.chmod(directory, stat.S_IRWXU)


def _bind_read_only(source: str, target: str) -> None:
    """Bind ``source`` and the mounts below it at ``target``, every one of them read-only."""
    _mount(source, target, None, MS_BIND | MS_REC)
    for point, options in _mounts_at_or_under(target):
        kept = sum(flag for name, flag in _KEPT_FLAGS.items() if name in options)
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def _mounts_at_or_under(path: str) -> list[tuple[str, list[str]]]:
    """(mount point, per-mount options) of this namespace's mounts at ``path`` or below it."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if point == path or point.startswith(path + "/"):
                found.append((point, fields[5].split(",")))
    return found


def _wait_and_exit(child: int) -> None:
    """Close every descriptor, reap children until ``child`` exits, and exit with its status."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = (lambda text: None if text is None else text.encode())
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _check(result: int, step: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{step}: {os.strerror(error)}")
