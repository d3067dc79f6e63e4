"""Known and harmless messages of megatron-core and vLLM, filtered where they arise.

Each filter names why its message is harmless in this trainer. Anything else the libraries
print stays, warnings of a real problem among it (e.g. vLLM's "Failed to load weights" for any
layer but the rotary embedding, whose cache no checkpoint holds). :func:`install` is called by
the commands before the libraries are imported; it is idempotent.
"""
from __future__ import annotations

import logging
import warnings

# Python warnings: (message regex, why it is harmless here).
PYTHON_WARNINGS = (
    (r".*(Apex|Transformer Engine).* not installed",
     "megatron-core: without Transformer Engine (always on the CPU) the policy uses torch's norms and "
     "megatron's local layers by design"),
    (r"full scope is deprecated",
     "megatron-core warns about its own default cuda_graph_scope; the policy captures no CUDA graphs"),
    (r"`torch\.distributed\.reduce_op` is deprecated",
     "vLLM reads every attribute of torch.distributed while it looks for kernels"),
    (r"`load_state_dict` is deprecated",
     "megatron-core loads checkpoints through torch's old name for the same function"),
)

# vLLM log records: (logger, start of the message, why it is harmless here).
VLLM_RECORDS = (
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights",
     "the rotary embedding's cos/sin cache is derived from the config, not loaded: vLLM keeps it"),
    ("vllm.engine.arg_utils", "The global random seed is set to",
     "the trainer draws nothing from the global generators once the engine is built: every rollout is "
     "seeded on its own, the data order has its own generator"),
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill",
     "the CPU engine turns chunked prefill off on purpose (see device.Machine.chunked_prefill)"),
    ("vllm.config.vllm", "Enforce eager set", "eager mode is the trainer's choice on the CPU"),
    ("vllm.config.vllm", "Inductor compilation was disabled", "the trainer's choice on the CPU"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", "the CPU build runs the V1 model runner"),
    ("vllm.platforms.cpu", "Triton is not installed", "no Triton kernels run on the CPU"),
    ("vllm.platforms.cpu", "Reset SSM cache type", "no Mamba layers in Llama / Qwen2"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
     "no Triton kernels run on the CPU"),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`",
     "each rank sets its threads before the engine starts (distributed/threads.py)"),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD",
     "a performance hint; CPU runs preload tcmalloc themselves (commands/cpu_malloc.py)"),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD",
     "set GDPO_MALLOC=system or LD_PRELOAD chose the allocator; gdpo-train preloads tcmalloc otherwise"),
)


class _DropKnown(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


_installed = False


def install() -> None:
    """Filter :data:`PYTHON_WARNINGS` and :data:`VLLM_RECORDS` in this process."""
    global _installed
    if _installed:
        return
    for pattern, _ in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, start, _ in VLLM_RECORDS:
        by_logger[name] = by_logger.get(name, ()) + (start,)
    for name, starts in by_logger.items():
        logging.getLogger(name).addFilter(_DropKnown(starts))
    _installed = True
