"""One prepared command for an offline GPU machine: what of the GPU path runs without vLLM and Transformer Engine.

On a machine with one CUDA GPU, its own torch and megatron-core from a carried wheel, run from
the source tree (docs/gpu.md: what travels, what has never run). Here, once,
``make gpu-wheels`` puts megatron-core's cp312 wheel into ``.gpu-wheels/``; there, from the
repository root with ``.gpu-wheels`` copied there, ``make gpu-check OUT=$OUT`` or what it runs:

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/gdpo-gpu-site .gpu-wheels/*.whl && \
    PYTHONPATH=$PWD:/tmp/gdpo-gpu-site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 \
      python3 benchmarks/gpu_check.py --out $OUT 2>&1 | tee $OUT/gpu_check.log

In CI, on the CPU, the same code path on a tiny model (tests/test_gpu_check.py):

    python benchmarks/gpu_check.py --dry-run --out DIR

Parts, each reported under its name in ``DIR/gpu_check.json`` and ``DIR/gpu_check.md``:

* ``tests``: the `gpu`-marked tests that need neither vLLM nor Transformer Engine (a pytest
  subprocess; TE's skip themselves, vLLM's are not collected).
* ``update``: the policy's train step in bf16 (local spec: torch SDPA, no TE) for random
  Qwen2-shaped models of 0.5B and 1.5B parameters, 16 rows of 2-4k tokens in token-budget
  micro-batches: s/step, tokens/s, MFU (model FLOPs as in benchmarks/policy_step.py, attention
  counted causal, over the GPU's dense bf16 peak), peak memory next to gdpo-plan's estimate of
  the same update.
* ``logprob_peak``: the log-prob step of one micro-batch of the 1.5B update (bf16 logits from
  the output layer, logprobs, backward): its peak bytes per logit element next to the bytes
  per element gdpo-plan counts for it.
* ``logprobs``: the policy's token logprobs against transformers' for the same weights on
  the same device, in fp32 and in bf16.
* ``weight_stream``: after an update, the policy's weights streamed into a transformers model
  give exactly the logits of its exported checkpoint, and logprobs next to the policy's.
* ``checkpoint``: save, then load into a fresh worker: every model and optimizer tensor bit-exact.
* ``sleep_copy``: pinned host <-> GPU copy speed; what vLLM's level-1 sleep would spend copying
  a 7B model's weights per step (the default, level 2, does not copy them).

Each part that raises is reported with its error and the rest still run; the report is
rewritten after every part, so a run stopped at its time limit leaves what it finished.
Nothing here is asserted: the figures are this run's measurements.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policy_step import BF16_PEAK, matmul_flops_per_token  # noqa: E402  (benchmarks/ is on sys.path)
from support.memory import logprob_step_bytes_per_logit  # noqa: E402  (policy_step puts tests/ on sys.path)

from gdpo_megatron.config import TrainConfig, from_dict  # noqa: E402
from gdpo_megatron.config.policy import ModelConfig, OptimConfig, PolicyConfig, PrecisionConfig  # noqa: E402
from gdpo_megatron.device import place_rank, this_machine  # noqa: E402
from gdpo_megatron.policy.batch import PolicyBatch  # noqa: E402

GIB = 2**30
# The tests that need neither vLLM nor Transformer Engine (the latter skip themselves).
GPU_TEST_FILES = ("tests/test_policy_gpu.py", "tests/test_checkpoint.py", "tests/test_launch.py")
PROMPT_TOKENS = 64  # every row's prompt; the rest is completion (the loss, and the logits, cover it)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the real sizes on a GPU, a tiny model for the CPU dry run."""

    update_models: dict[str, ModelConfig]  # the last one's shape also measures the log-prob step
    rows: int
    shortest: int
    longest: int
    micro_batch_tokens: int
    timed_steps: int
    check_model: ModelConfig  # logprobs, weight stream, checkpoint
    check_rows: int
    check_length: int
    copy_gib: float


def this_rank():
    """The one rank's placement on this machine: its GPU, or the CPU in a dry run."""
    return place_rank(this_machine(), 0)


def sizes(dry_run: bool) -> Sizes:
    if dry_run:
        tiny = ModelConfig.preset("tiny", tie_word_embeddings=True, add_qkv_bias=True)  # Qwen2-shaped
        return Sizes(update_models={"tiny": tiny}, rows=4, shortest=40, longest=80, micro_batch_tokens=160,
                     timed_steps=2, check_model=tiny, check_rows=2, check_length=48, copy_gib=0.0)
    # A 6,144-token budget: the 1.5B update's plan is 50 GiB (8,192 tokens: 58), room on an
    # 80 GB H100 (79.2 GiB) for what the local spec holds beyond the plan.
    return Sizes(update_models={name: ModelConfig.preset(name) for name in ("qwen2-0.5b", "qwen2-1.5b")},
                 rows=16, shortest=2048, longest=4096, micro_batch_tokens=6144, timed_steps=3,
                 check_model=ModelConfig.preset("qwen2-0.5b", num_layers=4), check_rows=4, check_length=1024,
                 copy_gib=4.0)


# ---- the report ---------------------------------------------------------------------------


def device_info() -> dict:
    def version(name: str):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "megatron_core": version("megatron-core"), "transformers": version("transformers"),
            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / GIB, 2), multiprocessors=props.multi_processor_count)
    else:
        info.update(name=f"CPU ({platform.machine()})")
    return info


def bf16_peak() -> float | None:
    """The dense bf16 tensor-core peak of this GPU (FLOP/s), where known."""
    if not torch.cuda.is_available():
        return None
    return next((peak for key, peak in BF16_PEAK.items() if key in torch.cuda.get_device_name()), None)


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    """The report for people: one section per part that ran."""
    d = report["device"]
    lines = [f"# gpu-check{' (dry run on the CPU)' if report['dry_run'] else ''}", "",
             f"{d['name']}; Python {d['python']}, torch {d['torch']} (CUDA {d['torch_cuda']}), megatron-core "
             f"{d['megatron_core']}, transformers {d['transformers']}; {report['date']}; "
             f"{report.get('seconds', 0):.0f} s in all.", ""]
    if "tests" in report:
        t = report["tests"]
        lines += ["## gpu-marked tests (no vLLM, no TE)", "",
                  _error(t) or f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped in "
                  f"{t['seconds']:.0f} s" + "".join(f"\n- failed: `{name}`" for name in t["failures"]), ""]
    if "update" in report:
        lines += ["## policy update, bf16, local spec (torch SDPA)", "",
                  "| model | parameters | tokens/step | s/step | tokens/s | TFLOP/s | MFU | peak GiB | plan GiB "
                  "| peak/plan |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["update"]:
            lines.append(f"| {r['model']} | {_error(r)} |" if "error" in r else
                         f"| {r['model']} | {r['parameters'] / 1e9:.3f} B | {r['tokens_per_step']} | "
                         f"{r['seconds_per_step']:.3f} | {r['tokens_per_s']:.0f} | {r['tflops']:.2f} | "
                         f"{_pct(r['mfu'])} | {_num(r['peak_allocated_gib'])} | {r['plan_gib']:.2f} | "
                         f"{_num(r['peak_over_plan'])} |")
        lines.append("")
    if "logprob_peak" in report:
        p = report["logprob_peak"]
        lines += ["## log-prob step memory", "", _error(p) or (
            f"{p['model']}: {p['positions']} positions x {p['vocab_rows']} vocabulary rows, bf16 logits: peak "
            f"{p['measured_bytes_per_logit']:.2f} bytes per logit element, gdpo-plan counts "
            f"{p['plan_bytes_per_logit']:.2f} (measured/plan {p['measured_over_plan']:.3f})"), ""]
    checks = []
    for dtype, lp in report.get("logprobs", {}).items():
        checks.append(_error(report["logprobs"]) if dtype == "error" else
                      f"- logprobs, policy vs transformers, {dtype}: max |diff| {lp['max_abs']:.3g}, mean "
                      f"{lp['mean_abs']:.3g} over {lp['tokens']} tokens")
    if "weight_stream" in report:
        w = report["weight_stream"]
        checks.append(_error(w) or f"- weight stream into transformers after an update: {w['tensors']} tensors; "
                      f"logits equal to the exported checkpoint's: {w['logits_equal']}; logprobs vs the "
                      f"policy's: max |diff| {w['policy_max_abs']:.3g}, mean {w['policy_mean_abs']:.3g}")
    if "checkpoint" in report:
        c = report["checkpoint"]
        checks.append(_error(c) or f"- checkpoint save -> load: {c['tensors']} tensors, bit-exact: {c['bit_exact']}"
                      + (f" (differ: {', '.join(c['mismatched'][:5])})" if c["mismatched"] else "")
                      + f"; {c['size_gib']:.2f} GiB saved in {c['save_s']:.1f} s, loaded in {c['load_s']:.1f} s")
    if "sleep_copy" in report:
        c = report["sleep_copy"]
        checks.append(_error(c) or (
            f"- pinned copies: {c['d2h_gb_per_s']:.1f} GB/s to the host, {c['h2d_gb_per_s']:.1f} GB/s back: vLLM's "
            f"level-1 sleep would copy qwen2-7b's {c['weights_7b_gib']:.1f} GiB of weights for "
            f"{c['level1_seconds_7b']:.2f} s per step" if "d2h_gb_per_s" in c else f"- pinned copies: {c['skipped']}"))
    if checks:
        lines += ["## agreement and copies", "", *checks]
    return "\n".join(lines) + "\n"


def _error(part: dict) -> str:
    return f"- ERROR: `{part['error']}`" if "error" in part else ""


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


# ---- parts ----------------------------------------------------------------------------------


def gpu_tests(out: Path, timeout_s: float) -> dict:
    """The gpu-marked tests of GPU_TEST_FILES in a pytest subprocess (its own session, ended
    whole at ``timeout_s`` with the worker processes it spawned); counts from its JUnit XML."""
    xml = out / "gpu_tests.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    per_test = max(int(timeout_s / 2), 1)
    started = time.perf_counter()
    with open(out / "gpu_tests.log", "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                f"--timeout={per_test}", f"--junitxml={xml}", *GPU_TEST_FILES],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = run.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            return {"error": f"the tests did not finish in {timeout_s:.0f} s (gpu_tests.log)"}
    result = {"returncode": returncode, "seconds": time.perf_counter() - started,
              "passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        result[outcome] += 1
        if outcome == "failed":
            result["failures"].append(f"{case.get('classname')}::{case.get('name')}")
    return result


def rows_of(model: ModelConfig, count: int, shortest: int, longest: int, seed: int = 0) -> PolicyBatch:
    """``count`` random rows of ``shortest``..``longest`` tokens, padded to the longest; a prompt of
    PROMPT_TOKENS (less for short rows), the rest completion."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=g)
    lengths[0] = longest
    ids = torch.randint(0, model.vocab_size, (count, longest), generator=g)
    positions = torch.arange(longest)
    prompt = min(PROMPT_TOKENS, shortest // 4)
    loss_mask = (positions >= prompt) & (positions < lengths[:, None])
    return PolicyBatch(ids, loss_mask, torch.randn(count, generator=g), lengths=lengths)


def update_plan(model: ModelConfig, policy: PolicyConfig, rows: int, longest: int):
    """gdpo-plan's memory plan of the same update on one GPU."""
    from gdpo_megatron.preflight.plan import Cluster, plan_memory

    config = from_dict(TrainConfig, {
        "run_dir": "runs/gpu-check", "base_model": "unused",
        "data": {"train_path": "unused", "family": "tool", "prompts_per_step": rows // 2,
                 "max_prompt_tokens": PROMPT_TOKENS},
        "rewards": {"rewards": [{"name": "tool_format"}]},
        "rollout": {"group_size": 2, "max_new_tokens": longest - PROMPT_TOKENS, "max_model_len": longest},
        "policy": {"model": dataclasses.asdict(model), "precision": {"dtype": policy.precision.dtype},
                   "micro_batch_tokens": policy.micro_batch_tokens},
    }, "")
    return plan_memory(config, Cluster(1, 1, 79.2))


def planned_update_bytes(model: ModelConfig, policy: PolicyConfig, rows: int, longest: int) -> int:
    """gdpo-plan's per-GPU bytes of the same update on one GPU: weights, gradients, Adam state,
    activations and logits (no allowances: what the measured peak holds)."""
    plan = update_plan(model, policy, rows, longest)
    s = plan.stage
    return s.static(plan.distributed_optimizer) + s.activations + s.logits


def update_policy(model: ModelConfig, size: Sizes) -> PolicyConfig:
    return PolicyConfig(model=model, precision=PrecisionConfig(dtype="bf16", transformer_engine=False),
                        optim=OptimConfig(lr=1e-6), micro_batch_tokens=size.micro_batch_tokens)


def logprob_peak(size: Sizes) -> dict:
    """The log-prob step of one full micro-batch of the last update model (measured on this
    device, support/memory.py) against the bytes per logit element the update's plan counts."""
    name, model = list(size.update_models.items())[-1]
    plan = update_plan(model, update_policy(model, size), size.rows, size.longest)
    rows = model.padded_vocab_size(1)
    planned = plan.stage.logits / (plan.micro_batch_tokens * rows)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    measured = logprob_step_bytes_per_logit(size.micro_batch_tokens, model.hidden_size, rows, model.vocab_size,
                                            device)
    _free()
    return {"model": name, "positions": size.micro_batch_tokens, "vocab_rows": rows,
            "measured_bytes_per_logit": measured, "plan_bytes_per_logit": planned,
            "measured_over_plan": measured / planned}


def update(name: str, size: Sizes) -> dict:
    """Median train step of a random ``name``-shaped policy in bf16, its throughput and peak memory."""
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    model, longest = size.update_models[name], size.longest
    config = update_policy(model, size)
    batch = rows_of(model, size.rows, size.shortest, longest)
    cuda = torch.cuda.is_available()
    with PolicyWorker(resolved_here(config), this_rank()) as worker:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        worker.train_step(batch)  # warm-up
        seconds = []
        for _ in range(size.timed_steps):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            worker.train_step(batch)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
        reserved = torch.cuda.max_memory_reserved() / GIB if cuda else None
        parameters = sum(p.numel() for p in worker.gpt_model.parameters())
    del worker
    _free()
    micro_batches = len(batch.split_by_tokens(size.micro_batch_tokens, config.sequence_multiple())[1])
    lengths = batch.lengths.tolist()
    tokens = sum(lengths)
    flops = sum(matmul_flops_per_token(model, n) * n for n in lengths)
    step = statistics.median(seconds)
    plan = planned_update_bytes(model, config, size.rows, longest) / GIB
    peak_flops = bf16_peak()
    return {"model": name, "parameters": parameters, "rows": size.rows, "tokens_per_step": tokens,
            "micro_batch_tokens": size.micro_batch_tokens, "micro_batches": micro_batches,
            "seconds": seconds, "seconds_per_step": step, "tokens_per_s": tokens / step,
            "tflops": flops / step / 1e12, "mfu": flops / step / peak_flops if peak_flops else None,
            "peak_allocated_gib": peak, "peak_reserved_gib": reserved, "plan_gib": plan,
            "peak_over_plan": peak / plan if peak is not None else None}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, T - 1]`` logprobs of each next token of ``ids`` under ``logits``, log-softmax in fp32, on the CPU."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()


def transformers_logprobs(hf_model, batch: PolicyBatch) -> torch.Tensor:
    """:func:`target_logprobs` of a transformers model on ``batch``."""
    ids = batch.input_ids.to(next(hf_model.parameters()).device)
    with torch.no_grad():
        return target_logprobs(hf_model(ids).logits, ids)


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    diff = (a.double() - b.double()).abs()[mask]
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "tokens": int(mask.sum())}


def load_transformers(directory: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()


def agreement(size: Sizes, work: Path) -> dict:
    """logprobs (fp32 and bf16) and the weight stream, on one random model exported once."""
    from gdpo_megatron.checkpoint.hf_io import load_hf_weights, save_hf_checkpoint
    from gdpo_megatron.checkpoint.weight_stream import iter_hf_weights
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    model = size.check_model
    batch = rows_of(model, size.check_rows, size.check_length, size.check_length, seed=1)
    targets = torch.ones(batch.size, batch.seq_length - 1, dtype=torch.bool)
    result = {"logprobs": {}}

    def policy(dtype: str) -> PolicyConfig:
        return PolicyConfig(model=model, precision=PrecisionConfig(dtype=dtype, transformer_engine=False),
                            optim=OptimConfig(lr=1e-4), micro_batch_size=batch.size)

    exported = work / "fp32"
    with PolicyWorker(resolved_here(policy("fp32")), this_rank()) as worker:  # random weights, exported in fp32
        save_hf_checkpoint(worker.gpt_model, model, exported)
        ours = worker.compute_logprobs(batch).cpu()
    hf = load_transformers(exported, torch.float32)
    result["logprobs"]["fp32"] = gap(ours, transformers_logprobs(hf, batch), targets)
    del hf
    _free()

    init = lambda m: load_hf_weights(m, model, exported)  # noqa: E731
    with PolicyWorker(resolved_here(policy("bf16")), this_rank(), init_weights=init) as worker:
        ours = worker.compute_logprobs(batch).cpu()
        hf = load_transformers(exported, torch.bfloat16)
        result["logprobs"]["bf16"] = gap(ours, transformers_logprobs(hf, batch), targets)

        worker.train_step(batch)  # new weights, then streamed as the weight sync streams them
        params = dict(hf.named_parameters())
        streamed = 0
        with torch.no_grad():
            for name, tensor in iter_hf_weights(worker.gpt_model, model):
                params[name].copy_(tensor)
                streamed += 1
        updated = worker.compute_logprobs(batch).cpu()
        save_hf_checkpoint(worker.gpt_model, model, work / "updated")
    ids = batch.input_ids.to(next(hf.parameters()).device)
    with torch.no_grad():
        logits = hf(ids).logits
    policy_gap = gap(updated, target_logprobs(logits, ids), targets)
    del hf
    _free()
    reference = load_transformers(work / "updated", torch.bfloat16)
    with torch.no_grad():
        exported_logits = reference(ids).logits
    result["weight_stream"] = {
        "tensors": streamed, "logits_equal": bool(torch.equal(logits, exported_logits)),
        "logits_max_abs": (logits.float() - exported_logits.float()).abs().max().item(),
        "policy_max_abs": policy_gap["max_abs"], "policy_mean_abs": policy_gap["mean_abs"]}
    del reference, logits, exported_logits
    _free()
    return result


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict by dotted path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    found = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def checkpoint_round_trip(size: Sizes, work: Path) -> dict:
    """Save after one step, load into a worker of another seed: every model and optimizer tensor
    bit-exact. The plain optimizer: without TE or Apex megatron-core's distributed optimizer
    cannot load before its first step (CheckpointManager says so)."""
    from gdpo_megatron.checkpoint.manager import CheckpointManager
    from gdpo_megatron.policy.worker import PolicyWorker
    from support.policy import resolved_here

    model = size.check_model
    config = PolicyConfig(model=model, precision=PrecisionConfig(dtype="bf16", transformer_engine=False),
                          optim=OptimConfig(lr=1e-4, use_distributed_optimizer=False),
                          micro_batch_size=size.check_rows)
    batch = rows_of(model, size.check_rows, size.check_length, size.check_length, seed=2)
    manager = CheckpointManager(work / "checkpoints")

    def state(worker) -> dict[str, torch.Tensor]:
        tensors = {f"model.{k}": v for k, v in _tensors(worker.gpt_model.state_dict()).items()}
        tensors.update({f"optimizer.{k}": v for k, v in _tensors(worker.optimizer.state_dict()).items()})
        return {k: v.detach().cpu().clone() for k, v in tensors.items()}

    with PolicyWorker(resolved_here(config), this_rank(), seed=1) as worker:
        worker.train_step(batch)
        started = time.perf_counter()
        manager.save(1, worker.model, worker.optimizer, worker.scheduler)
        save_s = time.perf_counter() - started
        saved = state(worker)
    _free()
    with PolicyWorker(resolved_here(config), this_rank(), seed=2) as worker:
        started = time.perf_counter()
        manager.load(worker.model, worker.optimizer, worker.scheduler)
        load_s = time.perf_counter() - started
        loaded = state(worker)
    _free()
    mismatched = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))
    mismatched += sorted(k for k in loaded if k not in saved)
    size_gib = sum(p.stat().st_size for p in (work / "checkpoints").rglob("*") if p.is_file()) / GIB
    return {"tensors": len(saved), "bit_exact": not mismatched, "mismatched": mismatched,
            "save_s": save_s, "load_s": load_s, "size_gib": size_gib}


def sleep_copy(size: Sizes) -> dict:
    """Pinned host <-> GPU copy speed, and what vLLM's level-1 sleep would copy per step for a
    7B model: its weights to the host at sleep and back at wake."""
    from gdpo_megatron.config.rollout import RolloutConfig
    from gdpo_megatron.preflight.plan import ENGINE_DTYPE_BYTES, engine_weights

    weights_7b = engine_weights(ModelConfig.preset("qwen2-7b"), RolloutConfig(), ENGINE_DTYPE_BYTES)
    if not torch.cuda.is_available():
        return {"skipped": "pinned memory needs CUDA", "weights_7b_gib": weights_7b / GIB}
    elements = int(size.copy_gib * GIB) // 2
    device = torch.empty(elements, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(elements, dtype=torch.bfloat16, pin_memory=True)
    times = {"d2h": [], "h2d": []}
    for _ in range(3):
        for direction, (dst, src) in (("d2h", (host, device)), ("h2d", (device, host))):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times[direction].append(time.perf_counter() - started)
    nbytes = elements * 2
    d2h, h2d = (nbytes / statistics.median(times[k]) / 1e9 for k in ("d2h", "h2d"))
    del device, host
    _free()
    return {"bytes": nbytes, "d2h_gb_per_s": d2h, "h2d_gb_per_s": h2d, "weights_7b_gib": weights_7b / GIB,
            "level1_seconds_7b": weights_7b / 1e9 / d2h + weights_7b / 1e9 / h2d}


# ---- main -----------------------------------------------------------------------------------


def run_part(name: str, fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": ...}`` when it raises (the other parts still run)."""
    started = time.perf_counter()
    print(f"gpu-check: {name} ...", flush=True)
    try:
        value = fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in its part
        traceback.print_exc()
        value = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}
    print(f"gpu-check: {name} done in {time.perf_counter() - started:.1f} s", flush=True)
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json / .md and logs")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: the same code path")
    parser.add_argument("--tests-timeout", type=float, default=240.0, help="seconds for the pytest part")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; --dry-run runs the same code path on the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    skip = {part for part in args.skip.split(",") if part}
    size = sizes(args.dry_run)
    report = {"dry_run": args.dry_run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_info()}
    started = time.perf_counter()

    def save() -> None:  # after every part: a run stopped at its limit leaves what it finished
        report["seconds"] = time.perf_counter() - started
        write_report(report, args.out)

    from gdpo_megatron.distributed.launch import init_distributed
    from gdpo_megatron.policy import cpu_compat

    if "tests" not in skip:  # first, while this process holds no GPU memory
        report["tests"] = run_part("tests", gpu_tests, args.out, args.tests_timeout)
        save()
    cpu_compat.install(this_machine())
    init_distributed(this_machine())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        if "update" not in skip:
            report["update"] = []
            for name in size.update_models:
                report["update"].append({"model": name, **run_part(f"update {name}", update, name, size)})
                save()
        if "logprob_peak" not in skip:
            report["logprob_peak"] = run_part("logprob_peak", logprob_peak, size)
            save()
        if "agreement" not in skip:
            (work / "agreement").mkdir()
            value = run_part("agreement", agreement, size, work / "agreement")
            report.update(value if "error" not in value else {"logprobs": value, "weight_stream": value})
            save()
        if "checkpoint" not in skip:
            (work / "checkpoint").mkdir()
            report["checkpoint"] = run_part("checkpoint", checkpoint_round_trip, size, work / "checkpoint")
            save()
    if "sleep_copy" not in skip:
        report["sleep_copy"] = run_part("sleep_copy", sleep_copy, size)
        save()
    torch.distributed.destroy_process_group()
    print((args.out / "gpu_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
