"""The policy's schema: model shape, parallelism, precision, optimizer and loss.

The parallel keys are named like NeMo-RL's and verl's Megatron configs. Settings whose value
depends on the machine stay ``"auto"`` / ``null`` here; :func:`gdpo_megatron.resolve.resolve`
decides them, with the model's split over the world, once per run.
"""
from __future__ import annotations

import math
from dataclasses import field
from typing import Literal, Optional, Union, get_args

from gdpo_megatron.config.loader import ConfigError, require, section

Dtype = Literal["fp32", "bf16"]
Fp8Format = Literal["e4m3", "hybrid"]
# megatron-core's FP8 recipes (TransformerConfig.fp8_recipe).
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
# Where the policy's old logprobs (the PPO ratio's denominator) come from.
OldLogprobs = Literal["policy", "rollout"]
DTYPES = get_args(Dtype)
FP8_RECIPES = get_args(Fp8Recipe)

# The fields of a ModelConfig that give the shape of its weights.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups")


@section
class ModelConfig:
    """Shape of a Llama / Qwen2 family decoder (GQA, RoPE, RMSNorm, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None  # key/value heads; None means one per query head
    head_dim: Optional[int] = None  # None means hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0  # Hugging Face `rope_theta`
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = False  # True for Qwen2
    # Embedding rows are padded to a multiple of this and of the TP size; logits of the padding
    # rows are masked out of every log-softmax. Unlike Megatron-LM's multiple of (this x TP), the
    # padded size is the same at every TP size dividing this, so checkpoints move between them.
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                     "num_attention_heads", "max_position_embeddings", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"model.{name}", "a positive int", value)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        require(self.num_attention_heads % self.num_query_groups == 0, "model.num_query_groups",
                f"a divisor of num_attention_heads={self.num_attention_heads}", self.num_query_groups)
        if self.head_dim is None:
            require(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size",
                    f"a multiple of num_attention_heads={self.num_attention_heads} (or set head_dim)",
                    self.hidden_size)
            self.head_dim = self.hidden_size // self.num_attention_heads
        require(self.rotary_base > 0, "model.rotary_base", "> 0", self.rotary_base)

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """Rows of the embedding and output layer at this TP size."""
        multiple = math.lcm(self.make_vocab_size_divisible_by, tensor_model_parallel_size)
        return math.ceil(self.vocab_size / multiple) * multiple

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named shape (see ``MODEL_PRESETS``), with fields overridden by keyword."""
        require(name in MODEL_PRESETS, "model.preset", f"one of {sorted(MODEL_PRESETS)}", name)
        return cls(**{**MODEL_PRESETS[name], **overrides})


# Constructor arguments of named shapes (Hugging Face configs of the same names).
MODEL_PRESETS = {
    # CPU tests and examples; head_dim 64 because vLLM's CPU attention needs it.
    "tiny": dict(vocab_size=512, hidden_size=128, ffn_hidden_size=256, num_layers=2, num_attention_heads=2,
                 max_position_embeddings=512),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, ffn_hidden_size=11008, num_layers=32,
                      num_attention_heads=32),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, ffn_hidden_size=14336, num_layers=32,
                      num_attention_heads=32, num_query_groups=8, max_position_embeddings=8192,
                      rotary_base=500000.0),
    # Qwen2 and Qwen2.5 of these sizes share the shape (tied embeddings).
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, ffn_hidden_size=4864, num_layers=24,
                       num_attention_heads=14, num_query_groups=2, max_position_embeddings=32768,
                       rotary_base=1000000.0, norm_epsilon=1e-6, tie_word_embeddings=True, add_qkv_bias=True),
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, ffn_hidden_size=8960, num_layers=28,
                       num_attention_heads=12, num_query_groups=2, max_position_embeddings=32768,
                       rotary_base=1000000.0, norm_epsilon=1e-6, tie_word_embeddings=True, add_qkv_bias=True),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944, num_layers=28,
                     num_attention_heads=28, num_query_groups=4, max_position_embeddings=32768,
                     rotary_base=1000000.0, norm_epsilon=1e-6, add_qkv_bias=True),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, ffn_hidden_size=27648, num_layers=64,
                        num_attention_heads=40, num_query_groups=8, max_position_embeddings=32768,
                        rotary_base=1000000.0, norm_epsilon=1e-6, add_qkv_bias=True),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, ffn_hidden_size=28672, num_layers=80,
                       num_attention_heads=64, num_query_groups=8, max_position_embeddings=8192,
                       rotary_base=500000.0),
}


@section
class ParallelConfig:
    """Model parallelism; data parallelism is whatever is left of the world."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"parallel.{name}", "an int >= 1", value)
        require(self.context_parallel_size == 1, "parallel.context_parallel_size",
                "1 (context parallelism is not supported yet)", self.context_parallel_size)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("parallel.sequence_parallel: needs tensor_model_parallel_size > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@section
class PrecisionConfig:
    """Parameter dtype and FP8.

    ``dtype: auto`` is bf16 on CUDA and fp32 without; ``transformer_engine: null`` uses the
    Transformer Engine layer spec wherever CUDA and TE are present. FP8 (``fp8: e4m3`` or
    ``hybrid``) runs through Transformer Engine's layers: it needs TE, a GPU on which TE's
    support check for ``fp8_recipe`` passes, and bf16 parameters.
    """

    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    fp8: Optional[Fp8Format] = None
    fp8_recipe: Fp8Recipe = "delayed"
    transformer_engine: Optional[bool] = None


@section
class OptimConfig:
    """Adam with gradient clipping, linear warmup and a constant or cosine decay."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global gradient norm; 0 disables clipping
    lr_warmup_steps: int = 0  # the lr rises linearly from 0 at step 0 to `lr` at this step
    lr_decay_steps: int = 1000  # cosine: the step at which the lr reaches min_lr
    lr_decay_style: Literal["constant", "cosine"] = "constant"
    # null: the distributed (sharded) optimizer on CUDA, the plain one on the CPU.
    use_distributed_optimizer: Optional[bool] = None

    def __post_init__(self):
        require(self.lr > 0, "optim.lr", "> 0", self.lr)
        require(0 <= self.min_lr <= self.lr, "optim.min_lr", f"in [0, lr={self.lr}]", self.min_lr)
        require(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)
        for name in ("adam_beta1", "adam_beta2"):
            require(0 <= getattr(self, name) < 1, f"optim.{name}", "in [0, 1)", getattr(self, name))
        require(self.adam_eps > 0, "optim.adam_eps", "> 0", self.adam_eps)
        require(self.clip_grad >= 0, "optim.clip_grad", ">= 0", self.clip_grad)
        require(self.lr_warmup_steps >= 0, "optim.lr_warmup_steps", ">= 0", self.lr_warmup_steps)
        require(self.lr_decay_steps > self.lr_warmup_steps, "optim.lr_decay_steps",
                f"> lr_warmup_steps={self.lr_warmup_steps}", self.lr_decay_steps)


@section
class LossConfig:
    """Clipped policy-gradient loss with an optional k3 KL penalty to a frozen reference."""

    ratio_clip_low: float = 0.2
    ratio_clip_high: float = 0.2
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    kl_coef: float = 0.0
    # Truncated importance sampling of the rollout/training mismatch: each token's policy-gradient
    # term is weighted by min(exp(old_logprob - rollout_logprob), tis_cap), the old logprobs being
    # the policy's own (verl: rollout_is_threshold; NeMo-RL: truncated_importance_sampling_ratio).
    # None: off. The TIS paper and verl use 2.
    tis_cap: Optional[float] = None

    def __post_init__(self):
        require(self.ratio_clip_low >= 0, "loss.ratio_clip_low", ">= 0", self.ratio_clip_low)
        require(self.ratio_clip_high >= 0, "loss.ratio_clip_high", ">= 0", self.ratio_clip_high)
        require(self.kl_coef >= 0, "loss.kl_coef", ">= 0", self.kl_coef)
        require(self.tis_cap is None or self.tis_cap > 0, "loss.tis_cap", "> 0 or null", self.tis_cap)


@section
class PolicyConfig:
    """Everything the policy worker needs.

    ``model`` is the shape ``gdpo-plan`` plans with; a training run takes the shape of its
    ``base_model`` (and warns where the two differ).
    """

    model: ModelConfig = field(default_factory=lambda: ModelConfig.preset("tiny"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    micro_batch_size: int = 1  # sequences per forward-backward micro-batch (see micro_batch_tokens)
    # Micro-batches by a budget of tokens (padding included): rows sorted by length, each
    # micro-batch cut to its longest row, which removes padding and, with the logits computed
    # from each micro-batch's first target, the logits of the longer prompts' positions. The
    # loss and gradients are those of any other split (up to float summation order). "auto": a
    # budget of micro_batch_size rows as wide as the step's longest, so no micro-batch holds more
    # tokens than micro_batch_size rows would; a number: that budget (micro_batch_size unused);
    # null: consecutive slices of micro_batch_size rows at the step's full width.
    micro_batch_tokens: Union[int, Literal["auto"], None] = "auto"
    ppo_epochs: int = 1  # optimizer passes over each batch
    # The PPO ratio's old logprobs. "policy": the policy's own before the update, so the ratio
    # starts at 1 and only the policy's kernels enter it (with ppo_epochs > 1 one extra forward
    # pass; with one epoch the training pass's logprobs, detached, at no cost); "rollout": the
    # rollout engine's sampling logprobs, which is sound only where both engines compute the
    # same numbers (fp32 on CPU: ~1e-7 apart). null: "policy", except with fp32 parameters on a
    # machine without CUDA and no loss.tis_cap.
    old_logprobs: Optional[OldLogprobs] = None
    # While the rollout engine generates: free megatron's gradient buffers and move the optimizer
    # state (Adam moments, fp32 master weights) to host memory; train_step brings them back.
    offload_grads_and_optimizer: bool = False

    def __post_init__(self):
        require(self.micro_batch_size >= 1, "micro_batch_size", ">= 1", self.micro_batch_size)
        require(self.micro_batch_tokens in (None, "auto") or self.micro_batch_tokens >= 1, "micro_batch_tokens",
                "auto, null or >= 1", self.micro_batch_tokens)
        require(self.ppo_epochs >= 1, "ppo_epochs", ">= 1", self.ppo_epochs)
        require(self.precision.fp8 is None or self.precision.dtype != "fp32", "precision.fp8",
                "null with dtype: fp32 (FP8 training expects bf16 parameters)", self.precision.fp8)
        if self.loss.tis_cap is not None and self.old_logprobs == "rollout":
            raise ConfigError("policy.loss.tis_cap: truncated importance sampling weighs the policy's old logprobs "
                              "against the rollout engine's; it needs old_logprobs: policy")

    def sequence_multiple(self) -> int:
        """Every batch's sequence length must be a multiple of this (pad the batch to it).

        Sequence parallelism splits the sequence over the TP ranks. With FP8, Transformer
        Engine 2.11 needs, per micro-batch of ``rows x T`` tokens:

        * each rank's *local* slice, ``L = rows x T / (TP if SP else 1)``, a multiple of 8
          (``assert_dim_for_fp8_exec``), of 32 for MXFP8 tensors (``MXFP8Quantizer``), and of
          128 where a blockwise-quantized input is all-gathered under SP
          (``Float8BlockQuantizer.is_quantizable``);
        * the weight-gradient GEMM's token count, ``N = rows x T`` (the all-gathered input
          under SP), a multiple of 16: that GEMM puts the tokens in cuBLASLt's leading
          dimension, which ``CanonicalizeGemmInput`` requires ``% 16 == 0`` ("Caller must
          pad") for tensor scaling on Ada, Hopper and sm120, and for blockwise scaling
          everywhere.

        The smallest per-row multiple that meets all of them for any number of rows is
        ``lcm(split x local multiple, 16)``, split being TP under SP and 1 without.
        """
        split = self.parallel.tensor_model_parallel_size if self.parallel.sequence_parallel else 1
        if not self.precision.fp8:
            return split
        local = {"mxfp8": 32, "blockwise": 128 if self.parallel.sequence_parallel else 8}.get(
            self.precision.fp8_recipe, 8)
        return math.lcm(split * local, 16)
