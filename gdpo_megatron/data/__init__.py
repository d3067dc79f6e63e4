"""Prompt datasets (JSONL for math, tool calling and code; BFCL) and chat rendering."""
from gdpo_megatron.data.bfcl import CATEGORIES as BFCL_CATEGORIES
from gdpo_megatron.data.bfcl import bfcl_accuracy, load_bfcl
from gdpo_megatron.data.chat import encode_prompt, render_prompt
from gdpo_megatron.data.samples import FAMILIES, Sample, load_jsonl

__all__ = [
    "BFCL_CATEGORIES", "FAMILIES", "Sample", "bfcl_accuracy", "encode_prompt", "load_bfcl", "load_jsonl",
    "render_prompt",
]
