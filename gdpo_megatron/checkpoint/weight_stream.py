"""Stream a Megatron model's weights as full Hugging Face tensors, gathered over TP and PP.

:func:`iter_hf_weights` is what both the Hugging Face export and the weight sync to the
rollout engine consume (``engine.update_weights(iter_hf_weights(model, config))``). It holds
one full Megatron tensor at a time per rank, so memory stays bounded by the largest weight.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from gdpo_megatron.checkpoint.layout import model_layout, to_hf, tp_full_shape, tp_unshard
from gdpo_megatron.config.policy import ModelConfig

_LAYER_PREFIX = re.compile(r"decoder\.layers\.(\d+)\.")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def megatron_params(model: torch.nn.Module, tie_word_embeddings: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters under their global Megatron names (layer index over all stages).

    The last stage's copy of a tied output layer is left out: it equals the embedding.
    """
    gpt = unwrap(model)
    global_index = {str(i): layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}
    params = []
    for name, param in gpt.named_parameters():
        if tie_word_embeddings and name == "output_layer.weight":
            continue
        name = _LAYER_PREFIX.sub(lambda m: f"decoder.layers.{global_index[m.group(1)]}.", name, count=1)
        params.append((name, param))
    return params


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every weight of the model, on every rank (collective).

    Every rank of the model-parallel group must consume the whole iterator. Tensors keep the
    parameters' dtype and device and may share memory with them (copy before the next
    optimizer step if you keep them).
    """
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    layout = model_layout(config, tp_size)

    local = megatron_params(model, config.tie_word_embeddings)
    entries = [(name, tuple(p.shape), p.dtype) for name, p in local]
    stages = [entries]
    if pp_size > 1:  # every stage learns the names and shapes of the others'
        stages = [None] * pp_size
        dist.all_gather_object(stages, entries, group=pp_group)
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else None
    device = local[0][1].device if local else torch.device("cpu")

    for stage, stage_entries in enumerate(stages):
        for index, (name, shard_shape, dtype) in enumerate(stage_entries):
            if stage == pp_rank:
                shard = local[index][1].detach()
                if tp_size > 1:
                    shards = [torch.empty_like(shard) for _ in range(tp_size)]
                    dist.all_gather(shards, shard.contiguous(), group=tp_group)
                    full = tp_unshard(name, shards)
                else:
                    full = shard
            else:
                full = torch.empty(tp_full_shape(name, shard_shape, tp_size), dtype=dtype, device=device)
            if pp_size > 1:
                full = full.contiguous()
                dist.broadcast(full, src=pp_ranks[stage], group=pp_group)
            yield from to_hf(name, full, layout)
