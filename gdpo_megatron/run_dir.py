"""What a run directory holds, and the summary a finished or stopped run prints of it."""
from __future__ import annotations

from pathlib import Path

CHECKPOINT_DIR = "checkpoints"  # training checkpoints, step_N/ and a `latest` pointer
HF_EXPORT_DIR = "hf"  # the policy as a Hugging Face directory, written at the end


def summary(run_dir: str | Path, reward_names: list[str], plots: list[Path] = ()) -> str:
    """Each reward's mean over the first and the last three steps, and where the newest
    checkpoint, the Hugging Face export, the metrics and the plots are."""
    from gdpo_megatron.checkpoint.state import complete_steps, step_dir
    from gdpo_megatron.metrics import METRICS_FILE, read_metrics

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    lines = []
    if records:
        lines.append(f"reward means, first 3 steps -> last 3 steps (of {records[-1]['step']}):")
        for name in reward_names:
            key = f"reward/{name}/mean"
            start, end = ([r[key] for r in part if r.get(key) is not None] for part in (records[:3], records[-3:]))
            if start and end:
                lines.append(f"  {name:<20} {sum(start) / len(start):8.3f} -> {sum(end) / len(end):8.3f}")
    steps = complete_steps(run_dir / CHECKPOINT_DIR)
    if steps:
        lines.append(f"checkpoint: {step_dir(run_dir / CHECKPOINT_DIR, steps[-1])}")
    if (run_dir / HF_EXPORT_DIR).is_dir():
        lines.append(f"Hugging Face export: {run_dir / HF_EXPORT_DIR}")
    lines.append(f"metrics: {run_dir / METRICS_FILE}")
    lines += [f"plot: {png}" for png in plots]
    return "\n".join(lines)
