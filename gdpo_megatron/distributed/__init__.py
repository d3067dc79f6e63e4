"""Process groups, local launch, and the all-reduce form of the advantage math."""
from gdpo_megatron.distributed.advantages import AllReduce, compute_advantages

__all__ = ["AllReduce", "compute_advantages"]
