"""Core attention for megatron's local layers: torch's ``scaled_dot_product_attention``.

megatron-core's own local ``DotProductAttention`` materializes the ``[b, heads, s, s]`` scores
and keeps the probabilities for backward: memory quadratic in the sequence length, plus a
process-wide scores buffer of the same size. Transformer Engine's fused attention has none of
that, but TE is GPU-only. This module is the local spec's core attention instead, the same
function as megatron's (causal self-attention, softmax scale ``1 / sqrt(kv_channels)`` unless
the config sets one, grouped-query heads) through a fused kernel whose memory is linear in
the sequence length: flash attention on CPU (any float dtype) and on CUDA in fp16 / bf16, the
memory-efficient kernel on CUDA in fp32 (it has no grouped-query mode, so keys and values are
repeated per query head there, as megatron does).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """Causal self-attention on this tensor-parallel rank's heads, in megatron's
    ``[s, b, heads, head_dim]`` layout; returns ``[s, b, heads * head_dim]``."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, **_):
        super().__init__(config=config)
        unsupported = {
            "attention_type": attention_type != "self",
            "attn_mask_type": attn_mask_type != AttnMaskType.causal,
            "attention_dropout": (config.attention_dropout if attention_dropout is None else attention_dropout) != 0,
            "context_parallel_size": config.context_parallel_size != 1,
            "window_size": config.window_size is not None,
            "softmax_type": config.softmax_type != "vanilla",
            "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
        }
        for name, bad in unsupported.items():
            if bad:
                raise ValueError(f"SDPAttention: {name} is not supported (causal self-attention without "
                                 "dropout, windows or softmax offsets only)")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if (attention_mask is not None or attention_bias is not None or packed_seq_params is not None
                or attn_mask_type not in (None, AttnMaskType.causal) or query.shape[0] != key.shape[0]):
            raise ValueError("SDPAttention: causal self-attention over the whole sequence only (no "
                             "attention_mask, attention_bias, packed sequences or KV cache)")
        # [s, b, heads, d] -> [b, heads, s, d]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        repeat = query.shape[1] // key.shape[1]
        native_groups = not query.is_cuda or query.dtype in (torch.float16, torch.bfloat16)
        if repeat > 1 and not native_groups:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        context = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.softmax_scale, enable_gqa=key.shape[1] != query.shape[1])
        sequence, batch = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(sequence, batch, -1)
