#!/bin/bash
# GDPO tool calling on a 32B Qwen2-shaped model (configs/gdpo_32b_multinode.yaml) over 4 nodes:
# one task per GPU, policy TP 8 inside each node x DP 4 across the nodes, vLLM colocated. From
# the repository root on the shared filesystem, with the environment activated (the job
# inherits it) or inside the image built from the Dockerfile:
#   gdpo-plan --config configs/gdpo_32b_multinode.yaml --nodes 4 --gpus-per-node 8 --gpu-memory 79.2
#   sbatch slurm/gdpo_32b_multinode.sh [key.sub=value ...]
# Checkpoints and metrics go to runs/<job name>-<job id> (RUN_DIR=... to choose), which every
# node must see: a shared filesystem. A requeued job keeps its id and resumes there. A lost
# host, resuming on fewer nodes, the network settings below: docs/cluster.md.
#
#SBATCH --job-name=gdpo-32b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
# Fifteen minutes to finish the step in flight and write a checkpoint (weights + Adam state of
# 32B parameters, ~390 GB, to the shared filesystem).
#SBATCH --signal=USR1@900

set -uo pipefail

# The network between the nodes. The ranks meet at the first node of the job (its host name must
# resolve on every node, else export MASTER_ADDR); NCCL carries the GPUs' traffic, gloo a few
# CPU-side collectives. Both pick an interface by themselves, which on hosts with several
# (management Ethernet, InfiniBand, docker bridges) may be one the other nodes cannot reach:
# name it in the cluster's environment, e.g.
#   export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0    (or ^lo,docker: any but these)
#   export NCCL_IB_HCA=mlx5                                  (InfiniBand adapters for NCCL)
source slurm/launch.sh
use_gpu_environment
launch_training configs/gdpo_32b_multinode.yaml "$@"
