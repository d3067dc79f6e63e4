"""Test support, not shipped with the package: local gloo worlds, tiny model checkpoints, real Slurm clusters."""
