#!/bin/bash
# GDPO tool calling on a 7B Qwen2-shaped model (configs/gdpo_7b.yaml): one node, one task per
# GPU, policy TP 2 x DP 4 with vLLM colocated. From the repository root, with the environment
# activated (the job inherits it) or inside the image built from the Dockerfile:
#   gdpo-plan --config configs/gdpo_7b.yaml --gpus-per-node 8 --gpu-memory 79.2
#   sbatch slurm/gdpo_7b.sh [key.sub=value ...]       e.g. policy.precision.fp8=hybrid
# Checkpoints and metrics go to runs/<job name>-<job id> (RUN_DIR=... to choose; a requeued job
# keeps its id and resumes there). More nodes: sbatch --nodes=2 slurm/gdpo_7b.sh
# data.prompts_per_step=256 (the data-parallel size grows with the GPUs).
#
#SBATCH --job-name=gdpo-7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
# Ten minutes to finish the step in flight and write a checkpoint (weights + Adam state).
#SBATCH --signal=USR1@600

set -uo pipefail

# Site-specific network choices (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) belong to the cluster's
# own environment (docs/cluster.md).
source slurm/launch.sh
use_gpu_environment
launch_training configs/gdpo_7b.yaml "$@"
