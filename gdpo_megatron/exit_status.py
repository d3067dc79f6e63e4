"""The exit statuses a training process ends with where a scheduler reads them.

``gdpo-train`` returns them, and the trainer exits with :data:`EXIT_REQUEUE` by itself when a
stop cannot wait for the step (``checkpoint.stop_timeout_s``); ``slurm/launch.sh`` requeues
the job on either status (docs/cluster.md).
"""

EXIT_REQUEUE = 75  # EX_TEMPFAIL, "try again later": resume from the last checkpoint
# EX_UNAVAILABLE: a peer rank was lost. Not a reason to requeue by itself: a crashed peer would
# crash again; Slurm requeues a job whose node failed (sbatch --requeue).
EXIT_PEER_LOST = 69
