"""benchmarks/toolrl_cpu_comparison.py: the Holm correction, and a 2-seed, 2-step smoke run of
every stage (base model, real training runs, held-out scoring, report)."""
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys

import pytest

sys.path.insert(0, "benchmarks")
from toolrl_cpu_comparison import holm  # noqa: E402

from gdpo_megatron.data.samples import load_samples  # noqa: E402
from gdpo_megatron.config.advantage import MODES  # noqa: E402
from gdpo_megatron.metrics import read_metrics  # noqa: E402


def holm_rejects(pvalues: list[float], alpha: float) -> set[int]:
    """Holm's step-down procedure as stated: reject in increasing order of p while
    p_(k) <= alpha / (m - k), k = 0, 1, ..."""
    rejected = set()
    for k, i in enumerate(sorted(range(len(pvalues)), key=pvalues.__getitem__)):
        if pvalues[i] > alpha / (len(pvalues) - k):
            break
        rejected.add(i)
    return rejected


def test_holm_adjusted_p_values_reject_what_the_step_down_procedure_rejects():
    rng = random.Random(0)
    cases = [[0.01, 0.04, 0.03, 0.005], [0.5, 0.001, 0.02], [0.2]] + [
        [rng.random() ** 3 for _ in range(rng.randint(1, 6))] for _ in range(200)]
    for pvalues, alpha in itertools.product(cases, (0.01, 0.05, 0.1)):
        adjusted = holm(pvalues)
        assert {i for i, p in enumerate(adjusted) if p <= alpha} == holm_rejects(pvalues, alpha)
        assert all(p <= a <= 1 for p, a in zip(pvalues, adjusted))
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([math.nan, 0.01]) == pytest.approx([1.0, 0.02])


@pytest.mark.slow
def test_smoke_run_reports_what_the_runs_logged_and_scored(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "benchmarks/toolrl_cpu_comparison.py", "--seeds", "2", "--steps", "2", "--jobs", "2",
           "--limit", "3", "--base-steps", "2", "--out", str(out), "--set", f"base_model={tmp_path / 'base'}",
           f"data.train_path={tmp_path / 'base' / 'rl_prompts.json'}", "data.prompts_per_step=1",
           "rollout.group_size=4", "rollout.max_new_tokens=16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())

    for mode in MODES:
        for seed in range(2):
            records = read_metrics(out / f"{mode}_seed{seed}")
            assert [r["step"] for r in records] == [1, 2]
            scored = json.loads((out / f"{mode}_seed{seed}_eval.json").read_text())
            assert scored["eval/prompts"] == 3
            for name in ("toolrl_format", "toolrl_correctness"):
                assert summary["finals"][mode][name][seed] == scored[f"eval/{name}/mean"]
            for key in ("time/generate", "time/train"):
                assert summary["times"][mode][key] == pytest.approx(
                    statistics.fmean(r[key] for d in (out / f"{mode}_seed0", out / f"{mode}_seed1")
                                     for r in read_metrics(d)))
    tests = summary["tests"]
    assert [(t["vs"], t["endpoint"]) for t in tests] == [
        (m, n) for m in MODES[1:] for n in ("toolrl_format", "toolrl_correctness")]
    assert [t["p_holm"] for t in tests] == pytest.approx(holm([t["p"] for t in tests]))
    for t in tests:
        gdpo, other = summary["finals"]["gdpo"][t["endpoint"]], summary["finals"][t["vs"]][t["endpoint"]]
        assert t["diff"] == pytest.approx(statistics.fmean(a - b for a, b in zip(gdpo, other)))
    report = (out / "report.md").read_text()
    for heading in ("Held-out scores", "Holm", "Format collapse", "Seconds per step"):
        assert heading in report
    assert (out / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The base model probe on the same base model: 2 samples of 3 RL prompts, 3 held-out prompts greedy.
    probe = subprocess.run([sys.executable, "benchmarks/toolrl_base_probe.py", str(tmp_path / "base"), "--limit", "3",
                            "--samples", "2", "--out", str(tmp_path / "probe.json")],
                           env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    numbers = json.loads((tmp_path / "probe.json").read_text())
    answers = [s.reward_truth()["answer"] for s in load_samples(tmp_path / "base" / "rl_prompts.json", "toolrl")[:3]]
    calling = [a for a in answers if "<tool_call>" in a.split("</think>")[-1]]
    rl = numbers["RL prompts, 2 samples at temperature 1"]
    assert rl["prompts"] == 3 and rl["completions_of_calling_prompts"] == 2 * len(calling)
    assert -3 <= rl["correctness"] <= 3 and 0 <= rl["format"] <= 1
    assert numbers["held-out test prompts, greedy"]["prompts"] == 3
