"""What every console command shares: argument parsing, and one line per user error.

Commands wrapped in :func:`console_entry` print a :class:`~gdpo_megatron.errors.UserError` as
one line per mistake, ``error: <message>``, on rank 0 only (every rank of a torchrun or srun job meets the
same error), and exit with :data:`EXIT_USER_ERROR`. Any other exception is a bug and keeps its
traceback. ``--debug`` (or ``GDPO_DEBUG=1``) prints the traceback of a user error too, on
every rank.

Exit statuses of the console commands:

====  ==========================================================================
0     success
1     a bug: an unexpected exception, with its traceback (Python's own status); ``gdpo-plan``:
      the layout does not fit; ``gdpo-doctor``: a mismatch
2     a user error (:data:`EXIT_USER_ERROR`)
69    ``gdpo-train`` lost a peer rank: its host died or stopped answering (one line says which)
75    ``gdpo-train`` stopped by SIGUSR1/SIGTERM after saving a checkpoint, or without saving past
      ``checkpoint.stop_timeout_s`` after SIGTERM (requeue it: it resumes from the last one)
130   stopped by Ctrl-C (``gdpo-train``: after saving a checkpoint, unless pressed twice or before any step)
====  ==========================================================================

Under torchrun the line also goes to torch's error file, so torchrun's closing
``ChildFailedError`` report shows it as the root cause. torchrun stops every worker as soon as
one exits non-zero, so ranks other than 0 wait up to :data:`TORCHRUN_GRACE_S` before they
exit: rank 0, which meets the same error, prints the line and is the report's root cause.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from typing import Callable, Optional, Sequence

from gdpo_megatron.errors import UsageError, UserError

EXIT_USER_ERROR = 2
EXIT_CTRL_C = 130  # 128 + SIGINT, as a shell reports it
DEBUG_ENV = "GDPO_DEBUG"
DEBUG_FLAG = "--debug"
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each worker
TORCHRUN_GRACE_S = 30.0


class ArgumentParser(argparse.ArgumentParser):
    """argparse with ``--debug`` and usage errors raised as :class:`UsageError` (one line, status 2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument(DEBUG_FLAG, action="store_true",
                          help=f"show the traceback of a user error too (or set {DEBUG_ENV}=1)")

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def console_entry(main: Callable[[list[str]], Optional[int]]) -> Callable[[Optional[Sequence[str]]], int]:
    """Wrap ``main(argv) -> status``: a :class:`UserError` becomes one line and :data:`EXIT_USER_ERROR`."""

    @functools.wraps(main)
    def entry(argv: Optional[Sequence[str]] = None) -> int:
        argv = sys.argv[1:] if argv is None else list(argv)
        try:
            return main(argv) or 0
        except UserError as e:
            report(e, debug=DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0"))
            return EXIT_USER_ERROR
        except KeyboardInterrupt:
            say("interrupted (Ctrl-C)")
            return EXIT_CTRL_C

    return entry


def report(error: UserError, debug: bool = False) -> None:
    """Print ``error: <message>`` for each of its mistakes on rank 0 (the traceback too, on every
    rank, with ``debug``)."""
    lines = [f"error: {line}" for line in error.lines()]  # one line each, whatever the messages hold
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    rank = launch_rank()
    if rank == 0:
        print("\n".join(lines), file=sys.stderr, flush=True)
    line = "\n".join(lines)
    error_file = os.environ.get(TORCHELASTIC_ERROR_FILE)
    if error_file:
        if rank != 0:
            time.sleep(TORCHRUN_GRACE_S)  # torchrun ends this process once rank 0 has reported
        # The format of torch.distributed.elastic's ErrorHandler.record_exception, with the line
        # in place of the traceback (which the report shows).
        stamp = str(int(time.time()))
        try:
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": stamp}}}, f)
        except OSError:
            pass  # the report then points to torch's docs instead; the line above was printed


def say(line: str) -> None:
    """One line on stderr, from rank 0 only (every rank of a job runs the same code)."""
    if launch_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def launch_rank() -> int:
    """This process's rank: torch.distributed's if started, else the launcher's (torchrun, then srun)."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    for name in ("RANK", "SLURM_PROCID"):  # the order of gdpo_megatron.distributed.launch
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


def quiet_defaults() -> None:
    """Terse library logs: vLLM's at WARNING, and known harmless messages filtered
    (:mod:`gdpo_megatron.quiet`). (Threads: each rank uses its share of the host's cores, see
    :mod:`gdpo_megatron.distributed.threads`; ``OMP_NUM_THREADS`` overrides it.)"""
    from gdpo_megatron import quiet

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    quiet.install()
