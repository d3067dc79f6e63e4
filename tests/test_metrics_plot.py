"""Run metrics (JSONL, optional wandb offline) and the gdpo-plot PNGs."""
import json

import pytest

from gdpo_megatron.cli import plot_main
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


def test_resumed_run_keeps_last_record_per_step_and_skips_a_torn_last_line(tmp_path):
    _write_run(tmp_path, 0.1, steps=4)
    logger = MetricsLogger(tmp_path, config={})  # a resume from step 2 appends
    logger.log(3, {"reward/format/mean": 0.0})
    logger.close()
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 9, "reward/for')  # the process died mid-write
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["reward/format/mean"] == 0.0
    assert records[1]["reward/format/mean"] == pytest.approx(0.7)


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
