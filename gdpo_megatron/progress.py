"""Training progress on stderr: tqdm's bar on a terminal, plain lines in a log file.

tqdm redraws its bar with carriage returns, which a terminal overwrites in place but a file
(a Slurm job's log, ``2> train.log``) keeps: one line of every redraw, kilobytes long. When
stderr is not a terminal, progress is instead a plain line after the first step, the last
step, and any step that ends at least :data:`LINE_EVERY_S` seconds after the previous line,
so that a log grows by a bounded number of lines however fast the steps are::

    gdpo-train: step 12/100, 31.2 s/step, about 45:45 left; distinct_chars 0.41, vowel_share 0.22
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

LINE_EVERY_S = 60.0


class Progress:
    """Progress of steps ``start + 1 .. total`` (``enabled``: shown at all, e.g. on rank 0 only)."""

    def __init__(self, start: int, total: int, desc: str, enabled: bool):
        self.start, self.total = start, total
        self.bar = tqdm(desc=desc, initial=start, total=total) if enabled and sys.stderr.isatty() else None
        self.lines = enabled and self.bar is None
        self.began = self.last_line = time.monotonic()

    def step_done(self, step: int, rewards: dict[str, float]) -> None:
        """Step ``step`` (1-based) ended with these reward means."""
        if self.bar is not None:
            self.bar.set_postfix({name: f"{mean:.2f}" for name, mean in rewards.items()}, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if not self.lines or not (step == self.start + 1 or step == self.total or now - self.last_line >= LINE_EVERY_S):
            return
        self.last_line = now
        per_step = (now - self.began) / (step - self.start)
        left = int(per_step * (self.total - step))
        eta = f", about {left // 60}:{left % 60:02d} left" if step < self.total else ""
        means = ", ".join(f"{name} {mean:.2f}" for name, mean in rewards.items())
        print(f"gdpo-train: step {step}/{self.total}, {per_step:.1f} s/step{eta}; {means}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
