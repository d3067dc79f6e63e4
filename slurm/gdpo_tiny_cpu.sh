#!/bin/bash
# The tiny CPU run (configs/tiny_cpu.yaml) as a Slurm job: 2 tasks on one node, gloo.
# Same structure as gdpo_7b.sh; useful to check a cluster's Slurm set-up without GPUs.
#
# From the repository root, with the environment activated (the job inherits it):
#   sbatch slurm/gdpo_tiny_cpu.sh [key.sub=value ...]
# The base model is configs/tiny_cpu.yaml's base_model (`make demo` writes it once) unless
# given: sbatch slurm/gdpo_tiny_cpu.sh base_model=DIR steps=2
# Another CPU config, named first: sbatch slurm/gdpo_tiny_cpu.sh --config configs/multi_turn_cpu.yaml
#
#SBATCH --job-name=gdpo-tiny-cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=USR1@120

set -uo pipefail

# Several processes share few cores: one OpenMP thread each (the default is ~100x slower).
export OMP_NUM_THREADS=1

source slurm/launch.sh
launch_training configs/tiny_cpu.yaml "$@"
