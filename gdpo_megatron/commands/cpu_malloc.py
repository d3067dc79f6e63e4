"""CPU runs allocate host memory with tcmalloc, as vLLM recommends for its CPU backend.

Under glibc's malloc a CPU training process's resident set climbs for several steps (freed
activations stay in glibc's heap); tcmalloc reuses those pages. A library can only be
preloaded before the process starts, so :func:`reexec_with_tcmalloc` restarts the process in
place (same pid and argv) with tcmalloc in ``LD_PRELOAD``. It does so only when

* no NVIDIA driver is present: every tensor is on the CPU (GPU runs are left as they are);
* tcmalloc is installed (Debian/Ubuntu: ``libtcmalloc-minimal4``);
* ``LD_PRELOAD`` is empty (what the user preloads, an allocator or a sanitizer, is theirs);
* ``GDPO_MALLOC`` is unset. ``GDPO_MALLOC=system`` keeps glibc's allocator; the restart sets it
  to ``tcmalloc``, so that a loader that drops ``LD_PRELOAD`` (a setuid or setcap python)
  cannot cause a second restart.

Programs call it first thing, before torch is imported (``gdpo-train``, ``python -m
gdpo_megatron``, ``python -m gdpo_megatron.demo``); their ``main`` functions, which tests
call in-process, do not.
"""
from __future__ import annotations

import ctypes.util
import os
import sys

from gdpo_megatron.device import nvidia_driver

CHOICE_ENV = "GDPO_MALLOC"
TCMALLOC = "tcmalloc_minimal"


def tcmalloc_library() -> str | None:
    """The tcmalloc shared library's name as the dynamic loader finds it, or None."""
    return ctypes.util.find_library(TCMALLOC)


def preload_env(environ: dict[str, str], library: str) -> dict[str, str]:
    """``environ`` with ``library`` first in ``LD_PRELOAD`` (what was there stays after it)."""
    preload = " ".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    return {**environ, "LD_PRELOAD": preload}


def wants_tcmalloc(environ=os.environ) -> str | None:
    """The library to preload into this process, or None when it keeps its allocator."""
    if environ.get(CHOICE_ENV, "").strip() or environ.get("LD_PRELOAD", "").strip():
        return None
    if nvidia_driver() is not None:
        return None
    return tcmalloc_library()


def reexec_with_tcmalloc() -> None:
    """Replace this process by itself with tcmalloc preloaded, when :func:`wants_tcmalloc` says so.

    Returns only when nothing is to be done; the new image returns at once.
    """
    library = wants_tcmalloc()
    if library is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**preload_env(dict(os.environ), library), CHOICE_ENV: "tcmalloc"}
    os.execve(sys.executable, sys.orig_argv, env)
