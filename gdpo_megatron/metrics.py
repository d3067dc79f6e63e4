"""Per-step metrics: a JSONL file in the run directory always, wandb when enabled.

Each line is ``{"step": N, "time": unix_seconds, <metric>: value, ...}``, written and flushed
as soon as the step ends, so a crash loses at most the step in flight. A resumed run first drops
the records of steps after its checkpoint, then appends: every step has one record.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from gdpo_megatron.errors import InputError

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Writes step metrics of rank 0 to ``run_dir/metrics.jsonl`` and optionally wandb."""

    def __init__(self, run_dir: str | Path, config: dict, wandb_project: str | None = None,
                 run_name: str | None = None, start_step: int = 0):
        """``start_step``: the step the run starts after (its checkpoint's); records of later
        steps, from a run that went on past its last checkpoint, are dropped first."""
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            self._keep_until(start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._wandb = None
        if wandb_project:
            import wandb  # the `wandb` extra; offline unless WANDB_MODE says otherwise

            # One wandb run per run directory: a resumed or requeued job continues it.
            run_id = hashlib.sha1(str(self.path.parent.resolve()).encode()).hexdigest()[:16]
            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config,
                                     dir=str(self.path.parent), id=run_id, resume="allow")

    def _keep_until(self, step: int) -> None:
        """Rewrite the file (under a temporary name, then renamed) without records past ``step``."""
        kept = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time()}
        record.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of a run, ordered by step; the last record of a repeated step wins.

    A truncated last line (the process died while writing it) is skipped.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise InputError(f"{path}: no metrics file (is {run_dir} a run directory?)")
    by_step: dict[int, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 ({e})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise InputError(f"{path}:{number}: not a JSON record: {e}") from e
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise InputError(f"{path}:{number}: expected a JSON object with an integer 'step', got "
                             f"{line.strip()[:60]!r}")
        by_step[step] = record
    return [by_step[s] for s in sorted(by_step)]


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or infinity
    return value
