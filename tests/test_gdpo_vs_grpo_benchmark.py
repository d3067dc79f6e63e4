"""A 2-seed, 2-step run of benchmarks/gdpo_vs_grpo.py: every stage, real trainer runs."""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from gdpo_megatron.config.advantage import MODES
from gdpo_megatron.metrics import read_metrics

pytestmark = pytest.mark.slow

REWARD_KEYS = {"tool_format": "mean", "tool_exact": "mean", "length": "gated_mean"}


def test_smoke_run_reports_what_the_runs_logged(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "benchmarks/gdpo_vs_grpo.py", "--seeds", "2", "--steps", "2", "--tail", "2",
           "--jobs", "2", "--mechanism-seeds", "3", "--mechanism-steps", "5", "--census-prompts", "4",
           "--base-steps", "20", "--out", str(out), "--set", f"base_model={tmp_path / 'base'}",
           "data.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=48"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())

    for seed in range(2):
        firsts = [read_metrics(out / f"{mode}_seed{seed}")[0] for mode in MODES]
        # one seed index: the same base model, prompts and sampling seed, so the same first rollouts
        assert len({(r["rollout/tokens_generated"], r["reward/tool_format/mean"]) for r in firsts}) == 1
    for mode in MODES:
        for seed in range(2):
            records = read_metrics(out / f"{mode}_seed{seed}")
            assert [r["step"] for r in records] == [1, 2]
            for name, stat in REWARD_KEYS.items():
                expected = statistics.fmean(r[f"reward/{name}/{stat}"] for r in records)
                assert summary["finals"][mode][name][seed] == pytest.approx(expected)
    for other in MODES[1:]:
        for name, test in summary["tests"][other].items():
            diffs = [a - b for a, b in zip(summary["finals"]["gdpo"][name], summary["finals"][other][name])]
            assert test["diff"] == pytest.approx(statistics.fmean(diffs))
            assert math.isnan(test["p"]) or 0 <= test["p"] <= 1

    census = summary["census"]
    assert census["groups"] == 4 and census["group_size"] == 4
    assert all(0 <= share <= 1 for share in census["merged_share"].values())
    assert census["distinct_per_group"]["grpo"] == pytest.approx(census["distinct_per_group"]["grpo_no_std"])
    report = (out / "report.md").read_text()
    for heading in ("Mechanism", "Collapse census", "Training", "paired t-test", "Steps until tool_exact"):
        assert heading in report
    for png in ("rewards.png", "diagnostics.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Finished runs are reused, so runs of other settings must not land in the same directory.
    again = subprocess.run([*cmd[:5], "3", *cmd[6:]], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "holds runs of other settings" in again.stderr
