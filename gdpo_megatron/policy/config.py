"""Typed configuration of the policy: model shape, parallelism, precision, optimizer, loss.

Plain dataclasses, validated when built (``__post_init__``) and against each other by
:meth:`PolicyConfig.validate`, so that a bad setting is a clear error naming the field before
anything is allocated. The parallel keys are named like NeMo-RL's and verl's Megatron configs.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP8_FORMATS = ("e4m3", "hybrid")
# megatron-core's FP8 recipes (TransformerConfig.fp8_recipe) and the Transformer Engine function
# that says whether this GPU, CUDA and cuBLAS run the TE recipe megatron-core builds for each:
# delayed -> DelayedScaling and tensorwise -> Float8CurrentScaling (is_fp8_available),
# blockwise -> Float8BlockScaling, mxfp8 -> MXFP8BlockScaling.
FP8_RECIPE_SUPPORT = {
    "delayed": "is_fp8_available",
    "tensorwise": "is_fp8_available",
    "blockwise": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
}
FP8_RECIPES = tuple(FP8_RECIPE_SUPPORT)
# Where the policy's old logprobs (the PPO ratio's denominator) come from.
OLD_LOGPROB_SOURCES = ("policy", "rollout")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean")
LR_DECAY_STYLES = ("constant", "cosine")


def _require(ok: bool, field_name: str, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"{field_name}: expected {expected}, got {got!r}")


def _require_choice(value, choices, field_name: str) -> None:
    _require(value in choices, field_name, f"one of {tuple(choices)}", value)


def transformer_engine_available() -> bool:
    """Whether Transformer Engine is installed (never imported on CPU-only machines)."""
    return importlib.util.find_spec("transformer_engine") is not None


def fp8_recipe_support(recipe: str) -> tuple[bool, str]:
    """Transformer Engine's own answer whether this machine runs ``recipe``: (ok, reason).

    Imports Transformer Engine, so call it only where CUDA and TE are present.
    """
    import transformer_engine.pytorch as te

    return getattr(te, FP8_RECIPE_SUPPORT[recipe])(return_reason=True)


# The fields of a ModelConfig that give the shape of its weights.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups")


@dataclass
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
            _require(isinstance(value, int) and value > 0, f"model.{name}", "a positive int", value)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _require(self.num_attention_heads % self.num_query_groups == 0, "model.num_query_groups",
                 f"a divisor of num_attention_heads={self.num_attention_heads}", self.num_query_groups)
        if self.head_dim is None:
            _require(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size",
                     f"a multiple of num_attention_heads={self.num_attention_heads} (or set head_dim)",
                     self.hidden_size)
            self.head_dim = self.hidden_size // self.num_attention_heads
        _require(self.rotary_base > 0, "model.rotary_base", "> 0", self.rotary_base)

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """Rows of the embedding and output layer at this TP size."""
        multiple = math.lcm(self.make_vocab_size_divisible_by, tensor_model_parallel_size)
        return math.ceil(self.vocab_size / multiple) * multiple

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named shape (see ``MODEL_PRESETS``), with fields overridden by keyword."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"model preset: expected one of {sorted(MODEL_PRESETS)}, got {name!r}")
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
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944, num_layers=28,
                     num_attention_heads=28, num_query_groups=4, max_position_embeddings=32768,
                     rotary_base=1000000.0, norm_epsilon=1e-6, add_qkv_bias=True),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, ffn_hidden_size=28672, num_layers=80,
                       num_attention_heads=64, num_query_groups=8, max_position_embeddings=8192,
                       rotary_base=500000.0),
}


@dataclass
class ParallelConfig:
    """Model parallelism; data parallelism is whatever is left of the world."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"parallel.{name}", "an int >= 1", value)
        if self.context_parallel_size != 1:
            raise NotImplementedError(
                f"parallel.context_parallel_size={self.context_parallel_size}: context parallelism "
                "is not supported yet (use 1)")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel: needs tensor_model_parallel_size > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"parallel: world size {world_size} is not divisible by tensor x pipeline x context "
                f"parallel size {self.model_parallel_size}")
        return world_size // self.model_parallel_size


@dataclass
class PrecisionConfig:
    """Parameter dtype and FP8. ``dtype="auto"`` is bf16 with CUDA and fp32 without.

    FP8 (``fp8="e4m3"`` or ``"hybrid"``) runs through Transformer Engine's layers, so it needs
    TE, a GPU on which TE's support check for ``fp8_recipe`` passes, and bf16 parameters.
    """

    dtype: str = "auto"
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    # None: use the Transformer Engine layer spec whenever CUDA and TE are present.
    transformer_engine: Optional[bool] = None

    def __post_init__(self):
        if self.dtype == "auto":
            self.dtype = "bf16" if torch.cuda.is_available() else "fp32"
        _require_choice(self.dtype, DTYPES, "precision.dtype")
        if self.fp8 is not None:
            _require_choice(self.fp8, FP8_FORMATS, "precision.fp8")
        _require_choice(self.fp8_recipe, FP8_RECIPES, "precision.fp8_recipe")
        if self.transformer_engine is None:
            self.transformer_engine = torch.cuda.is_available() and transformer_engine_available()

    @property
    def params_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def check_runtime(self) -> None:
        """Raise if this machine cannot run these settings (TE or FP8 without the hardware)."""
        if self.transformer_engine:
            if not torch.cuda.is_available():
                raise ValueError("precision.transformer_engine: the Transformer Engine spec needs CUDA")
            if not transformer_engine_available():
                raise ValueError("precision.transformer_engine: transformer_engine is not installed")
        if self.fp8 is None:
            return
        if not torch.cuda.is_available():
            raise ValueError(f"precision.fp8={self.fp8!r}: FP8 needs a CUDA GPU; use fp8: null on CPU")
        if not transformer_engine_available():
            raise ValueError(f"precision.fp8={self.fp8!r}: FP8 needs Transformer Engine "
                             "(pip install transformer-engine[pytorch])")
        if not self.transformer_engine:
            raise ValueError(f"precision.fp8={self.fp8!r}: FP8 needs transformer_engine: true")
        if self.dtype != "bf16":
            raise ValueError(f"precision.fp8={self.fp8!r}: FP8 training expects dtype bf16, got {self.dtype!r}")
        supported, reason = fp8_recipe_support(self.fp8_recipe)
        if not supported:
            major, minor = torch.cuda.get_device_capability()
            raise ValueError(f"precision.fp8_recipe={self.fp8_recipe!r}: Transformer Engine cannot run it on this "
                             f"GPU (compute capability {major}.{minor}, CUDA {torch.version.cuda}): {reason}")


@dataclass
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
    lr_decay_style: str = "constant"
    # None: the distributed (sharded) optimizer on GPU, the plain one on CPU.
    use_distributed_optimizer: Optional[bool] = None

    def __post_init__(self):
        _require(self.lr > 0, "optim.lr", "> 0", self.lr)
        _require(0 <= self.min_lr <= self.lr, "optim.min_lr", f"in [0, lr={self.lr}]", self.min_lr)
        _require(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)
        for name in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, name) < 1, f"optim.{name}", "in [0, 1)", getattr(self, name))
        _require(self.adam_eps > 0, "optim.adam_eps", "> 0", self.adam_eps)
        _require(self.clip_grad >= 0, "optim.clip_grad", ">= 0", self.clip_grad)
        _require(self.lr_warmup_steps >= 0, "optim.lr_warmup_steps", ">= 0", self.lr_warmup_steps)
        _require(self.lr_decay_steps > self.lr_warmup_steps, "optim.lr_decay_steps",
                 f"> lr_warmup_steps={self.lr_warmup_steps}", self.lr_decay_steps)
        _require_choice(self.lr_decay_style, LR_DECAY_STYLES, "optim.lr_decay_style")
        if self.use_distributed_optimizer is None:
            self.use_distributed_optimizer = torch.cuda.is_available()


@dataclass
class LossConfig:
    """Clipped policy-gradient loss with an optional k3 KL penalty to a frozen reference."""

    ratio_clip_low: float = 0.2
    ratio_clip_high: float = 0.2
    loss_agg_mode: str = "token_mean"
    kl_coef: float = 0.0
    # Truncated importance sampling of the rollout/training mismatch: each token's policy-gradient
    # term is weighted by min(exp(old_logprob - rollout_logprob), tis_cap), the old logprobs being
    # the policy's own (verl: rollout_is_threshold; NeMo-RL: truncated_importance_sampling_ratio).
    # None: off. The TIS paper and verl use 2.
    tis_cap: Optional[float] = None

    def __post_init__(self):
        _require(self.ratio_clip_low >= 0, "loss.ratio_clip_low", ">= 0", self.ratio_clip_low)
        _require(self.ratio_clip_high >= 0, "loss.ratio_clip_high", ">= 0", self.ratio_clip_high)
        _require_choice(self.loss_agg_mode, LOSS_AGG_MODES, "loss.loss_agg_mode")
        _require(self.kl_coef >= 0, "loss.kl_coef", ">= 0", self.kl_coef)
        if self.tis_cap is not None:
            _require(self.tis_cap > 0, "loss.tis_cap", "> 0 or null", self.tis_cap)


@dataclass
class PolicyConfig:
    """Everything the policy worker needs."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig.preset("tiny"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    micro_batch_size: int = 1  # sequences per forward-backward micro-batch
    # When set, micro-batches are formed by this budget of tokens (padding included) instead:
    # rows sorted by length, each micro-batch cut to its longest row; micro_batch_size is unused.
    micro_batch_tokens: Optional[int] = None
    ppo_epochs: int = 1  # optimizer passes over each batch
    # The PPO ratio's old logprobs. "policy": the policy's own before the update, so the ratio
    # starts at 1 and only the policy's kernels enter it (with ppo_epochs > 1 one extra forward
    # pass; with one epoch the training pass's logprobs, detached, at no cost); "rollout": the
    # rollout engine's sampling logprobs, which is sound only where both engines compute the
    # same numbers (fp32 on CPU: ~1e-7 apart). None: "policy",
    # except with fp32 parameters on a machine without CUDA and no loss.tis_cap.
    old_logprobs: Optional[str] = None
    # While the rollout engine generates: free megatron's gradient buffers and move the optimizer
    # state (Adam moments, fp32 master weights) to host memory; train_step brings them back.
    offload_grads_and_optimizer: bool = False
    temperature: float = 1.0  # the rollouts' sampling temperature; logits are divided by it
    seed: int = 1234

    def __post_init__(self):
        _require(self.temperature > 0, "temperature", "> 0", self.temperature)
        _require(self.micro_batch_size >= 1, "micro_batch_size", ">= 1", self.micro_batch_size)
        _require(self.micro_batch_tokens is None or self.micro_batch_tokens >= 1, "micro_batch_tokens",
                 "None or >= 1", self.micro_batch_tokens)
        _require(self.ppo_epochs >= 1, "ppo_epochs", ">= 1", self.ppo_epochs)
        if self.old_logprobs is None:
            same_numerics = (not torch.cuda.is_available() and self.precision.dtype == "fp32"
                             and self.loss.tis_cap is None)
            self.old_logprobs = "rollout" if same_numerics else "policy"
        _require_choice(self.old_logprobs, OLD_LOGPROB_SOURCES, "policy.old_logprobs")
        if self.loss.tis_cap is not None and self.old_logprobs != "policy":
            raise ValueError("policy.loss.tis_cap: truncated importance sampling weighs the policy's old logprobs "
                             "against the rollout engine's; it needs old_logprobs: policy")
        if (self.offload_grads_and_optimizer and self.precision.dtype == "fp32"
                and not self.optim.use_distributed_optimizer):
            raise ValueError("policy.offload_grads_and_optimizer: with fp32 parameters and the plain optimizer, "
                             "megatron's optimizer holds the model's own parameters, which the weight sync needs on "
                             "the GPU; use precision.dtype: bf16 or optim.use_distributed_optimizer: true")

    def validate(self, world_size: int) -> None:
        """Check the sections against each other and this machine; raise on the first problem."""
        check_model_parallel(self.model, self.parallel)
        self.parallel.data_parallel_size(world_size)
        self.precision.check_runtime()

    def sequence_multiple(self) -> int:
        """Every batch's sequence length must be a multiple of this (pad the batch to it).

        Sequence parallelism splits the sequence over the TP ranks. Transformer Engine checks
        FP8 GEMM inputs on each rank's *local* slice, ``tokens = (T / TP if SP else T) x rows``:
        ``assert_dim_for_fp8_exec`` wants ``tokens % 8 == 0`` for every recipe, an MXFP8 tensor
        ``tokens % 32 == 0`` (``MXFP8Quantizer.make_empty``), and under sequence parallelism
        the quantized input that the column-parallel layers all-gather must be quantizable
        (``Float8BlockQuantizer.is_quantizable``: ``tokens % 128 == 0`` for blockwise). A
        multiple of the split times that count holds for any number of rows per micro-batch.
        """
        split = self.parallel.tensor_model_parallel_size if self.parallel.sequence_parallel else 1
        tokens = 1
        if self.precision.fp8:
            tokens = {"mxfp8": 32, "blockwise": 128 if self.parallel.sequence_parallel else 8}.get(
                self.precision.fp8_recipe, 8)
        return split * tokens


def check_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise unless ``model`` splits evenly under ``parallel``."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    _require(model.num_attention_heads % tp == 0, "model.num_attention_heads",
             f"a multiple of parallel.tensor_model_parallel_size={tp}", model.num_attention_heads)
    _require(model.num_query_groups % tp == 0, "model.num_query_groups",
             f"a multiple of parallel.tensor_model_parallel_size={tp}", model.num_query_groups)
    _require(model.ffn_hidden_size % tp == 0, "model.ffn_hidden_size",
             f"a multiple of parallel.tensor_model_parallel_size={tp}", model.ffn_hidden_size)
    _require(model.num_layers % pp == 0, "model.num_layers",
             f"a multiple of parallel.pipeline_model_parallel_size={pp}", model.num_layers)
