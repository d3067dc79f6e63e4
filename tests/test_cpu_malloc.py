"""The CPU host allocator: programs restart once with tcmalloc preloaded, and only when they should."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gdpo_megatron.commands import cpu_malloc

# Prints whether tcmalloc is mapped into the process, its pid and LD_PRELOAD, after any restart.
PROBE = ("import os; from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc; reexec_with_tcmalloc(); "
         "print('tcmalloc' in open('/proc/self/maps').read(), os.getpid(), os.environ.get('LD_PRELOAD', ''))")

needs_tcmalloc = pytest.mark.skipif(cpu_malloc.tcmalloc_library() is None or cpu_malloc.nvidia_driver() is not None,
                                    reason="needs tcmalloc (libtcmalloc-minimal4) and no NVIDIA driver")


def probe(**env_changes: str) -> tuple[bool, str]:
    """Run PROBE with this environment less GDPO_MALLOC and LD_PRELOAD, plus ``env_changes``."""
    env = {k: v for k, v in os.environ.items() if k not in (cpu_malloc.CHOICE_ENV, "LD_PRELOAD")}
    proc = subprocess.Popen([sys.executable, "-c", PROBE], env={**env, **env_changes}, stdout=subprocess.PIPE,
                            text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    mapped, pid, preload = out.split(" ", 2)
    assert int(pid) == proc.pid  # restarted in place: the launcher still waits on the same process
    return mapped == "True", preload.strip()


@needs_tcmalloc
def test_a_cpu_process_restarts_once_with_tcmalloc():
    assert probe() == (True, cpu_malloc.tcmalloc_library())


@needs_tcmalloc
def test_the_opt_out_a_users_preload_and_the_restart_marker_are_left_alone():
    assert probe(GDPO_MALLOC="system") == (False, "")
    assert probe(GDPO_MALLOC="tcmalloc") == (False, "")  # a loader that dropped LD_PRELOAD: no second restart
    assert probe(LD_PRELOAD="libm.so.6") == (False, "libm.so.6")


def test_what_is_preloaded_when():
    assert cpu_malloc.wants_tcmalloc({"GDPO_MALLOC": "system"}) is None
    assert cpu_malloc.wants_tcmalloc({"LD_PRELOAD": "libjemalloc.so.2"}) is None
    expected = None if cpu_malloc.nvidia_driver() is not None else cpu_malloc.tcmalloc_library()
    assert cpu_malloc.wants_tcmalloc({"LD_PRELOAD": " "}) == expected
    assert cpu_malloc.preload_env({"A": "1", "LD_PRELOAD": "liby.so"}, "libx.so") == {
        "A": "1", "LD_PRELOAD": "libx.so liby.so"}


def test_the_programs_restart_before_torch_is_imported():
    """The restart must come before torch is loaded, or every CPU run imports torch twice."""
    code = ("import sys, gdpo_megatron.__main__, gdpo_megatron.commands.train, gdpo_megatron.demo.__main__; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
