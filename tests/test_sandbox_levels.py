"""Why the strong level is missing, said in words a user can act on: bubblewrap's own failures,
reproduced here where they can be (as a container would cause them), and its messages as its
source states them."""
import errno
import os
import platform
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gdpo_megatron.rewards.sandbox import levels, seccomp

ROOT = Path(__file__).resolve().parents[1]
NEEDS = pytest.mark.skipif(not (os.geteuid() == 0 and shutil.which("bwrap") and shutil.which("unshare")),
                           reason="reproduces a container's restrictions as root, with bwrap and unshare")
# The sandbox probed in a fresh process; only the sandbox is imported (the reward stage imports torch).
DESCRIBE = (
    "import sys, types\n"
    f"rewards = types.ModuleType('gdpo_megatron.rewards'); rewards.__path__ = [{str(ROOT / 'gdpo_megatron' / 'rewards')!r}]\n"
    "sys.modules['gdpo_megatron.rewards'] = rewards\n"
    "from gdpo_megatron.rewards import sandbox\n"
    "print(sandbox.isolation().describe())\n"
)


def describe_in_a_process(*wrapper, preexec_fn=None) -> str:
    result = subprocess.run([*wrapper, sys.executable, "-c", DESCRIBE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=preexec_fn)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@NEEDS
def test_a_container_that_masks_proc_paths():
    """Docker and Podman mount over /proc/keys, /proc/kcore...; a new procfs in a user namespace
    is then refused (the kernel's mnt_too_revealing)."""
    described = describe_in_a_process("unshare", "--mount", "--propagation", "private", "sh", "-c",
                                      'mount --bind /dev/null /proc/keys && exec "$@"', "sh")
    assert described == ("basic, in namespaces of its own (no bwrap: a container's masked /proc paths keep bwrap from "
                         "mounting /proc (Docker: --security-opt systempaths=unconfined) (bwrap: Can't mount proc on "
                         "/newroot/proc: Operation not permitted))")


@NEEDS
@pytest.mark.skipif(platform.machine() not in seccomp.ARCHITECTURES, reason="no system call table here")
def test_a_seccomp_profile_that_refuses_user_namespaces():
    """As Docker's default profile does: clone and unshare with CLONE_NEWUSER get EPERM, clone3 ENOSYS."""
    column, audit_arch = seccomp.ARCHITECTURES[platform.machine()]
    number = {name: seccomp.NUMBERS[name][column] for name in ("clone", "unshare", "clone3")}
    ld, jeq, jset, ret, allow = 0x20, 0x15, 0x45, 0x06, 0x7FFF0000
    eperm, enosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    program = [
        (ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, allow),
        (ld, 0, 0, 0), (jeq, 0, 1, number["clone3"]), (ret, 0, 0, enosys),
        (jeq, 1, 0, number["clone"]), (jeq, 0, 3, number["unshare"]),
        (ld, 0, 0, 16), (jset, 0, 1, 0x10000000), (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]
    code = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)

    def refuse_user_namespaces():
        seccomp.Loadable.of(code).install(seccomp.ctypes.CDLL(None, use_errno=True))

    described = describe_in_a_process(preexec_fn=refuse_user_namespaces)
    assert described.startswith("basic, in namespaces of its own (no bwrap: user namespaces are refused (sysctl "
                                "kernel.unprivileged_userns_clone=0, or a container's seccomp profile) (bwrap: ")


# bubblewrap.c (0.8.0; Debian's patch words the first one differently), as die_with_error prints them.
MESSAGES = [
    ("bwrap: No permissions to create new namespace, likely because the kernel does not allow non-privileged user "
     "namespaces. See <https://deb.li/bubblewrap> or <file:///usr/share/doc/bubblewrap/README.Debian.gz>.",
     "user namespaces are refused"),
    ("bwrap: No permissions to creating new namespace, likely because the kernel does not allow non-privileged user "
     "namespaces. On e.g. debian this can be enabled with 'sysctl kernel.unprivileged_userns_clone=1'.",
     "user namespaces are refused"),
    ("bwrap: Creating new namespace failed: nesting depth or /proc/sys/user/max_*_namespaces exceeded (ENOSPC)",
     "user namespaces are disabled (sysctl user.max_user_namespaces=0)"),
    ("bwrap: Creating new namespace failed, likely because the kernel does not support user namespaces.  bwrap must "
     "be installed setuid on such systems.", "the kernel has no user namespaces"),
    ("bwrap: setting up uid map: Permission denied", "AppArmor restricts user namespaces"),
    ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", "a container's masked /proc paths"),
    ("bwrap: Failed to mount tmpfs: Permission denied", "mounts in new namespaces are refused"),
    ("bwrap: Unable to set up system call filtering as requested: prctl(PR_SET_SECCOMP) reported EINVAL. (Hint: this "
     "requires a kernel configured with CONFIG_SECCOMP and CONFIG_SECCOMP_FILTER.)",
     "the kernel has no seccomp filter support"),
    ("bwrap: Something new: Input/output error", "bwrap failed"),
]


@pytest.mark.parametrize("said, cause", MESSAGES, ids=[m[1] for m in MESSAGES])
def test_bubblewraps_messages_are_explained(said, cause):
    error = f"sandbox (bwrap): the interpreter did not start (exit status 1): {said}"
    explained = levels.explain_bwrap_failure(error)
    assert explained.startswith(cause) and explained.endswith(f"({said})" if cause != "bwrap failed" else said)
