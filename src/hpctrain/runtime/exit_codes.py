"""Exit codes a supervisor (Slurm script, launcher, user) can act on."""

# Preempted: a checkpoint was committed and the job wants to run again (EX_TEMPFAIL).
PREEMPTED = 75
# A step outlived watchdog.timeout; stacks are in the rank logs.
HUNG = 124
