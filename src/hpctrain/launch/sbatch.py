"""A Slurm batch script for ``hpctrain train``, generated from typed parameters.

The script carries the cluster manners that make preemption cheap:

- ``--signal=USR2@N`` without ``B:``: Slurm signals every task of the step directly, N seconds
  before the time limit (``B:`` would signal only the batch shell, and bash defers its trap
  until ``srun`` returns, so the ranks would never hear it);
- one ``srun`` task per GPU, no launcher in between, so each rank gets the signal itself;
- ``--requeue`` and ``--open-mode=append`` so the requeued run continues the same log;
- exit code 75 means "checkpoint committed, please run me again": rank 0 requeues with
  ``scontrol`` (per array task); where it could not reach ``scontrol`` (a container), this
  script does it from outside.

    hpctrain sbatch configs/llama-1b.yaml --nodes 2 --gpus-per-node 4 --time 04:00:00 > job.sh
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from hpctrain.errors import ConfigError
from hpctrain.runtime.exit_codes import PREEMPTED

# #SBATCH lines are not shell: values there cannot be quoted, so they must not need it.
_SAFE = re.compile(r"[A-Za-z0-9._/-]+")


@dataclass
class SbatchParams:
    """What the batch script needs; every value is validated before rendering."""

    config: str
    overrides: list[str] = field(default_factory=list)
    job_name: str = "hpctrain"
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time: str = "01:00:00"
    # Seconds before the time limit at which the ranks get the signal: enough to finish the
    # current step and write a checkpoint.
    signal_lead_s: int = 120
    signal: str = "USR2"
    partition: str | None = None
    account: str | None = None
    array: str | None = None
    log_dir: str = "runs/slurm-logs"
    python: str = "python3"

    def validate(self) -> None:
        """Reject values Slurm would reject later, or that would break the protocol."""
        for key in ("nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} = {getattr(self, key)} must be >= 1")
        if self.gpus_per_node and self.gpus_per_node != self.tasks_per_node:
            raise ConfigError(
                f"--gpus-per-node {self.gpus_per_node} with --tasks-per-node "
                f"{self.tasks_per_node}",
                expected="one task per GPU",
                hint=f"use --tasks-per-node {self.gpus_per_node}",
            )
        for key in ("job_name", "log_dir"):
            if not _SAFE.fullmatch(getattr(self, key)):
                raise ConfigError(f"--{key.replace('_', '-')} {getattr(self, key)!r} has "
                                  "characters a batch script cannot carry unquoted",
                                  expected="letters, digits and . _ - /")
        parts = self.time.replace("-", ":").split(":")
        if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 4:
            raise ConfigError(f"--time {self.time!r} is not a Slurm time",
                              expected="MM, HH:MM:SS or D-HH:MM:SS")
        if self.signal_lead_s < 1 or self.signal.startswith(("B:", "SIG")):
            raise ConfigError(f"--signal {self.signal!r} @ {self.signal_lead_s} s",
                              expected="a bare name such as USR2 and a lead of >= 1 s",
                              hint="no 'B:' prefix: the ranks, not the batch shell, need it")


def render_sbatch(p: SbatchParams) -> str:
    """The batch script text (deterministic: pinned by a golden file in the tests)."""
    p.validate()
    out_pattern = "%A_%a" if p.array else "%j"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={p.job_name}",
        f"#SBATCH --nodes={p.nodes}",
        f"#SBATCH --ntasks-per-node={p.tasks_per_node}",
        f"#SBATCH --cpus-per-task={p.cpus_per_task}",
    ]
    if p.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={p.gpus_per_node}")
    lines += [
        f"#SBATCH --time={p.time}",
        f"#SBATCH --signal={p.signal}@{p.signal_lead_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={p.log_dir}/{p.job_name}-{out_pattern}.out",
    ]
    if p.partition:
        lines.append(f"#SBATCH --partition={p.partition}")
    if p.account:
        lines.append(f"#SBATCH --account={p.account}")
    if p.array:
        lines.append(f"#SBATCH --array={p.array}")
    cmd = " ".join(shlex.quote(a) for a in [p.python, "-m", "hpctrain", "train", p.config,
                                             *p.overrides])
    lines += [
        "",
        "set -u",
        "# One thread pool per task sized to its CPUs; more would oversubscribe the node.",
        'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"',
        'echo "hpctrain: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on '
        '${SLURM_JOB_NODELIST}"',
        "",
        f"srun --kill-on-bad-exit=1 {cmd}",
        "rc=$?",
        f"if [ \"$rc\" -eq {PREEMPTED} ]; then",
        "    # Preempted with a committed checkpoint. Rank 0 requeues itself when it can reach",
        "    # scontrol; inside a container it cannot, and asks for it in this log.",
        '    target="${SLURM_JOB_ID}"',
        '    if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then',
        '        target="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        "    fi",
        f'    log="{p.log_dir}/{p.job_name}-${{target}}.out"',
        '    marker="HPCTRAIN_REQUEUE_BY_SCRIPT restart=${SLURM_RESTART_COUNT:-0} "',
        '    if grep -qs "$marker" "$log"; then',
        '        scontrol requeue "${target}"',
        "    fi",
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)
