"""Build the policy as a megatron-core GPTModel, and set up megatron's parallel state.

The config says *what* model (:class:`ModelConfig`); the layer spec says *which
implementation*: Transformer Engine's fused layers on GPU (required for FP8; parameter names
such as ``self_attention.linear_qkv.layer_norm_weight``), megatron-core's local layers
elsewhere (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``).

megatron's parallel state is global to the process: call :func:`initialize_model_parallel`
once the default process group exists, and :func:`destroy_model_parallel` when done.
"""
from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from gdpo_megatron.policy import cpu_compat
from gdpo_megatron.policy.attention import SDPAttention
from gdpo_megatron.config.policy import ModelConfig, ParallelConfig, PrecisionConfig
from gdpo_megatron.device import Machine, Placement


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved ``precision.dtype``."""
    return DTYPES[name]


def initialize_model_parallel(parallel: ParallelConfig, seed: int = 1234, timeout: timedelta | None = None) -> None:
    """Create megatron's TP/PP/DP groups over the default process group and seed its RNGs.

    Ranks in one tensor-parallel group get different model-parallel RNG streams, ranks in one
    data-parallel group the same; the default stream is seeded with ``seed`` everywhere.
    ``timeout``: how long a collective of these groups waits for a peer (None: megatron's 30 minutes).
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError("initialize_model_parallel: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("initialize_model_parallel: megatron's parallel state is already "
                           "initialized in this process (call destroy_model_parallel first)")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        **({"distributed_timeout_minutes": timeout.total_seconds() / 60} if timeout else {}),
    )
    torch.manual_seed(seed)
    with cpu_compat.device_scope():  # on the CPU, the shim's tracker (installed at launch) takes the seeds
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down megatron's parallel state (the default process group stays)."""
    parallel_state.destroy_model_parallel()


def transformer_config(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                       machine: Machine) -> TransformerConfig:
    """megatron-core's TransformerConfig for a Llama/Qwen2-style decoder under these (resolved) settings."""
    on_gpu = machine.cuda
    fp8 = {"fp8": precision.fp8, "fp8_recipe": precision.fp8_recipe} if precision.fp8 else {}
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=torch_dtype(precision.dtype),
        pipeline_dtype=torch_dtype(precision.dtype),
        bf16=precision.dtype == "bf16",
        # Loss functions return token sums; megatron divides the gradients by the global count.
        calculate_per_token_loss=True,
        use_cpu_initialization=not on_gpu,
        # megatron's SwiGLU autograd function, on CPU too: it saves only its input and recomputes
        # the activation in backward, where the unfused path keeps the input, the activation and
        # a copy of the linear half (13.2M model, 64 x 50 tokens: 140 MiB more). Its compiled
        # helpers run eagerly on CPU (cpu_compat.device_scope). The fused bias-dropout-add has
        # nothing to save with no bias and no dropout. (No masked softmax to fuse: the core
        # attention is TE's or SDPAttention.)
        bias_activation_fusion=True,
        bias_dropout_fusion=on_gpu,
        # Transformer Engine's fused RoPE kernel with its spec: megatron-core takes it for our
        # inputs (bshd, no mRoPE, mscale 1); without TE it has none and rotates in torch.
        apply_rope_fusion=precision.transformer_engine,
        # Off: TE's linear layers would accumulate weight gradients into megatron's fp32 buffer
        # in their GEMM, but GPTModel's output layer is megatron's own ColumnParallelLinear,
        # which refuses the flag without Apex's fused_weight_gradient_mlp_cuda (not in the stack).
        gradient_accumulation_fusion=False,
        **fp8,
    )


class TorchNorm:
    """torch's ``RMSNorm`` / ``LayerNorm`` as megatron builds a norm, also under sequence parallelism.

    megatron's own torch norm (``WrappedTorchNorm``, what its local spec uses without Apex)
    refuses ``sequence_parallel``. Under sequence parallelism each tensor-parallel rank
    normalizes its own slice of the sequence with a replicated weight, whose gradient is then a
    partial sum: the weight is tagged ``sequence_parallel`` so that megatron's
    ``finalize_model_grads`` all-reduces it over the TP group, as it does for Transformer
    Engine's and Apex's norms. Used on CPU and on GPUs without Transformer Engine alike.
    """

    NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs) -> torch.nn.Module:
        if config.normalization not in cls.NORMS:
            raise ValueError(f"normalization: expected one of {tuple(cls.NORMS)}, got {config.normalization!r}")
        norm = cls.NORMS[config.normalization](hidden_size, eps=eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm


def layer_spec(config: TransformerConfig, precision: PrecisionConfig) -> ModuleSpec | TransformerBlockSubmodules:
    """Transformer Engine layers when enabled (GPU, needed for FP8); else megatron's local ones
    with :class:`TorchNorm` for every norm and :class:`SDPAttention` as core attention, this
    pipeline stage's layers and the final norm."""
    if precision.transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec()
    local = get_gpt_layer_local_spec(normalization=config.normalization)
    attention = local.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=SDPAttention))
    layer = dataclasses.replace(local, submodules=dataclasses.replace(
        local.submodules, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm, self_attention=attention))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=TorchNorm)


def build_model(model: ModelConfig, placement: Placement, parallel: ParallelConfig,
                precision: PrecisionConfig) -> GPTModel:
    """This rank's pipeline stage of the model, TP-sharded, on ``placement``'s device.

    Needs :func:`initialize_model_parallel` with the same ``parallel`` settings, under which
    ``model`` splits, and ``precision`` resolved for the placement's machine
    (:mod:`gdpo_megatron.resolve`). The embedding and output layers have
    ``model.padded_vocab_size(tp)`` rows.
    """
    machine = placement.machine
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_model: call initialize_model_parallel first")
    for name, size in (("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size()),
                       ("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size())):
        if getattr(parallel, name) != size:
            raise ValueError(f"parallel.{name}={getattr(parallel, name)} but megatron's parallel state "
                             f"was initialized with {size}")
    config = transformer_config(model, parallel, precision, machine)
    with cpu_compat.device_scope():
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, precision),
            vocab_size=model.padded_vocab_size(parallel.tensor_model_parallel_size),
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base),
        )
    # megatron's torch norms are created in fp32 whatever params_dtype says (Megatron-LM casts
    # the whole model with Float16Module); keep every parameter in params_dtype.
    dtype = torch_dtype(precision.dtype)
    for param in gpt.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    if machine.cuda:
        gpt.cuda(placement.device)
    return gpt


@contextlib.contextmanager
def logits_from(gpt: GPTModel, start: int):
    """Within: ``gpt``'s output layer sees the hidden states of positions ``start`` on only, so
    its logits are ``[b, s - start, vocab]``.

    megatron-core's GPTModel computes logits at every position in training; an update's loss
    reads those from its first target on (TRL's ``logits_to_keep``). The LM head's GEMM, its
    logits and the log-softmax's buffers shrink by the positions dropped (megatron's own
    inference path slices its hidden states the same way for last-token logits). Not under
    sequence parallelism: there the layer's input is split along the sequence and gathered
    inside it. A stage without the output layer is left as it is.
    """
    layer = gpt.output_layer if gpt.post_process else None
    if start == 0 or layer is None:
        yield
        return
    if layer.sequence_parallel:
        raise ValueError("logits_from: the output layer's input is split along the sequence (sequence parallel)")
    handle = layer.register_forward_pre_hook(lambda _, args: (args[0][start:], *args[1:]))
    try:
        yield
    finally:
        handle.remove()
