"""The resolve phase: a loaded config, the machine, the world and the model -> what the builders take.

Loading (:func:`gdpo_megatron.config.load_config`) checks every rule the config alone decides.
What depends on where and how a run is launched is decided here, once, and checked here, once:

* the policy's machine-dependent settings (``precision.dtype: auto``,
  ``precision.transformer_engine: null``, ``optim.use_distributed_optimizer: null``,
  ``old_logprobs: null``) and whether this machine's stack runs the precision;
* the parallel layout: the model's shape split over TP x PP, the data-parallel size the world
  leaves, the rollouts each data-parallel replica samples and trains on;
* the token budget of a micro-batch (``policy.micro_batch_tokens``, ``auto`` decoded);
* the rollout engine's memory: its KV cache, as the engine ``rollout.engine`` names sizes it
  for one step's rollouts (``RolloutEngine.kv_cache_gib``; on the CPU vLLM's own sizing would
  take half of the host's memory and touch every page).

:func:`resolve` does it for a training run (preflight, the trainer, ``gdpo-plan``,
``gdpo-doctor``); :func:`resolve_policy` for the policy alone (a policy worker outside a run);
:func:`resolve_precision` for a precision alone (``gdpo-convert``, ``gdpo-doctor``'s row).
Builders (:class:`~gdpo_megatron.policy.worker.PolicyWorker`,
:func:`~gdpo_megatron.policy.model.build_model`, the trainer) take the result as it is and check
nothing again. Every error is a :class:`~gdpo_megatron.config.ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from gdpo_megatron.config import ConfigError, ModelConfig, ParallelConfig, PolicyConfig, PrecisionConfig, TrainConfig
from gdpo_megatron.config.loader import require
from gdpo_megatron.config.rollout import RolloutConfig
from gdpo_megatron.device import Machine, check_precision
from gdpo_megatron.policy.resolved import MicroBatches, ResolvedPolicy
from gdpo_megatron.rollout.factory import engine_class


@dataclass(frozen=True)
class Layout:
    """How a step splits over the world."""

    world_size: int
    data_parallel_size: int
    rollouts_per_replica: int  # prompts_per_step / data_parallel_size x group_size


@dataclass(frozen=True)
class Resolved:
    """A training run's resolved sections."""

    machine: Machine
    policy: ResolvedPolicy
    layout: Layout
    kv_cache_gib: Optional[float]  # the rollout engine's KV cache; None: the engine sizes it (GPU)


def resolve(config: TrainConfig, machine: Machine, world_size: int, model: Optional[ModelConfig] = None,
            longest_prompt: Optional[int] = None, *, runs_here: bool = True) -> Resolved:
    """``config`` resolved for ``world_size`` ranks of ``machine``.

    ``model``: the shape trained, ``base_model``'s (errors about its split name it); None:
    ``policy.model`` (``gdpo-plan``). ``longest_prompt``: tokens of the data's longest prompt,
    which sizes the KV cache on the CPU (None: ``data.max_prompt_tokens``). ``runs_here``: the
    run is on this machine, so its libraries and GPU are asked whether they run the precision
    (``gdpo-plan`` plans for another machine)."""
    policy, model_key = config.policy, "policy."
    if model is not None:
        policy, model_key = dataclasses.replace(policy, model=model), "policy.parallel (base_model's shape): "
    resolved_policy = resolve_policy(policy, machine, world_size, runs_here=runs_here, model_key=model_key)
    layout = _layout(config, world_size, resolved_policy.data_parallel_size)
    _check_rollout(config.rollout, machine)
    prompt = config.data.max_prompt_tokens if longest_prompt is None else longest_prompt
    engine = resolve_engine(config.rollout, resolved_policy.config.model, machine, layout.rollouts_per_replica,
                            prompt + config.rollout.max_new_tokens)
    return Resolved(machine, resolved_policy, layout, engine.kv_cache_gib)


def resolve_engine(rollout: RolloutConfig, model: ModelConfig, machine: Machine, sequences: int,
                   tokens_per_sequence: int) -> RolloutConfig:
    """``rollout`` with the KV cache its engine builds on ``machine`` for ``sequences`` sequences
    of ``tokens_per_sequence`` tokens of ``model`` at once, as the engine sizes it
    (``RolloutEngine.kv_cache_gib``): a training step's rollouts, or ``gdpo-eval``'s prompts."""
    size = engine_class(rollout.engine).kv_cache_gib(rollout, model, machine, sequences, tokens_per_sequence)
    return dataclasses.replace(rollout, kv_cache_gib=size)


def resolve_policy(policy: PolicyConfig, machine: Machine, world_size: int, *, runs_here: bool = True,
                   model_key: str = "policy.") -> ResolvedPolicy:
    """``policy`` resolved for ``world_size`` ranks of ``machine``; errors about the model's
    split start with ``model_key``."""
    try:
        data_parallel = data_parallel_size(policy.parallel, world_size)
    except ConfigError as e:
        raise ConfigError(f"policy.{e}") from None
    try:
        check_model_split(policy.model, policy.parallel)
    except ConfigError as e:
        raise ConfigError(f"{model_key}{e}") from None
    precision = resolve_precision(policy.precision, machine, runs_here=runs_here)
    optim = dataclasses.replace(
        policy.optim, use_distributed_optimizer=machine.distributed_optimizer(policy.optim.use_distributed_optimizer))
    old_logprobs = policy.old_logprobs
    if old_logprobs is None:
        same_numerics = not machine.cuda and precision.dtype == "fp32" and policy.loss.tis_cap is None
        old_logprobs = "rollout" if same_numerics else "policy"
    if policy.offload_grads_and_optimizer and precision.dtype == "fp32" and not optim.use_distributed_optimizer:
        raise ConfigError("policy.offload_grads_and_optimizer: with fp32 parameters and the plain optimizer, "
                          "megatron's optimizer holds the model's own parameters, which the weight sync needs on "
                          "the GPU; use precision.dtype: bf16 or optim.use_distributed_optimizer: true")
    config = dataclasses.replace(policy, precision=precision, optim=optim, old_logprobs=old_logprobs)
    return ResolvedPolicy(config, data_parallel, _micro_batches(policy))


def resolve_precision(precision: PrecisionConfig, machine: Machine, *, runs_here: bool = True) -> PrecisionConfig:
    """``precision`` with ``dtype`` and ``transformer_engine`` decided for ``machine``; with
    ``runs_here``, checked against this machine's GPU and Transformer Engine."""
    resolved = precision_for(precision, machine)
    if runs_here:
        check_precision(resolved, machine)
    return resolved


def precision_for(precision: PrecisionConfig, machine: Machine) -> PrecisionConfig:
    """``precision``'s ``auto`` / ``null`` settings as ``machine`` runs them, unchecked."""
    return dataclasses.replace(precision, dtype=machine.param_dtype(precision.dtype),
                               transformer_engine=machine.transformer_engine(precision.transformer_engine))


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """The data-parallel size ``world_size`` ranks leave; ConfigError ``"parallel: ..."`` unless it
    holds whole model-parallel groups."""
    if world_size % parallel.model_parallel_size:
        raise ConfigError(f"parallel: world size {world_size} is not divisible by tensor x pipeline x context "
                          f"parallel size {parallel.model_parallel_size}")
    return world_size // parallel.model_parallel_size


def check_model_split(model: ModelConfig, parallel: ParallelConfig) -> None:
    """ConfigError ``"model.<key>: ..."`` unless ``model`` splits evenly under ``parallel``."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        require(getattr(model, key) % tp == 0, f"model.{key}", f"a multiple of parallel.tensor_model_parallel_size={tp}",
                getattr(model, key))
    require(model.num_layers % pp == 0, "model.num_layers", f"a multiple of parallel.pipeline_model_parallel_size={pp}",
            model.num_layers)


def _micro_batches(policy: PolicyConfig) -> MicroBatches:
    tokens = policy.micro_batch_tokens
    return MicroBatches(rows=policy.micro_batch_size, tokens=tokens if isinstance(tokens, int) else None,
                        by_tokens=tokens is not None)


def _layout(config: TrainConfig, world_size: int, data_parallel: int) -> Layout:
    """The step's split over ``data_parallel`` replicas; ConfigError naming the key where it is uneven."""
    tp, rollout_tp = config.policy.parallel.tensor_model_parallel_size, config.rollout.tensor_parallel_size
    if tp % rollout_tp:
        raise ConfigError(f"rollout.tensor_parallel_size: {rollout_tp} must divide "
                          f"policy.parallel.tensor_model_parallel_size={tp} (vLLM groups consecutive ranks)")
    prompts = config.data.prompts_per_step
    if prompts % data_parallel:
        raise ConfigError(f"data.prompts_per_step: {prompts} is not divisible by the data-parallel size {data_parallel}")
    per_replica = prompts // data_parallel * config.rollout.group_size
    policy = config.policy
    if policy.micro_batch_tokens is None and per_replica % policy.micro_batch_size:
        raise ConfigError(f"policy.micro_batch_size: {policy.micro_batch_size} does not divide the "
                          f"{per_replica} rollouts of a data-parallel replica")
    return Layout(world_size, data_parallel, per_replica)


def _check_rollout(rollout: RolloutConfig, machine: Machine) -> None:
    """The rollout settings a machine without CUDA cannot run."""
    if machine.cuda:
        return
    if rollout.quantization:
        raise ConfigError(f"rollout.quantization: {rollout.quantization!r} rollouts need a CUDA GPU; "
                          "use null on this machine")
    budget, longest = rollout.max_num_batched_tokens, rollout.max_model_len
    if budget is not None and budget < longest:
        raise ConfigError(f"rollout.max_num_batched_tokens: expected >= rollout.max_model_len={longest} on this "
                          f"machine, got {budget} (without CUDA a prompt's prefill is never split over engine "
                          "steps); raise it or leave it null")

