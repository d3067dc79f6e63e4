"""Per-GPU memory of a training config, and whether it fits (``gdpo-plan``, ``gdpo-doctor``).

The model shape is ``policy.model`` (e.g. ``{preset: qwen2-7b}``); ``base_model`` is not read,
it usually does not exist where jobs are planned. Settings that resolve per machine are planned
as on a CUDA GPU (:data:`gdpo_megatron.device.CUDA`): ``precision.dtype: auto`` is bf16,
``optim.use_distributed_optimizer: null`` is true.

What is counted, per GPU (the assumptions are printed with the table):

* weights in the parameter dtype; gradients in fp32 (megatron DDP buffers,
  ``grad_reduce_in_fp32``); Adam state in fp32: master weights (bf16 parameters only) and two
  moments, divided by the data-parallel size under the distributed optimizer;
* a frozen reference copy of the weights when ``loss.kl_coef > 0``;
* activations of the in-flight micro-batches (1F1B keeps ``PP - stage`` of them), no activation
  recompute, flash/fused attention (no ``s x s`` scores), no dropout; on the last stage also
  the log-prob step's peak: the logits in the parameter dtype and three fp32 working buffers
  per logit element (:func:`gdpo_megatron.policy.logprobs.peak_bytes_per_logit`, measured by a
  CPU test). A row is ``data.max_prompt_tokens + rollout.max_new_tokens`` tokens padded to
  ``policy.sequence_multiple()``; a micro-batch holds ``micro_batch_size`` rows, or with
  ``policy.micro_batch_tokens`` up to that many tokens (one row alone when it is longer);
* the rollout engine (vLLM), colocated: while generating, its weights (bf16, or FP8 linear
  layers with ``rollout.quantization: fp8``, split over the rollout TP size, as the engine
  counts them: ``RolloutEngine.weight_bytes``), its KV cache and the engine's ``RUNTIME_GIB``
  for its activations, sampler, CUDA graphs and NCCL buffers (``--vllm-runtime``). All of it
  is ``gpu_memory_utilization`` of the GPU, which vLLM wants free at start-up; with ``rollout.kv_cache_gib`` the engine
  passes the utilization that weights + KV cache + runtime make (printed). While the policy
  trains vLLM sleeps; the runtime allowance stays counted (sleep frees neither the CUDA-graph
  pool nor NCCL buffers), and so do the update's activations until they go back to the driver
  before vLLM wakes (``empty_cache``). At ``rollout.sleep_level: 1`` the sleeping weights take
  host memory (printed);
* with ``policy.offload_grads_and_optimizer`` the gradient buffers are freed and the Adam state
  (moments and master weights) waits in host memory while vLLM generates; the table shows the
  peak while generating both ways (the weight sync, between the two, holds less than either);
* a fixed allowance for the CUDA context, NCCL buffers and allocator fragmentation.

Host memory per node for the distributed optimizer's state in a checkpoint
(:func:`checkpoint_host_memory`): ``fully_reshardable`` gathers each TP x PP shard's Adam state
on its data-parallel rank 0 when saving and allocates it on every rank when loading;
``dp_reshardable`` has each rank write and read its own share.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from gdpo_megatron.config import TrainConfig
from gdpo_megatron.device import CUDA
from gdpo_megatron.errors import UsageError
from gdpo_megatron.config.policy import ModelConfig, ParallelConfig
from gdpo_megatron.config.rollout import RolloutConfig
from gdpo_megatron.policy.logprobs import peak_bytes_per_logit
from gdpo_megatron.policy.resolved import MicroBatches
from gdpo_megatron.resolve import resolve
from gdpo_megatron.rollout.factory import DEFAULT_ENGINE, engine_class

GIB = 2**30
FP32_BYTES = 4
PARAM_BYTES = {"bf16": 2, "fp32": 4}
ENGINE_DTYPE_BYTES = 2  # bf16: the engine's weights and KV cache for a bf16 checkpoint
# What the engine holds besides weights and KV cache, awake or asleep (--vllm-runtime's default).
ENGINE_RUNTIME_GIB = engine_class(DEFAULT_ENGINE).RUNTIME_GIB
ADAM_MOMENTS = 2
DEFAULT_OVERHEAD_GIB = 3.0


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The GPUs a job gets."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    overhead_gib: float = DEFAULT_OVERHEAD_GIB  # CUDA context, NCCL buffers, fragmentation
    vllm_runtime_gib: float = ENGINE_RUNTIME_GIB  # vLLM's besides weights and KV cache, awake or asleep

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(self, name)}")
        if not (self.gpu_memory_gib > 0 and math.isfinite(self.gpu_memory_gib)):
            raise UsageError(f"--gpu-memory: expected a finite number > 0 GiB, got {self.gpu_memory_gib}")
        for name in ("overhead_gib", "vllm_runtime_gib"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise UsageError(f"--{name[:-4].replace('_', '-')}: expected a finite number >= 0 GiB, got {value}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


# ---- parameter and activation counts ------------------------------------------------------


def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    qkv = h * (q + 2 * kv) + (q + 2 * kv if model.add_qkv_bias else 0)
    sharded = qkv + q * h + h * 2 * f + f * h  # QKV, output projection, SwiGLU fc1 (gate+up), fc2
    return sharded // tp + 2 * h  # the two RMSNorm weights are replicated


def stage_params(model: ModelConfig, parallel: ParallelConfig, stage: int) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds (its TP shard)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    embedding = model.padded_vocab_size(tp) // tp * model.hidden_size
    count = model.num_layers // pp * layer_params(model, tp)
    if stage == 0:
        count += embedding
    if stage == pp - 1:
        count += model.hidden_size  # final norm
        if not model.tie_word_embeddings or pp > 1:  # a tied output layer off stage 0 is a copy
            count += embedding
    return count


def total_params(model: ModelConfig) -> int:
    """Parameters of the unsharded model with its real vocabulary (what vLLM loads)."""
    embeddings = (1 if model.tie_word_embeddings else 2) * model.vocab_size * model.hidden_size
    return model.num_layers * layer_params(model, 1) + model.hidden_size + embeddings


def activation_bytes_per_token_layer(model: ModelConfig, parallel: ParallelConfig, param_bytes: int) -> int:
    """Activations one layer keeps for its backward pass, per token, on one TP rank.

    Norm inputs, QKV input, q/k/v, attention output (= projection input), fc1 input, fc1
    output (gate and up) and fc2 input. The four hidden-size tensors are split over TP only
    with sequence parallelism.
    """
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    tp = parallel.tensor_model_parallel_size
    hidden = 4 * h // (tp if parallel.sequence_parallel else 1)
    sharded = (2 * model.num_attention_heads * d + 2 * model.num_query_groups * d + 3 * f) // tp
    return (hidden + sharded) * param_bytes


def engine_weights(model: ModelConfig, rollout: RolloutConfig) -> int:
    """The rollout engine's weights on one rank (bf16, FP8 transformer layers with
    ``rollout.quantization: fp8``), as the engine counts them."""
    layers = model.num_layers * layer_params(model, 1)
    engine = engine_class(rollout.engine)
    return engine.weight_bytes(layers, total_params(model) - layers, ENGINE_DTYPE_BYTES, rollout)


# ---- the plan ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Bytes on one GPU of a pipeline stage; optimizer state for both optimizer kinds."""

    stage: int
    params: int
    weights: int
    gradients: int
    optimizer_distributed: int
    optimizer_plain: int
    reference: int
    activations: int
    logits: int

    def static(self, distributed: bool) -> int:
        """What stays on the GPU for the whole run (also while vLLM generates)."""
        optimizer = self.optimizer_distributed if distributed else self.optimizer_plain
        return self.weights + self.gradients + optimizer + self.reference


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of the fullest pipeline stage, vLLM and the fixed allowance; the verdicts."""

    config: TrainConfig
    cluster: Cluster
    data_parallel_size: int
    sequence_length: int  # one row, padded to policy.sequence_multiple()
    micro_batch_tokens: int  # the most a micro-batch holds, padding included
    micro_batches_per_step: int  # the most a step can have
    stage: StagePlan  # the pipeline stage with the highest peak
    vllm_weights: int
    vllm_total: int  # while generating: weights + KV cache + runtime
    vllm_runtime: int  # besides weights and KV cache; stays while vLLM sleeps
    kv_cache_per_token: int
    overhead: int

    @property
    def kv_cache(self) -> int:
        return self.vllm_total - self.vllm_weights - self.vllm_runtime

    @property
    def kv_cache_tokens(self) -> int:
        return max(self.kv_cache, 0) // self.kv_cache_per_token

    @property
    def gpu_memory_utilization(self) -> float:
        """What vLLM is given (and wants free at start-up): configured, or with
        ``rollout.kv_cache_gib`` derived from what it holds."""
        return self.vllm_total / (self.cluster.gpu_memory_gib * GIB)

    def peak_generating(self, distributed: bool, offload: Optional[bool] = None) -> int:
        """vLLM awake next to the policy's weights, and its gradients and Adam state unless offloaded
        (``offload=None``: as configured). Also what vLLM's start-up check asks: the memory free
        next to the policy must hold ``vllm_total``."""
        offload = self.offload if offload is None else offload
        policy = self.stage.weights + self.stage.reference if offload else self.stage.static(distributed)
        return self.overhead + policy + self.vllm_total

    def peak_training(self, distributed: bool) -> int:
        return (self.overhead + self.stage.static(distributed) + self.stage.activations + self.stage.logits
                + self.vllm_runtime)

    def peak(self, distributed: bool, offload: Optional[bool] = None) -> int:
        return max(self.peak_generating(distributed, offload), self.peak_training(distributed))

    def fits(self, distributed: bool, offload: Optional[bool] = None) -> bool:
        return (self.peak(distributed, offload) <= self.cluster.gpu_memory_gib * GIB
                and self.kv_cache_tokens >= self.config.rollout.max_model_len)

    @property
    def distributed_optimizer(self) -> bool:
        return bool(self.config.policy.optim.use_distributed_optimizer)

    @property
    def offload(self) -> bool:
        return bool(self.config.policy.offload_grads_and_optimizer)


def micro_batch_tokens(micro_batches: MicroBatches, sequence_length: int) -> int:
    """The most tokens one micro-batch holds: ``micro_batch_size`` rows, or with a token budget
    that budget, or one row alone where a row is longer (:meth:`PolicyBatch.split_by_tokens`)."""
    budget = micro_batches.budget(sequence_length)
    if budget is None:
        return micro_batches.rows * sequence_length
    return max(budget, sequence_length)


def plan_memory(config: TrainConfig, cluster: Cluster) -> MemoryPlan:
    """Per-GPU memory of ``config`` on ``cluster`` of CUDA GPUs; raises ConfigError if the layout is impossible."""
    resolved = resolve(config, CUDA, cluster.world_size, runs_here=False)
    config = dataclasses.replace(config, policy=resolved.policy.config)
    policy, rollout, data = config.policy, config.rollout, config.data
    model, parallel = policy.model, policy.parallel
    dp, rollouts_per_replica = resolved.layout.data_parallel_size, resolved.layout.rollouts_per_replica
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    micro_batches = math.ceil(rollouts_per_replica / resolved.policy.micro_batches.fewest_rows)

    param_bytes = PARAM_BYTES[policy.precision.dtype]
    multiple = policy.sequence_multiple()
    sequence = math.ceil((data.max_prompt_tokens + rollout.max_new_tokens) / multiple) * multiple
    tokens = micro_batch_tokens(resolved.policy.micro_batches, sequence)
    per_layer = activation_bytes_per_token_layer(model, parallel, param_bytes) * tokens
    adam_bytes = ADAM_MOMENTS * FP32_BYTES + (FP32_BYTES if param_bytes < FP32_BYTES else 0)

    stages = []
    for stage in range(pp):
        params = stage_params(model, parallel, stage)
        in_flight = min(pp - stage, micro_batches)
        logits = (tokens * model.padded_vocab_size(tp) // tp * peak_bytes_per_logit(param_bytes)
                  if stage == pp - 1 else 0)
        stages.append(StagePlan(
            stage=stage,
            params=params,
            weights=params * param_bytes,
            gradients=params * FP32_BYTES,
            optimizer_distributed=math.ceil(params * adam_bytes / dp),
            optimizer_plain=params * adam_bytes,
            reference=params * param_bytes if policy.loss.kl_coef > 0 else 0,
            activations=in_flight * (model.num_layers // pp) * per_layer,
            logits=logits,
        ))
    weights = engine_weights(model, rollout)
    runtime = int(cluster.vllm_runtime_gib * GIB)
    if rollout.kv_cache_gib is not None:
        vllm_total = weights + int(rollout.kv_cache_gib * GIB) + runtime
    else:
        vllm_total = int(rollout.gpu_memory_utilization * cluster.gpu_memory_gib * GIB)
    plans = [MemoryPlan(
        config=config, cluster=cluster, data_parallel_size=dp, sequence_length=sequence,
        micro_batch_tokens=tokens, micro_batches_per_step=micro_batches, stage=stage, vllm_weights=weights,
        vllm_total=vllm_total, vllm_runtime=runtime,
        kv_cache_per_token=engine_class(rollout.engine).kv_cache_bytes_per_token(model, rollout, ENGINE_DTYPE_BYTES),
        overhead=int(cluster.overhead_gib * GIB),
    ) for stage in stages]
    return max(plans, key=lambda plan: plan.peak(plan.distributed_optimizer))


# ---- report ------------------------------------------------------------------------------


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table in GiB, with the assumptions it rests on and the verdict."""
    cfg, cluster, s = plan.config, plan.cluster, plan.stage
    policy, rollout = cfg.policy, cfg.rollout
    model, parallel = policy.model, policy.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dtype = policy.precision.dtype
    configured = plan.distributed_optimizer

    def gib(n: int) -> str:
        return f"{n / GIB:.1f}" if n else "-"

    offload_marks = (" *", "") if not plan.offload else ("", " *")

    rows = [
        (f"policy weights ({dtype})", s.weights, s.weights),
        ("gradients (fp32 DDP buffer)", s.gradients, s.gradients),
        ("Adam state (fp32)", s.optimizer_distributed, s.optimizer_plain),
        ("reference model (kl_coef > 0)", s.reference, s.reference),
        (f"activations ({min(pp - s.stage, plan.micro_batches_per_step)} micro-batch(es) in flight)",
         s.activations, s.activations),
        ("logits + log-prob step (last stage)", s.logits, s.logits),
        (f"vLLM weights (TP {rollout.tensor_parallel_size})", plan.vllm_weights, plan.vllm_weights),
        ("vLLM KV cache", plan.kv_cache, plan.kv_cache),
        ("vLLM runtime (CUDA graphs, NCCL, activations)", plan.vllm_runtime, plan.vllm_runtime),
        ("CUDA context, NCCL, fragmentation", plan.overhead, plan.overhead),
        (f"peak while generating{offload_marks[0]}", plan.peak_generating(True, False),
         plan.peak_generating(False, False)),
        (f"peak while generating, grads + Adam offloaded{offload_marks[1]}", plan.peak_generating(True, True),
         plan.peak_generating(False, True)),
        ("  (host memory for the offloaded Adam state)", s.optimizer_distributed, s.optimizer_plain),
        ("peak while training (vLLM asleep, its runtime kept)", plan.peak_training(True), plan.peak_training(False)),
    ]
    marks = ("*" if configured else "", "" if configured else "*")
    header = ("GiB per GPU", f"distributed optimizer{marks[0]}", f"plain optimizer{marks[1]}")
    width = max(len(r[0]) for r in rows) + 2
    lines = [
        f"gdpo-plan: {cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs of {cluster.gpu_memory_gib:g} GiB",
        f"model: {total_params(model) / 1e9:.2f} B parameters ({model.num_layers} layers, hidden "
        f"{model.hidden_size}, {model.num_attention_heads} heads / {model.num_query_groups} KV groups, vocab "
        f"{model.vocab_size} padded to {model.padded_vocab_size(tp)})",
        f"layout: TP {tp} x PP {pp} x DP {plan.data_parallel_size}"
        f"{', sequence parallel' if parallel.sequence_parallel else ''}; "
        f"figures for pipeline stage {s.stage} ({s.params / 1e9:.2f} B parameters per GPU)",
        f"sequence: {plan.sequence_length} tokens ({cfg.data.max_prompt_tokens} prompt + {rollout.max_new_tokens} "
        f"new{f', padded to a multiple of {policy.sequence_multiple()}' if policy.sequence_multiple() > 1 else ''}); "
        + (f"micro-batches of <= {plan.micro_batch_tokens} tokens (policy.micro_batch_tokens "
           f"{policy.micro_batch_tokens}), up to {plan.micro_batches_per_step} per step"
           if policy.micro_batch_tokens is not None else
           f"micro-batch {policy.micro_batch_size}; {plan.micro_batches_per_step} micro-batches per step"),
        f"assumed: {dtype} weights, fp32 gradients, Adam fp32 "
        f"{'master weights + ' if PARAM_BYTES[dtype] < FP32_BYTES else ''}2 moments, no activation recompute, "
        f"flash attention"
        + (f"; fp8={policy.precision.fp8} is not modeled ({dtype} sizes, an upper bound)"
           if policy.precision.fp8 else ""),
        "",
        f"{header[0]:<{width}}{header[1]:>24}{header[2]:>18}",
    ]
    lines += [f"{name:<{width}}{gib(a):>24}{gib(b):>18}" for name, a, b in rows]
    verdict = [("fits" if plan.fits(d) else "does not fit") for d in (True, False)]
    lines.append(f"{'in ' + format(cluster.gpu_memory_gib, 'g') + ' GiB':<{width}}{verdict[0]:>24}{verdict[1]:>18}")
    lines += [
        "",
        f"(* configured: policy.optim.use_distributed_optimizer={str(configured).lower()}, "
        f"policy.offload_grads_and_optimizer={str(plan.offload).lower()})",
        f"KV cache: {plan.kv_cache_tokens:,} tokens per vLLM engine, {plan.kv_cache_tokens // plan.sequence_length} "
        f"full sequences at once (rollout.max_model_len {rollout.max_model_len} must fit)",
        f"vLLM: gpu_memory_utilization {plan.gpu_memory_utilization:.3f}"
        + (" (derived from rollout.kv_cache_gib)" if rollout.kv_cache_gib is not None else "")
        + ": it starts only where that share of the GPU is free next to the policy (the peak while generating)",
    ]
    if rollout.sleep_level == 1:
        lines.append(f"host memory: {gib(plan.vllm_weights)} GiB per GPU of pinned memory for vLLM's weights while "
                     "it sleeps (rollout.sleep_level 1)")
    return "\n".join(lines)


# ---- checkpoints: host memory per node ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointHostMemory:
    """Bytes of host memory per node, by node, for the distributed optimizer's state in a checkpoint."""

    sharding: str  # checkpoint.optimizer_sharding
    saving: tuple[int, ...]  # fully_reshardable: the Adam state its data-parallel rank 0s gather
    loading: tuple[int, ...]  # fully_reshardable: the Adam state every rank allocates
    own_share: tuple[int, ...]  # dp_reshardable: the ranks' own shares, saved and loaded as they are


def checkpoint_host_memory(config: TrainConfig, cluster: Cluster) -> CheckpointHostMemory | None:
    """Host memory per node for the distributed optimizer's state in a checkpoint; None without
    a distributed optimizer. Ranks fill the nodes in order, in megatron-core's rank order
    (TP fastest, then DP, then PP), so the data-parallel rank 0s of a pipeline stage share nodes."""
    policy = resolve(config, CUDA, cluster.world_size, runs_here=False).policy.config
    if not policy.optim.use_distributed_optimizer:
        return None
    parallel = policy.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp = cluster.world_size // (tp * pp)
    param_bytes = PARAM_BYTES[policy.precision.dtype]
    adam_bytes = ADAM_MOMENTS * FP32_BYTES + (FP32_BYTES if param_bytes < FP32_BYTES else 0)
    shard = [stage_params(policy.model, parallel, stage) * adam_bytes for stage in range(pp)]
    saving, loading, own = ([0] * cluster.nodes for _ in range(3))
    for rank in range(cluster.world_size):
        node, dp_rank, stage = rank // cluster.gpus_per_node, rank // tp % dp, rank // (tp * dp)
        saving[node] += shard[stage] if dp_rank == 0 else 0
        loading[node] += shard[stage]
        own[node] += math.ceil(shard[stage] / dp)
    return CheckpointHostMemory(config.checkpoint.optimizer_sharding, tuple(saving), tuple(loading), tuple(own))


def format_checkpoint_memory(memory: CheckpointHostMemory) -> str:
    """One line: what saving and loading a checkpoint hold in host memory per node, in both formats."""
    def per_node(values: tuple[int, ...]) -> str:
        figures = [f"{v / GIB:.0f}" if v >= 10 * GIB or not v else f"{v / GIB:.1f}" for v in values]
        if len(set(figures)) == 1:
            return f"{figures[0]} GiB on every node"
        return f"{' / '.join(figures)} GiB on nodes 0-{len(figures) - 1}"

    gathered = (f"saving gathers {per_node(memory.saving)} (the other ranks wait), loading allocates "
                f"{per_node(memory.loading)}")
    own = f"nothing is gathered, each rank writes and reads its own share ({per_node(memory.own_share)} in all)"
    if memory.sharding == "fully_reshardable":
        formats = f"{gathered}; dp_reshardable: {own}"
    else:
        formats = f"{own}; fully_reshardable: {gathered}"
    return f"checkpoint host memory for the Adam state (checkpoint.optimizer_sharding={memory.sharding}): {formats}"
