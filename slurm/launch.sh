# Sourced by the sbatch scripts in this directory: run the trainer as one srun step and
# requeue the job when the trainer stopped early to beat the time limit.
#
# Every task resolves its rank, world size, local rank and rendezvous address from the Slurm
# environment itself (gdpo_megatron.distributed.launch), so there is no torchrun.
#
# Time limit and requeue: `#SBATCH --signal=USR1@<seconds>` makes Slurm send SIGUSR1 to the
# tasks (not to this shell) that long before the limit. The trainer finishes its step, saves a
# checkpoint and exits with EXIT_REQUEUE; this script then requeues the job, which keeps
# its id, hence its run directory, and resumes from that checkpoint. SIGTERM (preemption,
# scancel) is handled by the trainer the same way.
#
# Slurm signals every process of the step, not only the trainer: its reward workers and engine
# processes would die of SIGUSR1 (default action: terminate) in the middle of the step the
# trainer wants to finish. So each task starts with SIGUSR1 and SIGTERM ignored, a disposition
# its child processes inherit, and the trainer's loop installs its own handler in the main
# process only. (SIGKILL, after the time limit's KillWait, still ends everything.)

# gdpo_megatron.commands.train.EXIT_REQUEUE ("try again later"): stopped by a signal, checkpoint saved.
EXIT_REQUEUE=75
# gdpo_megatron.commands.train.EXIT_PEER_LOST: a rank lost a peer (a host died or stopped answering).
EXIT_PEER_LOST=69
export PYTHONUNBUFFERED=1                     # log lines reach the job's output file as written
export WANDB_MODE=${WANDB_MODE:-offline}      # compute nodes are often offline; wandb sync later

# NCCL and torch.distributed on GPU nodes (the GPU scripts call it before launch_training).
use_gpu_environment() {
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed collective ends the rank instead of hanging
    export TORCH_NCCL_AVOID_RECORD_STREAMS=1  # megatron-core: frees communication buffers sooner
    export CUDA_DEVICE_MAX_CONNECTIONS=1      # megatron-core: TP communication overlaps in launch order
    export OMP_NUM_THREADS=1
    export HF_HUB_OFFLINE=1                   # base_model is a local directory; nothing is downloaded
}

# After the first task ends the others get this long to end too (a crashed rank would otherwise
# leave the rest blocked in a collective until its timeout).
TASK_EXIT_GRACE_S=${TASK_EXIT_GRACE_S:-180}

# A lost host. Its peers end (distributed.timeout_s at most): with gloo each with EXIT_PEER_LOST;
# with NCCL torch's watchdog aborts them (SIGABRT), and srun returns 128 + the signal. Slurm
# requeues a job with --requeue when it declares one of its nodes failed, which takes up to
# SlurmdTimeout after the node's last answer; a job that has ended by then just FAILED. So after
# EXIT_PEER_LOST, or a signal status of a step over several nodes, this script waits that long
# (NODE_FAIL_WAIT_S, default 1.5 x SlurmdTimeout + 10 s) for the verdict: a failed node ends
# this script and requeues the job.
# When no node failed, the hosts are up but the step lost a rank: its processes died (the OOM
# killer, a crash) or a link was too slow or down for distributed.timeout_s. The script requeues
# the job once per checkpoint: when the run's last complete checkpoint is not the one it
# resumed from after the previous such requeue (recorded in RUN_DIR/requeued-after-lost-peer).
# A fault that comes back before the next checkpoint (a rank that crashes at the same step)
# ends the job FAILED with the status.

# run_tasks COMMAND [ARG ...]: one srun step running COMMAND in each of the job's tasks, with
# SIGUSR1 / SIGTERM ignored (see above) and the job's CPUs per task.
# Since Slurm 22.05 srun no longer takes --cpus-per-task from sbatch (it ignores
# SLURM_CPUS_PER_TASK and reads SRUN_CPUS_PER_TASK instead): a step then gets one CPU per task,
# and where tasks are bound to cores (task/affinity, task/cgroup) the trainer and all its reward
# workers share one core. Passing the count on the command line works with every version.
run_tasks() {
    local cpus=${SRUN_CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-}}
    local tasks
    tasks=$(shrunk_tasks)
    srun --wait="${TASK_EXIT_GRACE_S}" ${tasks:+--ntasks="$tasks"} ${cpus:+--cpus-per-task="$cpus"} \
        bash -c 'trap "" USR1 TERM; exec "$@"' gdpo-task "$@"
}

# shrunk_tasks: the task count of a requeued job whose node count was lowered
# (scontrol update JobId=... NumNodes=1): the nodes it has now times --ntasks-per-node. Such a
# job keeps the SLURM_NTASKS it was submitted with, which srun would still start. Nothing for
# any other job.
shrunk_tasks() {
    local per_node=${SLURM_NTASKS_PER_NODE:-}
    if [[ $per_node =~ ^[0-9]+$ && -n ${SLURM_JOB_NUM_NODES:-} ]] \
        && (( ${SLURM_NTASKS:-0} > per_node * SLURM_JOB_NUM_NODES )); then
        echo $(( per_node * SLURM_JOB_NUM_NODES ))
    fi
}

# lost_a_rank STATUS: whether the step's STATUS says a rank lost a peer (see above).
lost_a_rank() {
    local status=$1
    (( status == EXIT_PEER_LOST || (status > 128 && ${SLURM_JOB_NUM_NODES:-1} > 1) ))
}

# wait_for_node_failure STATUS: after a lost peer, give Slurm the time to declare a failed node (see above).
wait_for_node_failure() {
    local status=$1 timeout_s how name
    timeout_s=$(scontrol show config | awk '$1 == "SlurmdTimeout" {print $3}')
    local wait_s=${NODE_FAIL_WAIT_S:-$(( ${timeout_s:-300} * 3 / 2 + 10 ))}
    how="status ${status}"
    (( status > 128 )) && name=$(kill -l $(( status - 128 )) 2>/dev/null) && how="signal SIG${name}"
    echo "a rank lost a peer (${how}); waiting up to ${wait_s} s for Slurm to declare a failed node (it then requeues the job)"
    sleep "$wait_s"
}

# requeue_after_lost_peer RUN_DIR: no node failed; requeue the job once per checkpoint (see above).
requeue_after_lost_peer() {
    local run_dir=$1 latest="none" record="$1/requeued-after-lost-peer"
    [[ -f $run_dir/checkpoints/latest ]] && latest=$(<"$run_dir/checkpoints/latest")
    if [[ -f $record && $(<"$record") == "$latest" ]]; then
        echo "no node of job ${SLURM_JOB_ID} failed, and the job was requeued from checkpoint ${latest} before: not requeued"
        return 1
    fi
    mkdir -p "$run_dir" && echo "$latest" > "$record"
    echo "no node of job ${SLURM_JOB_ID} failed; requeueing it once from checkpoint ${latest}"
    scontrol requeue "${SLURM_JOB_ID}"
}

# launch_training CONFIG [--config OTHER] [key.sub=value ...]
# The script's CONFIG, or the OTHER config its submitter named first (sbatch slurm/SCRIPT
# --config configs/x.yaml steps=2), in the script's layout. The run directory is RUN_DIR, else
# runs/<job name>-<job id>; a run_dir=... argument wins. On a shared filesystem: every node
# writes its part of each checkpoint there.
launch_training() {
    local config=$1
    shift
    if [[ ${1:-} == --config ]]; then
        if (( $# < 2 )); then
            echo "launch_training: --config needs a config file" >&2
            return 2
        fi
        config=$2
        shift 2
    fi
    if [[ ! -f $config ]]; then
        echo "launch_training: config $config not found in $PWD (submit from the repository root)" >&2
        return 2
    fi
    local run_dir=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}} arg
    for arg in "$@"; do [[ $arg == run_dir=* ]] && run_dir=${arg#run_dir=}; done
    local tasks
    tasks=$(shrunk_tasks)
    echo "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): ${tasks:-${SLURM_NTASKS}} tasks on" \
         "${SLURM_JOB_NODELIST}, config ${config}, run dir ${run_dir}, $(date -u +%FT%TZ)"

    local status=0
    run_tasks python -m gdpo_megatron train --config "$config" \
        run_dir="$run_dir" checkpoint.resume=true "$@" || status=$?

    if (( status == EXIT_REQUEUE )); then
        echo "trainer saved a checkpoint before the time limit; requeueing job ${SLURM_JOB_ID}"
        scontrol requeue "${SLURM_JOB_ID}"
        return $?
    fi
    if lost_a_rank "$status"; then
        wait_for_node_failure "$status"
        requeue_after_lost_peer "$run_dir" && return 0
    fi
    echo "trainer exited with status ${status}, $(date -u +%FT%TZ)"
    return "$status"
}
