"""Hugging Face ``config.json`` <-> the policy's :class:`ModelConfig` (Llama and Qwen2)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gdpo_megatron.errors import InputError
from gdpo_megatron.config.policy import ModelConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# Settings the Megatron model does not implement: (key, the only supported value).
_UNSUPPORTED = (
    ("hidden_act", "silu"),
    ("attention_bias", False),
    ("mlp_bias", False),
    ("use_sliding_window", False),
    ("rope_scaling", None),
)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_hf_config(hf_dir: str | Path) -> dict:
    """The ``config.json`` of a Hugging Face model directory."""
    path = Path(hf_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: missing (expected a Hugging Face model directory)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def architecture_of(hf_config: dict) -> str:
    """``LlamaForCausalLM`` or ``Qwen2ForCausalLM``; raise for anything else."""
    archs = hf_config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        model_type = hf_config.get("model_type")
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        if not archs and model_type in by_type:
            return by_type[model_type]
        raise InputError(f"config.json architectures: expected one of {sorted(ARCHITECTURES)}, got {archs!r} "
                         "(only these families convert to Megatron)")
    return archs[0]


def _rope_theta(hf_config: dict) -> float:
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise InputError(f"config.json rope_parameters.rope_type: only 'default' is supported, "
                         f"got {rope['rope_type']!r}")
    return float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)))


def model_config_from_hf(hf_config: dict, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama / Qwen2 ``config.json``."""
    arch = architecture_of(hf_config)
    for key, supported in _UNSUPPORTED:
        if hf_config.get(key, supported) != supported:
            raise InputError(f"config.json {key}: only {supported!r} is supported, got {hf_config[key]!r}")
    missing = [key for key in _REQUIRED if key not in hf_config]
    if missing:
        raise InputError(f"config.json: missing {', '.join(map(repr, missing))}")
    heads = hf_config["num_attention_heads"]
    fields = dict(
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
        rotary_base=_rope_theta(hf_config),
        norm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
        add_qkv_bias=arch == "Qwen2ForCausalLM",
    )
    try:
        return ModelConfig(**{**fields, **overrides})
    except ValueError as e:
        raise InputError(f"config.json: {e}") from None


def hf_config_from_model(model: ModelConfig, base: dict | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """A ``config.json`` for ``model`` with weights in ``dtype``: ``base`` (e.g. the imported
    one) with the shape fields set, written by the installed transformers' config class.

    Without ``base`` the architecture is Qwen2 when the model has QKV biases, else Llama.
    """
    import transformers

    arch = architecture_of(base) if base else ("Qwen2ForCausalLM" if model.add_qkv_bias else "LlamaForCausalLM")
    if model.add_qkv_bias != (arch == "Qwen2ForCausalLM"):
        raise ValueError(f"model.add_qkv_bias={model.add_qkv_bias} does not fit architecture {arch}")
    derived = ("transformers_version", "architectures", "rope_parameters", "rope_theta", "layer_types",
               "dtype", "torch_dtype")
    base = {k: v for k, v in (base or {}).items() if k not in derived}
    config = transformers.CONFIG_MAPPING[ARCHITECTURES[arch]](**{
        **base,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "max_position_embeddings": model.max_position_embeddings,
        "rope_theta": model.rotary_base,
        "rms_norm_eps": model.norm_epsilon,
        "tie_word_embeddings": model.tie_word_embeddings,
        "architectures": [arch],
        "torch_dtype": str(dtype).removeprefix("torch."),  # transformers 5 stores it as "dtype"
    })
    return config.to_dict()
