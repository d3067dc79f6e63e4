"""GDPO vs GRPO vs GRPO without std on ToolRL's task on a CPU, registered before it was run.

    python benchmarks/toolrl_cpu_comparison.py [--seeds 6] [--steps 60] [--jobs 2]
                                               [--out runs/toolrl_cpu_comparison]

The registration (docs/benchmarks.md, "ToolRL on the CPU: GDPO vs GRPO, registered"):

- Task: ``configs/toolrl_cpu.yaml`` from the base model ``make runs/toolrl_base`` writes
  (one base model, warm-up seed 0, for every run); RL on its ``rl_prompts.json``; each run's
  export scored on ToolRL's 80 held-out test prompts by ``gdpo-eval`` with
  ``gdpo_megatron.demo.toolrl_cpu.EVAL_ARGS`` (greedy, 256 new tokens).
- Arms: ``advantage.mode`` gdpo, grpo, grpo_no_std, all else equal. Seed index s runs every
  arm with ``seed=s data.shuffle_seed=s``: the same prompt order and sampling seed, so the
  arms share their first rollouts and are compared in pairs.
- Seeds: ``SEEDS`` = 6 per arm, 18 runs of ``STEPS`` = 60 steps.
- Endpoints: held-out ``toolrl_correctness`` mean and held-out ``toolrl_format`` mean of
  the final export.
- Test: two-sided paired t-test over the seed indices, GDPO against each other arm, on both
  endpoints: 4 tests, Holm-Bonferroni at a family-wise alpha of 0.05. The report also counts
  the seeds each arm wins.
- Format collapse (the paper's signature of a failed multi-reward run, the format reward
  lost, made operational here), descriptive, no test: a run collapses when
  its training ``toolrl_format`` trailing mean over ``SMOOTH`` steps ends below half of its
  peak and the peak is at least ``COLLAPSE_PEAK``; counted per arm, with the held-out
  format score of the collapsed runs.
- Also descriptive: the training curves with min-max seed bands (``gdpo-plot``'s plots),
  and the step time split into generation, rewards, update and weight sync.

Finished runs in ``--out`` are reused; ``--out`` holds runs of one set of settings only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gdpo_vs_grpo import _cell, _p, interval, paired, reuse_only_same_runs, train

from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.config.advantage import MODES
from gdpo_megatron.demo.toolrl_cpu import CONFIG, REWARDS, score
from gdpo_megatron.metrics import read_metrics
from gdpo_megatron.plot import plot_runs

SEEDS = 6
STEPS = 60
ALPHA = 0.05
SMOOTH = 5
COLLAPSE_PEAK = 0.2
TIMES = ("time/generate", "time/reward", "time/train", "time/sync", "time/step")


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the given order (NaN counts as 1)."""
    p = [1.0 if math.isnan(x) else x for x in pvalues]
    order = sorted(range(len(p)), key=p.__getitem__)
    adjusted, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def trailing(values: list[float]) -> list[float]:
    return [statistics.fmean(values[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(values))]


def collapsed(records: list[dict]) -> bool:
    """The registered format-collapse signature on one run's training records."""
    curve = trailing([r["reward/toolrl_format/mean"] for r in records])
    peak = max(curve)
    return peak >= COLLAPSE_PEAK and curve[-1] < peak / 2


def held_out(run_dir: Path, limit: int | None) -> dict[str, float]:
    """The run's export scored on the held-out prompts (reused when scored before)."""
    out = run_dir.parent / f"{run_dir.name}_eval.json"
    if out.is_file():
        return json.loads(out.read_text())
    return score(run_dir / "hf", out, () if limit is None else ("--limit", str(limit)))


def report(runs: dict[str, list[Path]], scores: dict[str, list[dict]], base: dict, steps: int) -> tuple[list[str], dict]:
    seeds = len(runs["gdpo"])
    finals = {m: {n: [s[f"eval/{n}/mean"] for s in scores[m]] for n in REWARDS} for m in MODES}
    lines = [f"Held-out scores ({base['eval/prompts']:.0f} test prompts, greedy) after {steps} steps, "
             f"{seeds} seeds per arm: mean ± 95% t interval", "",
             "| arm | " + " | ".join(REWARDS) + " |", "|---|" + "---|" * len(REWARDS),
             "| base model | " + " | ".join(f"{base[f'eval/{n}/mean']:.3f}" for n in REWARDS) + " |"]
    for m in MODES:
        lines.append(f"| {m} | " + " | ".join(_cell(*interval(finals[m][n])) for n in REWARDS) + " |")
    tests = [(other, n, paired(finals["gdpo"][n], finals[other][n])) for other in MODES[1:] for n in REWARDS]
    adjusted = holm([t["p"] for _, _, t in tests])
    lines += ["", f"GDPO minus each arm, paired by seed index (two-sided paired t-test; Holm over the {len(tests)} "
              f"tests, family-wise alpha {ALPHA}):", "",
              "| vs | endpoint | difference | p | Holm p | GDPO higher | significant |", "|---|---|---|---|---|---|---|"]
    for (other, n, t), p_holm in zip(tests, adjusted):
        t["p_holm"] = p_holm
        lines.append(f"| {other} | {n} | {_cell(t['diff'], t['half'])} | {_p(t['p'])} | {_p(p_holm)} | "
                     f"{t['wins']}/{t['pairs']} | {'yes' if p_holm < ALPHA else 'no'} |")
    records = {m: [read_metrics(d) for d in runs[m]] for m in MODES}
    collapses = {m: [collapsed(r) for r in records[m]] for m in MODES}
    lines += ["", f"Format collapse (training format reward's trailing mean over {SMOOTH} steps ends below half its "
              f"peak, peak >= {COLLAPSE_PEAK}):", ""]
    for m in MODES:
        fmt = [s for s, c in zip(finals[m]["toolrl_format"], collapses[m]) if c]
        lines.append(f"- {m}: {sum(collapses[m])}/{seeds} runs" +
                     (f", held-out format of those {statistics.fmean(fmt):.3f}" if fmt else ""))
    times = {m: {k: statistics.fmean(r[k] for rec in records[m] for r in rec if k in r) for k in TIMES} for m in MODES}
    lines += ["", "Seconds per step (mean over steps and seeds):", "",
              "| arm | " + " | ".join(TIMES) + " |", "|---|" + "---|" * len(TIMES)]
    for m in MODES:
        lines.append(f"| {m} | " + " | ".join(f"{times[m][k]:.2f}" for k in TIMES) + " |")
    summary = {"finals": finals, "base": base, "tests": [{"vs": o, "endpoint": n, **t} for o, n, t in tests],
               "collapses": collapses, "times": times, "seeds": seeds, "steps": steps}
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--jobs", type=int, default=2, help="training runs at a time (one thread each)")
    parser.add_argument("--limit", type=int, default=None, help="score only this many held-out prompts (smoke runs)")
    parser.add_argument("--base-steps", type=int, default=None, help="warm-up steps of a base model built here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    parser.add_argument("--out", default="runs/toolrl_cpu_comparison")
    args = parser.parse_args(argv)
    config = load_config(TrainConfig, CONFIG, args.set)
    out = Path(args.out)
    reuse_only_same_runs(out, {"steps": args.steps, "set": args.set, "limit": args.limit})
    started, load = time.time(), os.getloadavg()[0]
    if not Path(config.base_model, "config.json").is_file():
        from gdpo_megatron.demo.toolrl_base import make_toolrl_base

        print(f"writing the base model to {config.base_model}", flush=True)
        make_toolrl_base(config.base_model, **({} if args.base_steps is None else {"steps": args.base_steps}))
    limit = () if args.limit is None else ("--limit", str(args.limit))
    base_file = out / "base_eval.json"
    base = json.loads(base_file.read_text()) if base_file.is_file() else score(config.base_model, base_file, limit)

    def run(job: tuple[str, int]) -> tuple[Path, dict]:
        mode, seed = job
        run_dir = train(mode, seed, args.steps, out / f"{mode}_seed{seed}", args.set, CONFIG)
        return run_dir, held_out(run_dir, args.limit)

    jobs = [(mode, seed) for seed in range(args.seeds) for mode in MODES]  # seeds outermost: drift hits all arms
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(run, jobs))
    runs = {m: [d for (mode, _), (d, _) in zip(jobs, done) if mode == m] for m in MODES}
    scores = {m: [s for (mode, _), (_, s) in zip(jobs, done) if mode == m] for m in MODES}
    lines, summary = report(runs, scores, base, args.steps)
    pngs = plot_runs([d for m in MODES for d in runs[m]], out, labels=[m for m in MODES for _ in runs[m]],
                     smooth=SMOOTH)
    footer = f"{time.time() - started:.0f} s wall, load average {load:.1f} at the start, " \
             f"{os.getloadavg()[0]:.1f} at the end; plots: {', '.join(str(p) for p in pngs)}"
    print("\n".join(lines) + f"\n\n{footer}")
    (out / "report.md").write_text("\n".join(lines) + f"\n\n{footer}\n")
    (out / "summary.json").write_text(json.dumps({**summary, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
