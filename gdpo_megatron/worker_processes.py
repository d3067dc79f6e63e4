"""The forkserver a rank's worker processes are forked from: reward workers and environment workers.

One server per process (multiprocessing's "forkserver" context), preloading
:mod:`gdpo_megatron.rewards` (which imports the environments): a worker starts in milliseconds
and never inherits the rank's threads, CUDA context or engine.

:func:`start_ignoring` starts the server with the given signals ignored. The server keeps that
disposition across its ``exec`` and every worker forked from it inherits it, so only the rank
acts on the signals Slurm sends every process of a job step (and on a terminal's Ctrl-C, sent
to the whole process group). The rank ignores them only while the server process is spawned
(milliseconds), not while the workers start; a signal that arrives in that instant is lost.
Call it before anything else uses the context: once the server runs, it is not started again.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Iterable
from multiprocessing import forkserver

PRELOAD = ["gdpo_megatron.rewards"]


def context():
    """The forkserver context, with this package's preload."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_ignoring(signals: Iterable[signal.Signals]) -> None:
    """Start the server now (if it is not running) with ``signals`` ignored in it and its workers."""
    context()
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        forkserver.ensure_running()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
