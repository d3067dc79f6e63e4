"""What a run directory holds, and the summary a finished or stopped run prints of it."""
from __future__ import annotations

from pathlib import Path

CHECKPOINT_DIR = "checkpoints"  # training checkpoints, step_N/ and a `latest` pointer
HF_EXPORT_DIR = "hf"  # the policy as a Hugging Face directory, written at the end
# A reward that failed on more than this share of its calls over a run gets a warning: its
# scores were mostly its failure value, not a judgment of the completions.
MOSTLY_FAILED = 0.5


def summary(run_dir: str | Path, reward_names: list[str], plots: list[Path] = ()) -> str:
    """Each reward's mean over the first and the last three steps, its failures over the run
    (a warning for each reward that failed on more than :data:`MOSTLY_FAILED` of its calls), and
    where the newest checkpoint, the Hugging Face export, the metrics and the plots are."""
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
        lines += _failures(records, reward_names)
    steps = complete_steps(run_dir / CHECKPOINT_DIR)
    if steps:
        lines.append(f"checkpoint: {step_dir(run_dir / CHECKPOINT_DIR, steps[-1])}")
    if (run_dir / HF_EXPORT_DIR).is_dir():
        lines.append(f"Hugging Face export: {run_dir / HF_EXPORT_DIR}")
    lines.append(f"metrics: {run_dir / METRICS_FILE}")
    lines += [f"plot: {png}" for png in plots]
    return "\n".join(lines)


def _failures(records: list[dict], reward_names: list[str]) -> list[str]:
    """Each failing reward's failures and timeouts out of its calls over ``records``, then a
    warning line for each that mostly failed; one line when none failed."""
    calls = sum(r.get("rollout/count", 0) for r in records)
    counts = {name: [sum(r.get(f"reward/{name}/{kind}", 0) for r in records) for kind in ("failures", "timeouts")]
              for name in reward_names}
    failing = {name: c for name, c in counts.items() if c[0]}
    if not failing:
        return [f"reward failures: none in {calls:.0f} calls of each reward"]
    lines = [f"reward failures, of {calls:.0f} calls each:"]
    mostly = []
    for name, (failures, timeouts) in failing.items():
        share = failures / calls if calls else 1.0
        lines.append(f"  {name:<20} {failures:8.0f} ({share:.0%}), {timeouts:.0f} timed out")
        if share > MOSTLY_FAILED:
            mostly.append(f"warning: reward {name} failed on {share:.0%} of its calls: its scores were mostly its "
                          "failure value, not a judgment of the completions; the log names each step's first "
                          "failure of it")
    return lines + mostly
