"""What a sandboxed run is given (its limits), what it gives back, and the sandbox's own failure."""
from __future__ import annotations

import signal
from dataclasses import dataclass


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): bubblewrap, the interpreter or a limit
    could not be set up, or no isolation level works here. The run has no result."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20  # per written file, stdout and stderr included
    processes: int = 32
    disk_bytes: int = 64 << 20  # the working directory's size, and /dev/shm's (where the run has its own)

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_bytes", "output_bytes", "processes", "disk_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limits: {name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RunResult:
    returncode: int | None  # negative: killed by that signal; None: killed at the wall timeout
    stdout: str
    stderr: str
    timed_out: bool  # wall-clock or CPU time limit reached
    output_limited: bool  # a write went past ``output_bytes``
    memory_limited: bool = False  # killed for going past the run's memory bound

    @property
    def ok(self) -> bool:
        """The program ran to the end without an error."""
        return self.returncode == 0 and not (self.timed_out or self.output_limited or self.memory_limited)

    @property
    def refused(self) -> str | None:
        """What the sandbox refused the program (it was killed for it), or ``None``."""
        if self.returncode == -signal.SIGSYS:
            return "the program made a system call of another architecture, which the sandbox refuses (SIGSYS)"
        return None
