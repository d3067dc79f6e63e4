"""Process groups and launch (torchrun, Slurm), collectives, and the all-reduce advantage reduction."""
