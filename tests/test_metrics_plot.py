"""Run metrics (JSONL, optional wandb offline) and the gdpo-plot PNGs."""
import json

import pytest

from gdpo_megatron.commands.plot import main as plot_main
from gdpo_megatron.errors import InputError
from gdpo_megatron.metrics import METRICS_FILE, MetricsLogger, read_metrics
from gdpo_megatron.plot import plot_runs, reward_names

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, slope, steps=6):
    logger = MetricsLogger(run_dir, config={"advantage": {"mode": "gdpo"}})
    for step in range(1, steps + 1):
        logger.log(step, {
            "reward/format/mean": min(1.0, 0.5 + slope * step),
            "reward/correct/mean": slope * step,
            "reward/format/zero_spread_frac": 0.5,
            "reward/correct/zero_spread_frac": 0.25,
            "advantage/distinct_per_group": 3.0,
        })
    logger.close()


def test_a_resumed_run_drops_the_records_after_its_checkpoint_and_a_torn_last_line(tmp_path):
    _write_run(tmp_path, 0.1, steps=4)
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 9, "reward/for')  # the process died mid-write
    logger = MetricsLogger(tmp_path, config={}, start_step=2)  # resumed from the checkpoint of step 2
    logger.log(3, {"reward/format/mean": 0.0})
    logger.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # in the file itself, each step once
    records = read_metrics(tmp_path)
    assert records[2]["reward/format/mean"] == 0.0
    assert records[1]["reward/format/mean"] == pytest.approx(0.7)


def test_reading_keeps_the_last_record_of_a_step_and_skips_a_torn_last_line(tmp_path):
    _write_run(tmp_path, 0.1, steps=2)
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write(json.dumps({"step": 2, "reward/format/mean": 0.0}) + '\n{"step": 9, "reward/for')
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and records[1]["reward/format/mean"] == 0.0


def test_corrupt_line_in_the_middle_names_the_line(tmp_path):
    _write_run(tmp_path, 0.1, steps=2)
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    (tmp_path / METRICS_FILE).write_text("\n".join([lines[0], "{oops", lines[1]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(tmp_path)
    with pytest.raises(InputError, match="no metrics file"):
        read_metrics(tmp_path / "elsewhere")


def test_plot_overlays_runs(tmp_path):
    _write_run(tmp_path / "gdpo", 0.1)
    _write_run(tmp_path / "grpo", 0.05)
    assert reward_names(read_metrics(tmp_path / "gdpo")) == ["format", "correct"]
    paths = plot_runs([tmp_path / "gdpo", tmp_path / "grpo"], tmp_path / "plots")
    assert [p.name for p in paths] == ["rewards.png", "diagnostics.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 10_000
    assert not list((tmp_path / "plots").glob("*.tmp.png"))
    with pytest.raises(ValueError, match="labels: expected 2 labels, got 1"):
        plot_runs([tmp_path / "gdpo", tmp_path / "grpo"], tmp_path / "plots", labels=["x"])


def test_plot_cli_writes_into_the_first_run(tmp_path, capsys):
    _write_run(tmp_path / "a", 0.1)
    assert plot_main([str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "rewards.png").is_file()
    assert "rewards.png" in capsys.readouterr().out


def test_plot_cli_passes_labels_and_smoothing_through(tmp_path, capsys):
    for name, slope in [("s0", 0.1), ("s1", 0.05)]:
        _write_run(tmp_path / name, slope)
    runs = [str(tmp_path / "s0"), str(tmp_path / "s1")]
    assert plot_main([*runs, "--labels", "gdpo", "gdpo", "--smooth", "3", "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "rewards.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()
    assert plot_main([*runs, "--smooth", "0", "--out", str(tmp_path / "plots")]) == 2
    assert capsys.readouterr().err.strip() == "error: smooth: expected a window of >= 1 steps, got 0"


def test_wandb_offline_run_gets_the_same_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, config={"seed": 1}, wandb_project="gdpo-test", run_name="t")
    logger.log(1, {"reward/format/mean": 0.25})
    logger.close()
    assert json.loads((tmp_path / METRICS_FILE).read_text())["reward/format/mean"] == 0.25
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_runs_sharing_a_label_are_drawn_as_mean_with_a_min_max_band(tmp_path):
    import matplotlib.pyplot as plt

    from gdpo_megatron.plot import _draw

    for name, slope, steps in [("s0", 0.1, 6), ("s1", 0.05, 6), ("s2", 0.02, 4)]:
        _write_run(tmp_path / name, slope, steps=steps)
    runs = [read_metrics(tmp_path / n) for n in ("s0", "s1", "s2")]
    fig, ax = plt.subplots()
    _draw(ax, "gdpo", runs, "reward/correct/mean", smooth=1)
    (line,) = ax.lines
    assert line.get_label() == "gdpo (mean of 3)"
    assert list(line.get_xdata()) == [1, 2, 3, 4]  # the steps every run reached
    assert list(line.get_ydata()) == pytest.approx([0.17 * s / 3 for s in range(1, 5)])
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(0.02) and max(ys) == pytest.approx(0.4)  # s2 at step 1, s0 at step 4
    ax.clear()
    _draw(ax, "grpo", runs[:1], "reward/correct/mean", smooth=2)  # one run: a plain line, trailing mean
    assert list(ax.lines[0].get_ydata()) == pytest.approx([0.1, 0.15, 0.25, 0.35, 0.45, 0.55])
    assert not ax.collections
    plt.close(fig)
    paths = plot_runs([tmp_path / n for n in ("s0", "s1", "s2")], tmp_path / "plots", labels=["gdpo"] * 3, smooth=3)
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)
    with pytest.raises(ValueError, match="smooth: expected a window of >= 1 steps, got 0"):
        plot_runs([tmp_path / "s0"], tmp_path / "plots", smooth=0)
