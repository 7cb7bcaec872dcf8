#!/bin/bash
#SBATCH --job-name=hpctrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=01:00:00
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=/home/alice/hpctrain/runs/slurm-logs/hpctrain-%j.out

# Slurm opens --output before this script starts and never creates its folder:
# `hpctrain sbatch` did (recreate it if it is removed before submitting).
set -u
# Relative paths (config, data, runs/) mean what they meant where this was generated.
cd -- /home/alice/hpctrain || exit 1
# One thread pool per task sized to its CPUs; more would oversubscribe the node.
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
echo "hpctrain: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}"

# One task per GPU, numbered node by node (block): tensor-parallel groups stay in a node.
srun --kill-on-bad-exit=1 --distribution=block /home/alice/hpctrain/.venv/bin/python -m hpctrain train configs/demo.yaml train.steps=100 'run.name=first try' data.path=data/web
rc=$?
if [ "$rc" -ne 0 ]; then
    # Preempted with a committed checkpoint (exit 75): rank 0 requeues itself
    # when it can reach scontrol; inside a container it cannot, and asks for it in
    # this log. srun may then report another code: a rank still on its way out when
    # the first one left is killed by --kill-on-bad-exit. The request is what counts.
    target="${SLURM_JOB_ID}"
    if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
        target="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    fi
    log=/home/alice/hpctrain/runs/slurm-logs/hpctrain-"${target}.out"
    marker="HPCTRAIN_REQUEUE_BY_SCRIPT restart=${SLURM_RESTART_COUNT:-0} "
    if grep -qs "$marker" "$log"; then
        scontrol requeue "${target}"
    fi
fi
exit "$rc"
