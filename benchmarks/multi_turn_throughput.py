"""Multi-turn rollout throughput on the CPU: a step's trajectories advancing together through
the colocated vLLM engine, against one trajectory at a time, the prefix cache across turns,
and TRL's tool-calling loop.

    python benchmarks/multi_turn_throughput.py [--runs 3] [--steps 3] [--threads 2]
        [--model runs/demo_base] [--trl-vllm-python trl-vllm/bin/python]

The work is ``configs/multi_turn_cpu.yaml``'s: the demo model (``--model``, else a fresh one
warmed up as the tests' is, ``gdpo_megatron.demo.warmup.make_base_model``) answers the
city-desk questions through ``examples/environments/city_desk.py``'s CityDesk, 4 prompts x 4
trajectories a step, at most 48 tokens per model message and 2 model messages per user turn,
320 tokens per trajectory. Two workloads (``WORKLOADS``):

- ``two-turn``: the questions as they are, two user turns each (the second fed in when the
  model answers the first without a call);
- ``one-turn``: the same questions cut to their first user turn: what TRL's tool loop can
  express (it ends a rollout at the first message without a tool call and has no next user turn).

This trainer's modes, all in one process per run on one engine, built as the trainer builds it
(``build_engine`` with the run's resolved rollout config), each step's prompts and sampling
seeds as the trainer's step draws them:

- ``batched``: :meth:`TrajectoryRollouts.roll_out` as the trainer calls it: every live
  trajectory's turn in one ``continue_sequences`` call, the prefix cache serving earlier turns;
- ``one at a time``: what a user without batching across trajectories writes: each trajectory
  its own ``roll_out`` to its end (a group of one), through the same engine, sampled with the
  seed keys it has in the batched rollout (:class:`Keyed`), so both modes sample the same
  trajectories where vLLM's numbers do not depend on the batch (the "same" column counts them);
- ``batched, cold turns``: ``batched`` with the engine's prefix cache emptied before every
  turn's call (:class:`ColdTurns`): what reusing the blocks of earlier turns buys. (The engine
  keeps vLLM's prefix caching on; within one call the G trajectories of a prompt still share its
  first prefill.)

Each step of a mode starts with an empty prefix cache, as a training step does after its weight
sync; the modes take turns step by step (in one order, then reversed), after one untimed step.

``--trl-vllm-python`` adds TRL 1.16's ``GRPOTrainer`` on ``one-turn``, in its own process and
environment (the one of ``benchmarks/vs_trl.py``), generating with its colocated vLLM and the
same model, prompts (in the trainer's order), sampling temperature and CityDesk:
``environment_factory`` gets :class:`CityDeskTools`, whose typed methods step a CityDesk and
return this project's observation text; ``max_tool_calling_iterations`` =
``max_steps_per_turn - 1`` (the same number of model messages). What TRL needs that the model
does not bring, and what differs, is in docs/benchmarks.md; in short: a chat template that renders
``tool_calls`` (:data:`TOOL_CALLING_TEMPLATE`, the demo's plus that), a tokenizer response parser
(the demo model writes a JSON list in a ``<tool_call>`` tag, which TRL's response templates do
not read: :func:`project_parser` reads calls as this project does), vs_trl's weight sync
(:func:`vs_trl.reload_sync`), and TRL's token budget, which is per trajectory
(``max_completion_length``, here what the prompt leaves of 320), not per model message. Timed:
TRL's ``_generate`` (its first turn and tool loop) less the weight sync, of every step but
the first.

Columns (medians over ``--runs`` runs of the per-run totals over the timed steps):
trajectories/s; model tokens/s (tokens the engine generated); model messages per trajectory;
engine calls per step; the share of the rollout's time spent inside them (this project:
``continue_sequences``; TRL: vLLM's ``LLM.generate``; the rest is templating, parsing and the
environments, this project's in pooled worker processes); prefix cache: prompt tokens vLLM found
in its prefix cache / prompt tokens of its requests (vLLM's per-request counts, whole KV-cache
blocks: 32 tokens in this project's CPU engine, TRL's leaves vLLM's CPU default of 128).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_turn_cpu.yaml"
WORKLOADS = ("two-turn", "one-turn")
MODES = ("batched", "one at a time", "batched, cold turns")
TRL_WORKLOAD = "one-turn"
WARMUP_MODEL_STEPS = 60  # the tests' demo base model (tests/conftest.py)
# The demo chat template (gdpo_megatron/demo/task.py) plus an assistant message's ``tool_calls``
# as ``<tool_call>`` JSON: TRL refuses a template that does not render them. A chat without
# ``tool_calls`` renders as under the demo's own.
TOOL_CALLING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% else %}<|assistant|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|endoftext|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A response template (transformers' new-style parser) for single-object ``<tool_call>`` tags
# under the demo template; TRL wants one on a tokenizer it uses with tools. It cannot read the
# JSON list the demo model writes in a tag, so the TRL side parses with project_parser.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|endoftext\|>\s*", "content": "text"},
    },
}


# ---- the work ------------------------------------------------------------------------------


def run_config(model: str, run_dir: Path):
    """``configs/multi_turn_cpu.yaml`` on ``model``, its files found from any directory."""
    import yaml

    from gdpo_megatron.config import TrainConfig, load_config

    raw = yaml.safe_load(CONFIG.read_text())
    return load_config(TrainConfig, CONFIG, [
        f"base_model={model}", f"run_dir={run_dir}", f"data.train_path={ROOT / raw['data']['train_path']}",
        f"environment.file={ROOT / raw['environment']['file']}"])


def workload_samples(samples: list, workload: str) -> list:
    """The questions of ``workload``: as they are, or cut to their first user turn."""
    if workload == "two-turn":
        return samples
    return [dataclasses.replace(s, ground_truth={**s.ground_truth, "later_turns": []}) for s in samples]


def step_indices(num_samples: int, prompts: int, seed: int, steps: int) -> list[list[int]]:
    """The samples of each step, as the trainer's prompt schedule picks them."""
    from gdpo_megatron.experience import PromptSchedule

    schedule = PromptSchedule(num_samples, prompts, seed)
    return [list(schedule.indices(step)) for step in range(steps)]


# ---- this trainer's side -------------------------------------------------------------------


class Counted:
    """The engine as ``roll_out`` sees it, counting its ``continue_sequences`` calls and the
    seconds spent in them."""

    def __init__(self, engine):
        self.engine, self.calls, self.seconds = engine, 0, 0.0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def continue_sequences(self, sequences, sampling, keys):
        start = time.perf_counter()
        completions = self.engine.continue_sequences(sequences, sampling, keys)
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        return completions


class Keyed:
    """One trajectory's engine: its requests seeded with ``key`` (global prompt id, sample index),
    its key in the batched rollout, in place of the (prompt id, 0) of a group of one."""

    def __init__(self, counted: Counted, key: tuple):
        self.counted, self.key = counted, key

    @property
    def tokenizer(self):
        return self.counted.tokenizer

    def continue_sequences(self, sequences, sampling, keys):
        return self.counted.continue_sequences(sequences, sampling, [(*self.key, turn) for *_, turn in keys])


class ColdTurns(Counted):
    """The engine with its prefix cache emptied before every turn's call."""

    def continue_sequences(self, sequences, sampling, keys):
        empty_prefix_cache(self.engine)
        return super().continue_sequences(sequences, sampling, keys)


def empty_prefix_cache(engine) -> None:
    engine._llm.reset_prefix_cache()  # the engine resets it only after a weight sync


def roll_out(mode: str, trajectories, engine, samples: list, group_size: int, sampling, keys: list[int]):
    """A step's trajectories in ``mode``: rollouts grouped by sample, and the engine's counts."""
    counted = ColdTurns(engine) if mode == "batched, cold turns" else Counted(engine)
    if mode != "one at a time":
        return trajectories.roll_out(counted, samples, group_size, sampling, keys), counted
    rollouts = []
    for sample, key in zip(samples, keys):
        for j in range(group_size):
            rollouts += trajectories.roll_out(Keyed(counted, (key, j)), [sample], 1, sampling, [key])
    return rollouts, counted


def trajectory_digest(rollout) -> str:
    """What the model sampled in a trajectory, as a short digest."""
    model = [span.token_ids for span in rollout.spans if span.is_model]
    return hashlib.blake2b(json.dumps(model).encode(), digest_size=8).hexdigest()


def run_project(model: str, steps: int, out: Path) -> dict:
    """Every workload and mode, step by step on one engine: per step its time, trajectories,
    generated tokens, model messages, engine calls, prefix-cache counts and trajectory digests."""
    from gdpo_megatron.device import this_machine
    from gdpo_megatron.preflight.validation import check_training
    from gdpo_megatron.rollout.engine import SamplingConfig, derive_seed
    from gdpo_megatron.rollout.factory import build_engine
    from gdpo_megatron.trajectories import TrajectoryRollouts

    config = run_config(model, out / "run")
    machine = this_machine()
    inputs = check_training(config, machine, 1)
    rollout = dataclasses.replace(config.rollout, kv_cache_gib=inputs.resolved.kv_cache_gib)
    engine = build_engine(rollout, model, machine, seed=config.seed)
    trajectories = TrajectoryRollouts.for_run(config)
    cfg, G, P = config, config.rollout.group_size, config.data.prompts_per_step
    schedule = step_indices(len(inputs.samples), P, cfg.data.shuffle_seed, steps + 1)
    results = {w: {m: [] for m in MODES} for w in WORKLOADS}
    try:
        for step, indices in enumerate(schedule):
            sampling = SamplingConfig(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                      top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                                      stop=tuple(cfg.rollout.stop), seed=derive_seed(cfg.seed, step))
            order = [(w, m) for w in WORKLOADS for m in MODES]
            for workload, mode in order if step % 2 else order[::-1]:
                samples = workload_samples([inputs.samples[i] for i in indices], workload)
                empty_prefix_cache(engine)
                cached = engine.prefix_cache
                start = time.perf_counter()
                rollouts, counted = roll_out(mode, trajectories, engine, samples, G, sampling, list(range(P)))
                seconds = time.perf_counter() - start
                cache = engine.prefix_cache - cached
                if step == 0:
                    continue  # the untimed step: first requests, the environment workers
                results[workload][mode].append({
                    "s": seconds, "trajectories": len(rollouts), "tokens": sum(r.model_tokens for r in rollouts),
                    "messages": sum(r.model_turns for r in rollouts), "calls": counted.calls,
                    "engine_s": counted.seconds,
                    "hits": cache.hits, "queries": cache.queries,
                    "digests": [trajectory_digest(r) for r in rollouts]})
    finally:
        trajectories.close()
        engine.close()
    return results


# ---- TRL's side (in TRL's environment) -------------------------------------------------------


class CityDeskTools:
    """CityDesk as TRL's ``environment_factory`` takes it: ``reset`` from a question's
    environment config, and its tools as typed, documented methods, each stepping the
    environment as this project does (its arguments checked against the tool's schema) and
    returning this project's observation text. ``convert_currency`` is left out: its ``from``
    parameter cannot be a Python parameter name (TRL answers a call to it "Tool not found")."""

    def __init__(self):
        from gdpo_megatron.environments.registry import (
            environment_reference,
            make_environment,
        )

        self._make = partial(make_environment, environment_reference(
            "CityDesk", str(ROOT / "examples" / "environments" / "city_desk.py")))
        self._desk = None

    def reset(self, environment_config: str, **_) -> None:
        self._desk = self._make()
        self._desk.reset(json.loads(environment_config))

    def get_weather(self, city: str) -> str:
        """The weather in a city.

        Args:
            city: The city.
        """
        return self._step("get_weather", city=city)

    def get_time(self, city: str) -> str:
        """The local time in a city.

        Args:
            city: The city.
        """
        return self._step("get_time", city=city)

    def _step(self, name: str, **arguments) -> str:
        from gdpo_megatron.environments.calls import Call

        return self._desk.step([Call(name, kwargs=arguments)]).observation


def project_parser(tokenizer):
    """A ``parse_response`` for ``tokenizer`` that reads a message's calls as this project's
    rollouts do (:class:`~gdpo_megatron.environments.trajectory.Message`): a message without a
    call attempt, or with one that does not parse, is a plain answer to TRL."""
    from gdpo_megatron.environments.trajectory import Message

    def parse_response(ids, prefix=None, tools=None):
        text = tokenizer.decode(ids, skip_special_tokens=False).removesuffix(tokenizer.eos_token)
        calls = Message(text).calls()
        if not isinstance(calls, list):
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text, "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.kwargs}} for c in calls]}

    return parse_response


def counted_generation(generate, counts: dict, *args, **kwargs):
    """vLLM's ``LLM.generate`` through vs_trl's prefix-cache count, adding to ``counts`` its
    calls, the sequences it generated (model messages) and their tokens."""
    from vs_trl import counted_generate

    start = time.perf_counter()
    outputs = counted_generate(generate, counts, *args, **kwargs)
    counts["engine_s"] += time.perf_counter() - start
    counts["calls"] += 1
    counts["messages"] += sum(len(output.outputs) for output in outputs)
    counts["tokens"] += sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return outputs


def run_trl(model: str, steps: int, out: Path, work: dict) -> dict:
    """TRL's GRPOTrainer on ``one-turn`` for ``steps`` + 1 steps: per timed step what
    :func:`run_project` records (but digests: its sampling is seeded its own way)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from vs_trl import reload_sync

    from gdpo_megatron.data.samples import load_samples

    samples = workload_samples(load_samples(work["data"], work["family"], system_prompt=work["system_prompt"]),
                               TRL_WORKLOAD)
    schedule = step_indices(len(samples), work["prompts"], work["shuffle_seed"], steps + 1)
    # the config as JSON text: a column of dicts would get every row's keys (None where a row has none)
    rows = [{"prompt": samples[i].messages,
             "environment_config": json.dumps(samples[i].ground_truth["environment_config"])}
            for indices in schedule for i in indices]
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TOOL_CALLING_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    tokenizer.parse_response = project_parser(tokenizer)
    longest = max(len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)) for r in rows)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: TRL leaves the CPU engine's KV cache to this variable
    counts = {"calls": 0, "messages": 0, "tokens": 0, "prefix_hits": 0, "prefix_queries": 0, "engine_s": 0.0}
    sync_s, records = [], []

    class Timed(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.vllm_generation.sync_weights = partial(reload_sync, self.vllm_generation, sync_s)
            llm = self.vllm_generation.llm
            llm.generate = partial(counted_generation, llm.generate, counts)

        def _generate(self, prompts):
            before, syncs, start = dict(counts), len(sync_s), time.perf_counter()
            result = super()._generate(prompts)
            seconds = time.perf_counter() - start - sum(sync_s[syncs:])
            records.append({"s": seconds, "trajectories": len(prompts), "tokens": counts["tokens"] - before["tokens"],
                            "messages": counts["messages"] - before["messages"],
                            "calls": counts["calls"] - before["calls"],
                            "engine_s": counts["engine_s"] - before["engine_s"],
                            "hits": counts["prefix_hits"] - before["prefix_hits"],
                            "queries": counts["prefix_queries"] - before["prefix_queries"]})
            return result

    def no_reward(prompts, **_):
        return [0.0] * len(prompts)

    completions = work["prompts"] * work["group_size"]
    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps + 1, per_device_train_batch_size=completions,
        gradient_accumulation_steps=1, num_generations=work["group_size"],
        max_completion_length=work["max_model_len"] - longest, temperature=work["temperature"],
        max_tool_calling_iterations=work["max_steps_per_turn"] - 1, learning_rate=1e-6, beta=0.0, bf16=False,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=work["seed"],
        dataloader_num_workers=0, shuffle_dataset=False, model_init_kwargs={"dtype": torch.float32},
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=work["max_model_len"],
        vllm_enable_sleep_mode=False, vllm_importance_sampling_correction=False,
    )
    trainer = Timed(model=model, reward_funcs=[no_reward], args=args, train_dataset=Dataset.from_list(rows),
                    processing_class=tokenizer, environment_factory=CityDeskTools)
    trainer.train()
    return {TRL_WORKLOAD: {"TRL": records[1:]}}


def child_main(side: str, model: str, steps: int, result: Path, work: Path) -> None:
    if side == "project":
        from gdpo_megatron.commands.cpu_malloc import reexec_with_tcmalloc

        reexec_with_tcmalloc()  # what gdpo-train does first on a CPU machine
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    with tempfile.TemporaryDirectory() as tmp:
        if side == "project":
            out = run_project(model, steps, Path(tmp))
        else:
            out = run_trl(model, steps, Path(tmp), json.loads(work.read_text()))
    result.write_text(json.dumps(out))


# ---- the comparison ---------------------------------------------------------------------------


def work_description(model: str, tmp: Path) -> dict:
    """What TRL's side needs of the config (it reads no config of this project's)."""
    config = run_config(model, tmp / "run")
    return {"data": str(ROOT / config.data.train_path), "family": config.data.family,
            "system_prompt": config.data.system_prompt, "prompts": config.data.prompts_per_step,
            "group_size": config.rollout.group_size, "max_new_tokens": config.rollout.max_new_tokens,
            "max_model_len": config.rollout.max_model_len, "temperature": config.rollout.temperature,
            "max_steps_per_turn": config.environment.max_steps_per_turn, "seed": config.seed,
            "shuffle_seed": config.data.shuffle_seed}


def launch(side: str, python: str, model: str, steps: int, threads: int, tmp: Path) -> dict:
    result = tmp / f"{side}.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}",
           "VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
           "TRL_EXPERIMENTAL_SILENCE": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.pop("MASTER_PORT", None)
    cmd = [python, str(Path(__file__).resolve()), "--child", side, "--model", model, "--steps", str(steps),
           "--result", str(result), "--work", str(tmp / "work.json")]
    log = tmp / f"{side}.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, check=False, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp).returncode
    if code != 0 or not result.exists():
        raise SystemExit(f"{side} run failed (exit {code}); its log:\n{log.read_text()[-4000:]}")
    return json.loads(result.read_text())


def run_totals(steps: list[dict]) -> dict:
    """One run of one mode: totals over its timed steps."""
    total = {k: sum(s[k] for s in steps) for k in ("s", "engine_s", "trajectories", "tokens", "messages", "calls",
                                                   "hits", "queries")}
    return {**total, "steps": len(steps)}


def summarize(runs: list[list[dict]], batched: list[list[dict]] | None) -> dict:
    """Medians over runs; ``same``: trajectories identical to the batched mode's of the same run."""
    med, totals = statistics.median, [run_totals(r) for r in runs]
    summary = {
        "trajectories_per_s": med(t["trajectories"] / t["s"] for t in totals),
        "tokens_per_s": med(t["tokens"] / t["s"] for t in totals),
        "messages": med(t["messages"] / t["trajectories"] for t in totals),
        "tokens_per_message": med(t["tokens"] / t["messages"] for t in totals),
        "calls": med(t["calls"] / t["steps"] for t in totals),
        "engine_share": med(t["engine_s"] / t["s"] for t in totals),
        "hit_frac": med(t["hits"] / t["queries"] for t in totals),
        "hits": med(t["hits"] / t["steps"] for t in totals), "queries": med(t["queries"] / t["steps"] for t in totals),
        "trajectories_per_step": med(t["trajectories"] / t["steps"] for t in totals),
    }
    if batched is not None:
        summary["same"] = med(sum(a == b for s, r in zip(run, ref) for a, b in zip(s["digests"], r["digests"]))
                              for run, ref in zip(runs, batched))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per side (medians are reported)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed step)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of each side (OMP_NUM_THREADS; default: every core this process may use)")
    parser.add_argument("--model", help="the demo base model (python -m gdpo_megatron.demo writes runs/demo_base); "
                                        "default: one warmed up now")
    parser.add_argument("--trl-vllm-python", default=os.environ.get("GDPO_TRL_VLLM_PYTHON"),
                        help="python of vs_trl.py's TRL + vllm-cpu environment: adds TRL's tool-calling loop "
                             "(or GDPO_TRL_VLLM_PYTHON)")
    parser.add_argument("--child", choices=("project", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, args.model, args.steps, args.result, args.work)
    if args.runs < 1 or args.steps < 1:
        raise SystemExit("--runs and --steps: at least 1")
    if args.trl_vllm_python and not os.access(args.trl_vllm_python, os.X_OK):
        raise SystemExit(f"--trl-vllm-python: {args.trl_vllm_python} is not an executable python")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model: {args.model} is not a Hugging Face model directory (no config.json)")

    pythons = {"project": sys.executable, **({"trl": args.trl_vllm_python} if args.trl_vllm_python else {})}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            from gdpo_megatron.demo.warmup import make_base_model

            model = str(make_base_model(tmp / "model", steps=WARMUP_MODEL_STEPS))
        model = str(Path(model).resolve())
        (tmp / "work.json").write_text(json.dumps(work_description(model, tmp)))
        runs: dict[str, dict[str, list]] = {}
        for i in range(args.runs):
            for side in pythons if i % 2 == 0 else list(pythons)[::-1]:
                for workload, modes in launch(side, pythons[side], model, args.steps, args.threads, tmp).items():
                    for mode, steps in modes.items():
                        runs.setdefault(workload, {}).setdefault(mode, []).append(steps)
                print(f"  run {i + 1} {side} done", file=sys.stderr, flush=True)
    print_tables(runs, args)


def print_tables(runs: dict, args) -> None:
    print(f"{args.threads} thread(s) per side, {args.steps} timed steps per run, median of {args.runs} runs; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| workload | mode | trajectories/s | model tokens/s | x batched | model messages / trajectory "
          "| tokens / message | engine calls / step | time in engine calls | prefix cache hits / queries per step "
          "| same as batched |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for workload, modes in runs.items():
        batched = summarize(modes["batched"], None)
        for mode, mode_runs in modes.items():
            s = summarize(mode_runs, modes["batched"] if mode in MODES[1:] else None)
            same = f"{s['same']:.0f} / {s['trajectories_per_step'] * args.steps:.0f}" if "same" in s else "n/a"
            print(f"| {workload} | {mode} | {s['trajectories_per_s']:.2f} | {s['tokens_per_s']:,.0f} "
                  f"| {s['trajectories_per_s'] / batched['trajectories_per_s']:.2f}x / "
                  f"{s['tokens_per_s'] / batched['tokens_per_s']:.2f}x "
                  f"| {s['messages']:.2f} | {s['tokens_per_message']:.1f} | {s['calls']:.1f} "
                  f"| {s['engine_share']:.0%} "
                  f"| {s['hits']:,.0f} / {s['queries']:,.0f} ({s['hit_frac']:.0%}) | {same} |")


if __name__ == "__main__":
    main()
