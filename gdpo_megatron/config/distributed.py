"""How long the ranks of a run wait for each other."""
from __future__ import annotations

from datetime import timedelta

from gdpo_megatron.config.loader import require, section


@section
class DistributedConfig:
    """``timeout_s``: how long a rank waits for the others, to form the process group and in each
    collective. A lost peer (a host that died, a link that went down, a hung rank) ends the run
    on every rank left after at most this long; torch's own default is 30 minutes (10 with NCCL).

    It must exceed the longest time ranks legitimately wait for each other: the spread of
    generation and reward scoring between data-parallel replicas in a step, and start-up
    (loading the model, starting vLLM) on the slowest host.
    """

    timeout_s: float = 600.0

    def __post_init__(self):
        require(self.timeout_s > 0, "distributed.timeout_s", "> 0 seconds", self.timeout_s)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)
