"""A test's process placed the way a launch places a rank: the machine decided once, the CPU
shim installed for it, the rank's device (see ``gdpo_megatron.distributed.launch``)."""
import os


def this_rank():
    """This process's :class:`~gdpo_megatron.device.Placement` (``LOCAL_RANK``, else 0), with
    ``policy.cpu_compat`` installed for its machine."""
    from gdpo_megatron.device import place_rank, this_machine
    from gdpo_megatron.policy import cpu_compat

    machine = this_machine()
    cpu_compat.install(machine)
    return place_rank(machine, int(os.environ.get("LOCAL_RANK", "0")))
