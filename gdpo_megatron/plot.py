"""PNG plots of one or more runs: each reward's mean per step, and advantage diagnostics.

``gdpo-plot RUN_DIR [RUN_DIR ...] --out DIR`` overlays the runs (e.g. GDPO vs GRPO) with a
legend naming each run.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gdpo_megatron.errors import InputError, UsageError  # noqa: E402
from gdpo_megatron.metrics import read_metrics  # noqa: E402


def reward_names(records: list[dict]) -> list[str]:
    """Reward names found as ``reward/<name>/mean`` keys, in first-seen order."""
    names: dict[str, None] = {}
    for record in records:
        for key in record:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean":
                names[parts[1]] = None
    return list(names)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            steps.append(r["step"])
            values.append(v)
    return steps, values


def _grid(n: int, title: str):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    fig.suptitle(title)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path, labels: list[str] | None = None) -> list[Path]:
    """Write ``rewards.png`` and ``diagnostics.png`` to ``out_dir``; return their paths."""
    if not run_dirs:
        raise UsageError("run_dirs: expected at least one run directory")
    labels = labels or [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise UsageError(f"labels: expected {len(run_dirs)} labels, got {len(labels)}")
    runs = [(label, read_metrics(d)) for label, d in zip(labels, run_dirs)]
    names = list(dict.fromkeys(n for _, records in runs for n in reward_names(records)))
    if not names:
        raise InputError(f"{run_dirs[0]}: no reward/<name>/mean metrics to plot")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, axes = _grid(len(names), "Reward means per step")
    for ax, name in zip(axes, names):
        for label, records in runs:
            ax.plot(*_series(records, f"reward/{name}/mean"), label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    rewards_png = out_dir / "rewards.png"
    _save(fig, rewards_png)

    fig, axes = _grid(len(names) + 1, "Advantage diagnostics")
    for ax, name in zip(axes, names):
        for label, records in runs:
            ax.plot(*_series(records, f"reward/{name}/zero_spread_frac"), label=label)
        ax.set_title(f"{name}: groups with zero spread")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for label, records in runs:
        ax.plot(*_series(records, "advantage/distinct_per_group"), label=label)
    ax.set_title("distinct advantage values per group")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    diagnostics_png = out_dir / "diagnostics.png"
    _save(fig, diagnostics_png)
    return [rewards_png, diagnostics_png]


def _save(fig, path: Path) -> None:
    """Write next to the target and rename, so a reader never sees half a PNG."""
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
