"""The console commands, thin: parse the arguments, run preflight's checks, call the core.

``gdpo-train``, ``gdpo-eval``, ``gdpo-convert``, ``gdpo-plan``, ``gdpo-doctor`` and
``gdpo-plot``; ``python -m gdpo_megatron COMMAND`` runs the same (under torchrun, say).
"""
