"""What the code sandbox holds, measured: each attack of docs/rewards.md's table under each setup here.

    python benchmarks/sandbox_attacks.py            # as root: bwrap, basic (own namespaces), basic (host's)
    setpriv --reuid=nobody --regid=nogroup --clear-groups /usr/bin/python3 benchmarks/sandbox_attacks.py
                                                    # as another user: bwrap, basic

Prints one markdown row per attack, one column per setup. An attack that is contained says how;
one that is not says what it reached on the host (cleaned up afterwards). Runs on a system Python
too: the sandbox needs only the standard library (the package's reward stage, which imports
torch, is not imported).
"""
from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.modules["gdpo_megatron.rewards"] = types.ModuleType("gdpo_megatron.rewards")  # its __init__ imports torch
sys.modules["gdpo_megatron.rewards"].__path__ = [str(ROOT / "gdpo_megatron" / "rewards")]
sandbox = importlib.import_module("gdpo_megatron.rewards.sandbox")

LIMITS = sandbox.SandboxLimits(wall_s=20.0, cpu_s=10)  # the defaults: 1 GiB memory, 64 MiB disk, 32 processes
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
MARK = f"gdpo-attack-{os.getpid()}"


def run(setup, code, limits=LIMITS):
    return sandbox.SandboxedRun({"main.py": code}, "", limits, setup).finish(time.monotonic() + limits.wall_s)


def many_files(setup):
    code = ("n = 0\ntry:\n    while n < 512:\n        open(f'f{n}', 'wb').write(b'x' * (1 << 20))\n        n += 1\n"
            "except OSError:\n    pass\nprint(n)\n")
    n = int(run(setup, code).stdout)
    return f"stops at {n} MiB" if n < 512 else "512 MiB written (the test's cap): no bound"


def writes_outside(setup):
    places = ("/tmp", "/dev/shm", "/var/tmp", "/run/lock")
    code = f"for d in {places!r}:\n    try:\n        open(d + '/{MARK}', 'w').write('x')\n    except OSError:\n        pass\n"
    run(setup, code)
    left = [d for d in places if os.path.exists(f"{d}/{MARK}")]
    for d in left:
        os.unlink(f"{d}/{MARK}")
    return f"files left in host {', '.join(left)}" if left else "none reach the host"


def sysv_objects(setup):
    key = os.getpid() << 8
    code = LIBC + (f"made = [libc.shmget({key}, 1 << 20, 0o1600), libc.msgget({key}, 0o1600), libc.semget({key}, 1, 0o1600)]\n"
                   "print(sum(m >= 0 for m in made), ctypes.get_errno())\n")
    made, error = map(int, run(setup, code).stdout.split())
    left = _remove_ipc([key])
    if left:
        return f"{left} object(s) left on the host"
    return "refused (ENOSYS)" if made == 0 else f"{made} made, private, gone after the run"


def sysv_memory(setup):
    keys = [(os.getpid() << 8) + i for i in range(1, 5)]
    code = LIBC + ("libc.shmat.restype = ctypes.c_void_p\nheld = 0\n"
                   f"for key in {keys!r}:\n"
                   "    segment = libc.shmget(key, 512 << 20, 0o1600)\n"
                   "    if segment < 0:\n        print('refused', ctypes.get_errno(), flush=True)\n        break\n"
                   "    address = libc.shmat(segment, None, 0)\n"
                   "    ctypes.memset(address, 1, 512 << 20)\n    libc.shmdt(ctypes.c_void_p(address))\n"
                   "    held += 512\n    print(held, flush=True)\n")
    result = run(setup, code)
    held = _ipc_bytes(keys) >> 20
    _remove_ipc(keys)
    if held:
        return f"{held} MiB of host shared memory held after the run"
    if result.memory_limited:
        return f"killed by the run's memory bound (at {result.stdout.split()[-1] if result.stdout else 0} MiB)"
    if "refused" in result.stdout:
        return "refused (ENOSYS)"
    return f"{result.stdout.split()[-1]} MiB held during the run (no bound), none after"


def loopback(setup):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        code = ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
                "    print('connected')\nexcept OSError as e:\n    print(e.strerror)\n")
        said = run(setup, code).stdout.strip()
        try:
            server.accept()
            return "host loopback reached"
        except socket.timeout:
            return f"refused ({said})"


def unix_sockets(setup):
    path = Path(tempfile.gettempdir()) / f"{MARK}.sock"
    servers = []
    for address in (str(path), f"\0{MARK}"):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.settimeout(0.2)
        servers.append(server)
    os.chmod(path, 0o777)
    code = (f"import socket\nfor a in ({str(path)!r}, {chr(0) + MARK!r}):\n    try:\n"
            "        socket.socket(socket.AF_UNIX).connect(a)\n    except OSError:\n        pass\n")
    run(setup, code)
    reached = []
    for name, server in zip(("in a file", "abstract"), servers):
        try:
            server.accept()
            reached.append(name)
        except socket.timeout:
            pass
        server.close()
    path.unlink()
    return f"host unix socket reached ({', '.join(reached)})" if reached else "unreachable"


def vsock(setup):
    code = "import socket\ntry:\n    socket.socket(40, socket.SOCK_STREAM).close()\n    print('created')\nexcept OSError as e:\n    print(e.strerror)\n"
    said = run(setup, code).stdout.strip()
    return "AF_VSOCK socket created" if said == "created" else f"refused ({said})"


def keyring(setup):
    add_key, keyctl = sandbox.seccomp.syscall_number("add_key"), sandbox.seccomp.syscall_number("keyctl")
    key = libc.syscall(ctypes.c_long(add_key), b"user", MARK.encode(), b"secret", ctypes.c_size_t(6), ctypes.c_int(-3))
    code = LIBC + ("buffer = ctypes.create_string_buffer(64)\n"
                   f"n = libc.syscall(ctypes.c_long({keyctl}), ctypes.c_long(11), ctypes.c_long({key}), buffer, ctypes.c_long(64))\n"
                   "print(buffer.raw[:n].decode() if n >= 0 else os.strerror(ctypes.get_errno()))\n")
    said = run(setup, code).stdout.strip()
    libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(21), ctypes.c_long(key))
    return "the caller's key read" if said == "secret" else f"refused ({said})"


def kernel_surface(setup):
    calls = {"io_uring_setup": "1, 0", "userfaultfd": "0", "memfd_secret": "0", "keyctl": "0, -3, 0",
             "kcmp": "os.getpid(), os.getpid(), 0, 0, 0", "unshare": "0x10000000"}
    code = LIBC + "".join(
        f"print({name!r}, libc.syscall(ctypes.c_long({sandbox.seccomp.syscall_number(name)}), *map(ctypes.c_long, ({args},))) >= 0)\n"
        for name, args in calls.items())
    allowed = [line.split()[0] for line in run(setup, code).stdout.splitlines() if line.endswith("True")]
    return f"allowed: {', '.join(allowed)}" if allowed else "all refused"


def proc_and_host_tmp(setup):
    marker = Path(tempfile.gettempdir()) / MARK
    marker.write_text("x")
    code = ("import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]), "
            f"os.path.exists({str(marker)!r}), os.path.exists('/etc/passwd'))\n")
    count, tmp, etc = run(setup, code).stdout.split()
    marker.unlink()
    seen = [what for what, shown in (("host /tmp", tmp), ("host /etc", etc)) if shown == "True"]
    return (f"{count} processes visible" + (f"; {' and '.join(seen)} visible" if seen else "; host files hidden"))


def memory_over_processes(setup):
    code = ("import os, time\nr, w = os.pipe()\nfor _ in range(8):\n    if os.fork() == 0:\n"
            "        block = bytearray(256 << 20)\n        for i in range(0, len(block), 4096):\n            block[i] = 1\n"
            "        os.write(w, b'x')\n        time.sleep(3)\n        os._exit(0)\n"
            "time.sleep(2)\nos.set_blocking(r, False)\nprint(len(os.read(r, 64)), flush=True)\ntime.sleep(2)\n")
    result = run(setup, code)
    held = int(result.stdout.split()[0]) * 256 if result.stdout.strip() else 0
    if result.memory_limited:
        return f"{held} MiB held at once, then the run's memory bound killed it"
    return f"{held} MiB held at once: a per-process bound only"


def process_left(setup):
    code = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {MARK!r}])\n"
            "    os._exit(0)\ntime.sleep(0.5)\n")
    run(setup, code)
    time.sleep(0.2)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, MARK)]
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    return f"{len(left)} process(es) left running" if left else "none left"


def caller_signals(setup):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    code = (f"import os, signal\nfor pid in ({os.getpid()}, -1):\n    try:\n        os.kill(pid, signal.SIGUSR1)\n"
            "    except OSError:\n        pass\n"
            f"try:\n    print(len(open('/proc/{os.getpid()}/environ').read()))\nexcept OSError as e:\n    print(e.strerror)\n")
    said = run(setup, code).stdout.strip()
    time.sleep(0.1)
    signal.signal(signal.SIGUSR1, previous)
    reached = (["signalled"] if received else []) + ([] if not said.isdigit() else ["its environment read"])
    return f"caller {' and '.join(reached)}" if reached else "unreachable"


def _cmdline_has(pid, word):
    try:
        return word.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _ipc_bytes(keys):
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return sum(int(row[3]) for row in rows if int(row[0]) in keys)


def _remove_ipc(keys):
    """Remove the host's IPC objects of ``keys``; how many there were."""
    removed = 0
    for key in keys:
        for get, remove in ((lambda k: libc.shmget(k, 0, 0), lambda i: libc.shmctl(i, 0, None)),
                            (lambda k: libc.msgget(k, 0), lambda i: libc.msgctl(i, 0, None)),
                            (lambda k: libc.semget(k, 0, 0), lambda i: libc.semctl(i, 0, 0))):
            if (ident := get(key)) >= 0:
                remove(ident)
                removed += 1
    return removed


ATTACKS = {
    "many files in the working directory": many_files,
    "writes outside it (/tmp, /dev/shm, /var/tmp, /run/lock)": writes_outside,
    "System V IPC objects": sysv_objects,
    "2 GiB of System V shared memory": sysv_memory,
    "memory over 8 processes of 256 MiB": memory_over_processes,
    "a connection to the host's loopback": loopback,
    "the host's unix sockets": unix_sockets,
    "an AF_VSOCK socket": vsock,
    "the caller's session keyring": keyring,
    "io_uring, userfaultfd, memfd_secret, keyctl, kcmp, unshare": kernel_surface,
    "/proc and host files": proc_and_host_tmp,
    "a daemon (setsid, double fork) after the run": process_left,
    "signals to the caller, its environment": caller_signals,
}


def setups():
    found = {}
    if sandbox.bwrap_missing() is None:
        found["bwrap"] = sandbox.isolation("bwrap").setup
    basic = sandbox.isolation("basic")
    if basic.setup.namespaces:
        found["basic, own namespaces"] = basic.setup
    found["basic, host namespaces"] = sandbox.Setup("basic")
    return found


def main():
    who = "root" if os.geteuid() == 0 else "another user"
    columns = setups()
    print("| attack | " + " | ".join(f"{name} ({who})" for name in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for attack, measure in ATTACKS.items():
        print(f"| {attack} | " + " | ".join(measure(setup) for setup in columns.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
