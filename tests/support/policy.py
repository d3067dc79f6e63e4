"""A policy section resolved as a run resolves it, for policy workers and models built without a run."""
import torch.distributed as dist

from gdpo_megatron.config.policy import PolicyConfig, PrecisionConfig
from gdpo_megatron.device import this_machine
from gdpo_megatron.policy.resolved import ResolvedPolicy
from gdpo_megatron.resolve import resolve_policy, resolve_precision


def resolved_here(policy: PolicyConfig) -> ResolvedPolicy:
    """``policy`` resolved for this machine and the initialized world."""
    return resolve_policy(policy, this_machine(), dist.get_world_size())


def precision_here(precision: PrecisionConfig = PrecisionConfig()) -> PrecisionConfig:
    """``precision`` resolved for this machine."""
    return resolve_precision(precision, this_machine())
