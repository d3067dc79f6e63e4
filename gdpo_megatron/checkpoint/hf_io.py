"""Read a Hugging Face model directory into a Megatron model, and write one from it.

Both directions work at any TP/PP and are collective over the model-parallel group. Import
reads, on each rank, only the tensors its shard needs (lazily from the safetensors files);
export streams :func:`iter_hf_weights` and rank 0 writes safetensors shards, ``config.json``,
``generation_config.json`` and the tokenizer files, into a temporary directory renamed when
complete.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from gdpo_megatron.checkpoint.hf_config import hf_config_from_model
from gdpo_megatron.checkpoint.hf_files import (
    INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES, check_tensors, safetensors_index,
)
from gdpo_megatron.checkpoint.layout import hf_shapes, model_layout, rule_for, to_megatron, tp_shard
from gdpo_megatron.checkpoint.weight_stream import iter_hf_weights, megatron_params
from gdpo_megatron.config.policy import ModelConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, config: ModelConfig, hf_dir: str | Path, progress: bool = False) -> None:
    """Copy the weights of a Hugging Face directory into this rank's shard of ``model``."""
    hf_dir = Path(hf_dir)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    layout = model_layout(config, tp_size)
    index, shapes = safetensors_index(hf_dir)
    check_tensors(index, shapes, hf_shapes(config), hf_dir, config.tie_word_embeddings)

    params = megatron_params(model, tie_word_embeddings=False)  # a tied output layer loads the embedding
    with contextlib.ExitStack() as stack:
        files = {}

        def read(name: str) -> torch.Tensor:
            path = index[name]
            if path not in files:
                files[path] = stack.enter_context(safe_open(path, framework="pt"))
            return files[path].get_tensor(name)

        for megatron_name, param in tqdm(params, desc="import", disable=not progress or _rank() != 0):
            _, names = rule_for(megatron_name)
            if config.tie_word_embeddings and megatron_name == "output_layer.weight":
                names = ("model.embed_tokens.weight",)
            full = to_megatron(megatron_name, [read(n) for n in names], layout)
            shard = tp_shard(megatron_name, full, tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(f"{hf_dir}: {', '.join(names)} gives {megatron_name} of shape "
                                 f"{tuple(shard.shape)} on this rank, the model has {tuple(param.shape)}")
            param.copy_(shard)


def _write_shards(weights: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int) -> None:
    """Safetensors files of at most ``max_shard_bytes`` (a larger single tensor gets its own),
    named like ``save_pretrained`` names them, with an index when there are several."""
    shard_names: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total_bytes = 0

    def flush():
        save_file(current, out / f".shard-{len(shard_names)}.safetensors", metadata={"format": "pt"})
        shard_names.append(list(current))
        current.clear()

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
            current_bytes = 0
        current[name] = tensor
        current_bytes += nbytes
        total_bytes += nbytes
    flush()

    if len(shard_names) == 1:
        os.rename(out / ".shard-0.safetensors", out / SINGLE_FILE)
        return
    weight_map = {}
    for i, names in enumerate(shard_names):
        final = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
        os.rename(out / f".shard-{i}.safetensors", out / final)
        weight_map.update({name: final for name in names})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _write_generation_config(hf_config: dict, out: Path) -> None:
    import transformers

    generation = transformers.GenerationConfig(
        **{k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None}
    )
    generation.save_pretrained(out)


def save_hf_checkpoint(
    model: torch.nn.Module,
    config: ModelConfig,
    out_dir: str | Path,
    *,
    base_hf_config: dict | None = None,
    tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face directory at ``out_dir`` (collective; rank 0 writes).

    ``base_hf_config`` (e.g. the imported ``config.json``) supplies the fields the model config
    does not hold (token ids, ...); ``tokenizer_dir`` the tokenizer files to copy (and its
    ``generation_config.json`` when it has one). ``dtype`` converts the weights (default: the
    parameters' dtype).
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty")
    if dist.is_initialized():
        dist.barrier()  # every rank has checked before rank 0 creates anything
    stream = iter_hf_weights(model, config)
    if _rank() == 0:
        total = len(hf_shapes(config))
        weights = ((name, tensor.detach().to("cpu", dtype or tensor.dtype).clone())
                   for name, tensor in tqdm(stream, total=total, desc="export", disable=not progress))
        hf_config = hf_config_from_model(config, base_hf_config, dtype or next(model.parameters()).dtype)
        _write_hf_dir(weights, hf_config, out, tokenizer_dir, max_shard_bytes)
    else:
        for _ in stream:  # take part in the gathers
            pass
    if dist.is_initialized():
        dist.barrier()
    return out


def _write_hf_dir(weights, hf_config: dict, out: Path, tokenizer_dir: str | Path | None, max_shard_bytes: int) -> None:
    """Everything into a temporary sibling directory, renamed to ``out`` when complete."""
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_shards(weights, tmp, max_shard_bytes)
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else None
    if tokenizer_dir and (tokenizer_dir / "generation_config.json").is_file():
        shutil.copy2(tokenizer_dir / "generation_config.json", tmp)
    else:
        _write_generation_config(hf_config, tmp)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, tmp)
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
