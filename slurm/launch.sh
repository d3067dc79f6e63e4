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
export PYTHONUNBUFFERED=1                     # log lines reach the job's output file as written
export WANDB_MODE=${WANDB_MODE:-offline}      # compute nodes are often offline; wandb sync later

# After the first task ends the others get this long to end too (a crashed rank would otherwise
# leave the rest blocked in a collective until its timeout).
TASK_EXIT_GRACE_S=${TASK_EXIT_GRACE_S:-180}

# run_tasks COMMAND [ARG ...]: one srun step running COMMAND in each of the job's tasks, with
# SIGUSR1 / SIGTERM ignored (see above) and the job's CPUs per task.
# Since Slurm 22.05 srun no longer takes --cpus-per-task from sbatch (it ignores
# SLURM_CPUS_PER_TASK and reads SRUN_CPUS_PER_TASK instead): a step then gets one CPU per task,
# and where tasks are bound to cores (task/affinity, task/cgroup) the trainer and all its reward
# workers share one core. Passing the count on the command line works with every version.
run_tasks() {
    local cpus=${SRUN_CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-}}
    srun --wait="${TASK_EXIT_GRACE_S}" ${cpus:+--cpus-per-task="$cpus"} \
        bash -c 'trap "" USR1 TERM; exec "$@"' gdpo-task "$@"
}

# launch_training CONFIG [key.sub=value ...]
# The run directory is RUN_DIR, else runs/<job name>-<job id>; a run_dir=... argument wins.
launch_training() {
    local config=$1
    shift
    if [[ ! -f $config ]]; then
        echo "launch_training: config $config not found in $PWD (submit from the repository root)" >&2
        return 2
    fi
    local run_dir=${RUN_DIR:-runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
    echo "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): ${SLURM_NTASKS} tasks on" \
         "${SLURM_JOB_NODELIST}, config ${config}, run dir ${run_dir}, $(date -u +%FT%TZ)"

    local status=0
    run_tasks python -m gdpo_megatron train --config "$config" \
        run_dir="$run_dir" checkpoint.resume=true "$@" || status=$?

    if (( status == EXIT_REQUEUE )); then
        echo "trainer saved a checkpoint before the time limit; requeueing job ${SLURM_JOB_ID}"
        scontrol requeue "${SLURM_JOB_ID}"
        return $?
    fi
    echo "trainer exited with status ${status}, $(date -u +%FT%TZ)"
    return "$status"
}
