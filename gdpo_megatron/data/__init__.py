"""Prompt datasets (published layouts for math, tool calling, code and ToolRL; BFCL) and chat rendering."""
from gdpo_megatron.data.bfcl import CATEGORIES as BFCL_CATEGORIES
from gdpo_megatron.data.bfcl import bfcl_accuracy, load_bfcl
from gdpo_megatron.data.chat import encode_prompt, render_prompt
from gdpo_megatron.data.samples import Fields, Sample, load_samples

__all__ = [
    "BFCL_CATEGORIES", "Fields", "Sample", "bfcl_accuracy", "encode_prompt", "load_bfcl",
    "load_samples", "render_prompt",
]
