"""Known and harmless messages of megatron-core and the rollout engines, filtered where they arise.

Each filter names why its message is harmless in this trainer: :data:`PYTHON_WARNINGS` here,
the log records of each engine's library in its ``HARMLESS_LOG_RECORDS``. Anything else the
libraries print stays, warnings of a real problem among it (e.g. vLLM's "Failed to load weights" for any
layer but the rotary embedding, whose cache no checkpoint holds). :func:`install` is called by
the commands before the libraries are imported; it is idempotent.
"""
from __future__ import annotations

import logging
import warnings

from gdpo_megatron.rollout.factory import ENGINES

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
    (r"Please use DTensor instead and we are deprecating ShardedTensor",
     "megatron-core's distributed checkpoints are made of torch's ShardedTensor; torch's successor, DTensor, "
     "is not what they hold"),
)


class _DropKnown(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


_installed = False


def install() -> None:
    """Filter :data:`PYTHON_WARNINGS` and every engine's ``HARMLESS_LOG_RECORDS`` in this process."""
    global _installed
    if _installed:
        return
    for pattern, _ in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, start, _ in (record for engine in ENGINES.values() for record in engine.HARMLESS_LOG_RECORDS):
        by_logger[name] = by_logger.get(name, ()) + (start,)
    for name, starts in by_logger.items():
        logging.getLogger(name).addFilter(_DropKnown(starts))
    _installed = True
