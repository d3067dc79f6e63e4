"""A trainer built the way ``gdpo-train`` builds one, inside a test's process group (placed, the
CPU shim installed)."""


def make_trainer(config):
    """The :class:`~gdpo_megatron.trainer.Trainer` of ``config`` on this rank, its inputs
    checked and read by preflight first (on every rank, as ``gdpo-train`` does)."""
    import torch.distributed as dist

    from gdpo_megatron.preflight.validation import check_training
    from gdpo_megatron.trainer import Trainer
    from support.placement import this_rank

    placement = this_rank()
    return Trainer(config, check_training(config, placement.machine, dist.get_world_size()), placement)
