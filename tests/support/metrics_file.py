"""A run's ``metrics.jsonl`` as the tests read it: records of a run that has ended, the steps
of one still writing (or killed while writing) its next record, and a record's computed
figures without its wall-clock ones."""
from __future__ import annotations

import json
import re
from pathlib import Path

WALL_CLOCK = re.compile(r"^(time|throughput)(/|$)")  # time and throughput figures: no two runs share them


def records(run_dir: str | Path) -> list[dict]:
    """Every record of a run that has ended; a line that is not a whole record fails the test."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def steps_so_far(run_dir: str | Path) -> list[int]:
    """The steps of the whole records of a run that may still be writing its next one, in the
    order written (a restart repeats some); none before the file exists."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    *whole, _being_written = path.read_text().split("\n")
    return [json.loads(line)["step"] for line in whole]


def computed(record: dict) -> dict:
    """``record`` without its wall-clock figures."""
    return {k: v for k, v in record.items() if not WALL_CLOCK.match(k)}
