"""Where each weight of a Llama-family model (Llama, Qwen2) lives in Hugging Face and in Megatron.

Pure tensor functions, no process groups. A *full* Megatron tensor is the tensor a
tensor-parallel size of 1 would hold; :func:`tp_shard` / :func:`tp_unshard` move between it
and the per-rank shards. Megatron names use the global layer index and may follow either
megatron-core layer spec:

* local spec (CPU): ``input_layernorm.weight``, ``pre_mlp_layernorm.weight``;
* Transformer Engine spec (GPU): the norms fused into the next linear,
  ``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``.

Layouts (out features first, as in ``nn.Linear``):

* QKV: Megatron interleaves per query group, ``[num_query_groups, (q_per_group + 2) * head_dim,
  hidden]``: the group's query heads, then its key head, then its value head (bias likewise).
* SwiGLU: Megatron fuses ``[gate; up]`` into ``linear_fc1``; each tensor-parallel shard holds
  ``[gate_shard; up_shard]``.
* Vocabulary: Megatron pads the rows to a multiple of the tensor-parallel size (and more);
  the padding rows are zero and dropped on export.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from gdpo_megatron.config.policy import ModelConfig


@dataclass(frozen=True)
class ModelLayout:
    """The sizes a conversion needs; the rest of the architecture is irrelevant to it."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # Hugging Face rows (the tokenizer's vocabulary)
    padded_vocab_size: int  # Megatron rows, >= vocab_size
    tie_word_embeddings: bool

    def __post_init__(self):
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size ({self.padded_vocab_size}) must be >= vocab_size ({self.vocab_size})"
            )


def model_layout(config: ModelConfig, tp_size: int) -> ModelLayout:
    """The sizes the layout functions need, for ``config`` at tensor-parallel size ``tp_size``."""
    return ModelLayout(
        num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        padded_vocab_size=config.padded_vocab_size(tp_size),
        tie_word_embeddings=config.tie_word_embeddings,
    )


# --- pure layout transforms on full tensors ---------------------------------------------------


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, layout: ModelLayout) -> Tensor:
    """Hugging Face ``q_proj``/``k_proj``/``v_proj`` (weights or biases) -> Megatron ``linear_qkv``."""
    groups, d = layout.num_query_groups, layout.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, layout: ModelLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron ``linear_qkv`` -> Hugging Face ``(q_proj, k_proj, v_proj)``."""
    groups, d = layout.num_query_groups, layout.head_dim
    q_rows = layout.num_attention_heads // groups * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, q_rows + 2 * d, *rest).split([q_rows, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def pad_vocab(weight: Tensor, layout: ModelLayout) -> Tensor:
    """Hugging Face embedding / head rows -> Megatron rows (zero padding at the end)."""
    if weight.shape[0] != layout.vocab_size:
        raise ValueError(f"vocabulary rows: expected {layout.vocab_size}, got {weight.shape[0]}")
    return torch.nn.functional.pad(weight, (0, 0, 0, layout.padded_vocab_size - layout.vocab_size))


def unpad_vocab(weight: Tensor, layout: ModelLayout) -> Tensor:
    """Megatron embedding / head rows -> Hugging Face rows."""
    return weight[: layout.vocab_size]


def _identity(t: Tensor, layout: ModelLayout) -> Tensor:
    return t


def _merge_gate_up(gate: Tensor, up: Tensor, layout: ModelLayout) -> Tensor:
    return torch.cat([gate, up])


def _split_gate_up(fc1: Tensor, layout: ModelLayout) -> tuple[Tensor, Tensor]:
    return tuple(fc1.chunk(2))


# --- name mapping ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """How one Megatron parameter maps to Hugging Face tensors.

    ``to_megatron(*hf_tensors, layout)`` and ``to_hf(full, layout)`` are inverse; ``tp_dim``
    is the dimension Megatron splits over tensor-parallel ranks (None: replicated) and
    ``gated`` marks the fused SwiGLU input whose gate and up halves are split separately.
    """

    megatron: str  # regex over the Megatron name, group 1 = global layer index where present
    hf: tuple[str, ...]  # Hugging Face name templates ({layer} = layer index)
    to_megatron: Callable[..., Tensor]
    to_hf: Callable[[Tensor, ModelLayout], Tensor | tuple[Tensor, ...]]
    tp_dim: int | None = None
    gated: bool = False


_LAYER = r"decoder\.layers\.(\d+)\."
_ATTN = "model.layers.{layer}.self_attn."
_MLP = "model.layers.{layer}.mlp."

RULES: tuple[Rule, ...] = (
    Rule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), pad_vocab, unpad_vocab, 0),
    Rule(r"output_layer\.weight", ("lm_head.weight",), pad_vocab, unpad_vocab, 0),
    Rule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",), _identity, _identity),
    Rule(
        _LAYER + r"(?:input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)",
        ("model.layers.{layer}.input_layernorm.weight",),
        _identity,
        _identity,
    ),
    Rule(
        _LAYER + r"self_attention\.linear_qkv\.weight",
        (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
        merge_qkv,
        split_qkv,
        0,
    ),
    Rule(
        _LAYER + r"self_attention\.linear_qkv\.bias",
        (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"),
        merge_qkv,
        split_qkv,
        0,
    ),
    Rule(_LAYER + r"self_attention\.linear_proj\.weight", (_ATTN + "o_proj.weight",), _identity, _identity, 1),
    Rule(
        _LAYER + r"(?:pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)",
        ("model.layers.{layer}.post_attention_layernorm.weight",),
        _identity,
        _identity,
    ),
    Rule(
        _LAYER + r"mlp\.linear_fc1\.weight",
        (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"),
        _merge_gate_up,
        _split_gate_up,
        0,
        gated=True,
    ),
    Rule(_LAYER + r"mlp\.linear_fc2\.weight", (_MLP + "down_proj.weight",), _identity, _identity, 1),
)
_COMPILED = tuple((re.compile(rule.megatron), rule) for rule in RULES)


def rule_for(megatron_name: str) -> tuple[Rule, tuple[str, ...]]:
    """The rule for a Megatron parameter and the Hugging Face names it maps to."""
    for pattern, rule in _COMPILED:
        match = pattern.fullmatch(megatron_name)
        if match:
            layer = match.group(1) if match.groups() else None
            return rule, tuple(name.format(layer=layer) for name in rule.hf)
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {megatron_name!r}")


def to_hf(megatron_name: str, full: Tensor, layout: ModelLayout) -> list[tuple[str, Tensor]]:
    """A full Megatron tensor -> its ``(hf_name, tensor)`` pairs."""
    rule, hf_names = rule_for(megatron_name)
    tensors = rule.to_hf(full, layout)
    if isinstance(tensors, Tensor):
        tensors = (tensors,)
    return list(zip(hf_names, tensors))


def to_megatron(megatron_name: str, hf_tensors: Sequence[Tensor], layout: ModelLayout) -> Tensor:
    """The Hugging Face tensors named by :func:`rule_for` -> the full Megatron tensor."""
    rule, _ = rule_for(megatron_name)
    return rule.to_megatron(*hf_tensors, layout)


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor a Hugging Face checkpoint of this model holds."""
    h, f = config.hidden_size, config.ffn_hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_query_groups * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    projections = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    for layer in range(config.num_layers):
        attn, mlp = _ATTN.format(layer=layer), _MLP.format(layer=layer)
        shapes[f"model.layers.{layer}.input_layernorm.weight"] = (h,)
        shapes[f"model.layers.{layer}.post_attention_layernorm.weight"] = (h,)
        shapes.update({f"{attn}{p}.weight": (rows, h) for p, rows in projections.items()})
        shapes[f"{attn}o_proj.weight"] = (h, q)
        if config.add_qkv_bias:
            shapes.update({f"{attn}{p}.bias": (rows,) for p, rows in projections.items()})
        shapes.update({f"{mlp}gate_proj.weight": (f, h), f"{mlp}up_proj.weight": (f, h),
                       f"{mlp}down_proj.weight": (h, f)})
    return shapes


# --- tensor parallelism ------------------------------------------------------------------------


def tp_shard(megatron_name: str, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """The slice of a full Megatron tensor that tensor-parallel rank ``tp_rank`` holds."""
    rule, _ = rule_for(megatron_name)
    if rule.tp_dim is None or tp_size == 1:
        return full
    if full.shape[rule.tp_dim] % (2 * tp_size if rule.gated else tp_size):
        raise ValueError(
            f"{megatron_name}: dimension {rule.tp_dim} of shape {tuple(full.shape)} "
            f"does not split over {tp_size} tensor-parallel ranks"
        )
    if rule.gated:
        return torch.cat([half.chunk(tp_size, rule.tp_dim)[tp_rank] for half in full.chunk(2, rule.tp_dim)], rule.tp_dim)
    return full.chunk(tp_size, rule.tp_dim)[tp_rank]


def tp_unshard(megatron_name: str, shards: Sequence[Tensor]) -> Tensor:
    """The full Megatron tensor from the shards of every tensor-parallel rank, in rank order."""
    rule, _ = rule_for(megatron_name)
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    if rule.gated:
        halves = [shard.chunk(2, rule.tp_dim) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], rule.tp_dim)
    return torch.cat(list(shards), rule.tp_dim)


def tp_full_shape(megatron_name: str, shard_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
    """The shape of the full tensor whose tensor-parallel shards have ``shard_shape``."""
    rule, _ = rule_for(megatron_name)
    shape = list(shard_shape)
    if rule.tp_dim is not None:
        shape[rule.tp_dim] *= tp_size
    return tuple(shape)
