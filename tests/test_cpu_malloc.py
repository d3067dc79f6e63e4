"""The CPU host allocator: programs restart once with tcmalloc preloaded, and only when they should."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gdpo_megatron import cpu_malloc

# Prints whether tcmalloc is mapped into the process, and the process id, after the restart.
PROBE = ("import os; from gdpo_megatron.cpu_malloc import reexec_with_tcmalloc; reexec_with_tcmalloc(); "
         "print('tcmalloc' in open('/proc/self/maps').read(), os.getpid(), os.environ.get('LD_PRELOAD', ''))")

needs_tcmalloc = pytest.mark.skipif(cpu_malloc.tcmalloc_library() is None or cpu_malloc.has_nvidia_driver(),
                                    reason="needs tcmalloc (libtcmalloc-minimal4) and no NVIDIA driver")


def probe(**env_changes: str | None) -> tuple[bool, int, str]:
    env = {k: v for k, v in os.environ.items() if k not in (cpu_malloc.OPT_OUT_ENV, "LD_PRELOAD")}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    proc = subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    mapped, pid, preload = out.split(" ", 2)
    assert int(pid) == proc.pid  # restarted in place: the launcher still waits on the same process
    return mapped == "True", int(pid), preload.strip()


@needs_tcmalloc
def test_a_cpu_process_restarts_once_with_tcmalloc_and_keeps_what_was_preloaded():
    mapped, _, preload = probe()
    assert mapped and preload == cpu_malloc.tcmalloc_library()
    mapped, _, preload = probe(LD_PRELOAD="libm.so.6")
    assert mapped and preload.split() == [cpu_malloc.tcmalloc_library(), "libm.so.6"]


@needs_tcmalloc
def test_the_opt_out_and_a_tcmalloc_already_preloaded_are_left_alone():
    mapped, _, preload = probe(GDPO_MALLOC="system")
    assert not mapped and preload == ""
    library = cpu_malloc.tcmalloc_library()
    mapped, _, preload = probe(LD_PRELOAD=library)
    assert mapped and preload == library


def test_what_is_preloaded_when():
    assert cpu_malloc.wants_tcmalloc({"GDPO_MALLOC": " System "}) is None
    assert cpu_malloc.wants_tcmalloc({"LD_PRELOAD": "/opt/lib/libtcmalloc_minimal.so.4"}) is None
    assert cpu_malloc.wants_tcmalloc({"LD_PRELOAD": "libjemalloc.so.2"}) is None  # the user chose one
    expected = None if cpu_malloc.has_nvidia_driver() else cpu_malloc.tcmalloc_library()
    assert cpu_malloc.wants_tcmalloc({}) == expected
    assert cpu_malloc.preload_env({"A": "1"}, "libx.so") == {"A": "1", "LD_PRELOAD": "libx.so"}


def test_the_programs_restart_before_torch_is_imported():
    """The restart must come before torch is loaded, or every CPU run imports torch twice."""
    code = "import sys, gdpo_megatron.cli, gdpo_megatron.demo.__main__; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
