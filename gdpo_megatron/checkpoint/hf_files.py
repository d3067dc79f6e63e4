"""The safetensors files of a Hugging Face model directory, found and checked from their headers.

Import (:mod:`.hf_io`) and the checks before a run (:mod:`gdpo_megatron.preflight.validation`) share
these, so a missing, truncated or corrupted file is named the same way by both, before any
weight is read. safetensors checks a header against the file's size, so a truncated file is
caught here too.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from gdpo_megatron.errors import InputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The tokenizer's files, copied along with an export.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
# Tensors some checkpoints carry that the model recomputes: skipped on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors in one safetensors file's header; InputError naming the file
    if it is unreadable."""
    try:
        with safe_open(path, framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except (SafetensorError, OSError) as e:
        raise InputError(f"{path}: not a readable safetensors file ({e}); copy or export it again") from None


def safetensors_index(hf_dir: str | Path) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """Tensor name -> the safetensors file holding it, and -> its shape; every file's header is
    read and checked, once."""
    hf_dir = Path(hf_dir)
    index_path = hf_dir / INDEX_FILE
    if not index_path.is_file():
        single = hf_dir / SINGLE_FILE
        if not single.is_file():
            raise InputError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are read)")
        shapes = tensor_shapes(single)
        return {name: single for name in shapes}, shapes
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        index = {name: hf_dir / file for name, file in weight_map.items()}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{index_path}: expected JSON with a 'weight_map' of tensor name -> file ({e})") from None
    shapes = {}
    for path in sorted(set(index.values())):
        if not path.is_file():
            raise InputError(f"{path}: missing (listed in {index_path})")
        held = tensor_shapes(path)
        absent = sorted(name for name, file in index.items() if file == path and name not in held)
        if absent:
            raise InputError(f"{path}: does not hold {absent[0]!r}, which {index_path} places there "
                             f"({len(absent)} such tensors)")
        shapes.update((name, shape) for name, shape in held.items() if index.get(name) == path)
    return index, shapes


def check_tensors(index: dict[str, Path], shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                  hf_dir: Path, tied: bool) -> None:
    """The directory holds every ``expected`` tensor at its shape and nothing else (but what the model recomputes)."""
    missing = [n for n in expected if n not in index]
    if missing:
        raise InputError(f"{hf_dir}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    allowed = set(expected) | ({"lm_head.weight"} if tied else set())
    extra = sorted(n for n in set(index) - allowed if not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise InputError(f"{hf_dir}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all); "
                         "is this a Llama / Qwen2 checkpoint of the configured shape?")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise InputError(f"{index[name]}: tensor {name!r} has shape {list(shapes[name])}, config.json gives "
                             f"{list(shape)}")
