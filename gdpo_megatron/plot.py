"""PNG plots of one or more runs: each reward's mean per step, and advantage diagnostics.

``gdpo-plot RUN_DIR [RUN_DIR ...] --out DIR`` overlays the runs (e.g. GDPO vs GRPO) with a
legend naming each run. Runs given the same label (several seeds of one setting) are drawn
as one line, their mean at each step they all reached, with a band from their minimum to
their maximum.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gdpo_megatron.errors import InputError, UsageError  # noqa: E402
from gdpo_megatron.metrics import read_metrics  # noqa: E402

REWARDS_PNG, DIAGNOSTICS_PNG = "rewards.png", "diagnostics.png"


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


def _smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _draw(ax, label: str, runs: list[list[dict]], key: str, smooth: int) -> None:
    """One run as a line; several as their mean with a min-max band, over their common steps."""
    series = [_series(records, key) for records in runs]
    series = [dict(zip(steps, _smoothed(values, smooth))) for steps, values in series if steps]
    if not series:
        return
    steps = sorted(set(series[0]).intersection(*series[1:]))
    if len(series) == 1:
        ax.plot(steps, [series[0][s] for s in steps], label=label)
        return
    columns = [[run[s] for run in series] for s in steps]
    (line,) = ax.plot(steps, [sum(c) / len(c) for c in columns], label=f"{label} (mean of {len(series)})")
    ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(),
                    alpha=0.2, linewidth=0)


def _grid(n: int, title: str):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    fig.suptitle(title)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path, labels: list[str] | None = None,
              smooth: int = 1) -> list[Path]:
    """Write :data:`REWARDS_PNG` and :data:`DIAGNOSTICS_PNG` to ``out_dir``; return their paths.

    Runs sharing a label are drawn as their mean with a min-max band; ``smooth`` > 1 draws
    each run's trailing mean over that many steps.
    """
    if not run_dirs:
        raise UsageError("run_dirs: expected at least one run directory")
    labels = labels or [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise UsageError(f"labels: expected {len(run_dirs)} labels, got {len(labels)}")
    if smooth < 1:
        raise UsageError(f"smooth: expected a window of >= 1 steps, got {smooth}")
    runs: dict[str, list[list[dict]]] = {}
    for label, d in zip(labels, run_dirs):
        runs.setdefault(label, []).append(read_metrics(d))
    names = list(dict.fromkeys(n for group in runs.values() for records in group for n in reward_names(records)))
    if not names:
        raise InputError(f"{run_dirs[0]}: no reward/<name>/mean metrics to plot")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    per_step = "per step" if smooth == 1 else f"per step (trailing mean of {smooth})"
    fig, axes = _grid(len(names), f"Reward means {per_step}")
    for ax, name in zip(axes, names):
        # A gated reward is drawn as the advantages saw it (0 where its gate failed).
        gated = any(f"reward/{name}/gated_mean" in r for group in runs.values() for records in group for r in records)
        for label, group in runs.items():
            _draw(ax, label, group, f"reward/{name}/{'gated_mean' if gated else 'mean'}", smooth)
        ax.set_title(f"{name} (gated)" if gated else name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    rewards_png = out_dir / REWARDS_PNG
    _save(fig, rewards_png)

    fig, axes = _grid(len(names) + 1, f"Advantage diagnostics {per_step}")
    for ax, name in zip(axes, names):
        for label, group in runs.items():
            _draw(ax, label, group, f"reward/{name}/zero_spread_frac", smooth)
        ax.set_title(f"{name}: groups with zero spread")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for label, group in runs.items():
        _draw(ax, label, group, "advantage/distinct_per_group", smooth)
    ax.set_title("distinct advantage values per group")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    diagnostics_png = out_dir / DIAGNOSTICS_PNG
    _save(fig, diagnostics_png)
    return [rewards_png, diagnostics_png]


def _save(fig, path: Path) -> None:
    """Write next to the target and rename, so a reader never sees half a PNG."""
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
