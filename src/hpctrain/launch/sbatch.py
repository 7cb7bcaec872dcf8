"""A Slurm batch script for ``hpctrain train``, generated from typed parameters.

The script carries the cluster manners that make preemption cheap:

- ``--signal=USR2@N`` without ``B:``: Slurm signals every task of the step directly, N seconds
  before the time limit (``B:`` would signal only the batch shell, and bash defers its trap
  until ``srun`` returns, so the ranks would never hear it);
- one ``srun`` task per GPU, no launcher in between, so each rank gets the signal itself;
- ``--requeue`` and ``--open-mode=append`` so the requeued run continues the same log;
- exit code 75 means "checkpoint committed, please run me again": rank 0 requeues with
  ``scontrol`` (per array task); where it could not reach ``scontrol`` (a container), it says
  so in the log (``HPCTRAIN_REQUEUE_BY_SCRIPT restart=N``) and this script requeues from
  outside, whatever code srun reports (a rank still exiting when srun's --kill-on-bad-exit
  fires turns 75 into 143);
- ``--distribution=block``: ranks fill one node before the next, so the mesh's innermost axis
  (``tp``) stays inside a node and pipeline stages and FSDP groups span nodes; a layout whose
  tensor-parallel groups would straddle two nodes is refused before anything is written;
- a dependency comes with ``--kill-on-invalid-dep=yes``: a job whose parent failed is
  cancelled instead of pending forever.

It also runs as written wherever it is submitted from: the job changes to the directory the
script was generated in (so relative paths in the config and overrides mean what they meant
there), runs the interpreter that generated it (or ``--python``/``--venv``), and writes its log
into a folder created at generation time (Slurm opens ``--output`` before the script starts and
never creates its folder).

    hpctrain sbatch configs/llama-1b.yaml --nodes 2 --tasks-per-node 4 --gpus-per-node 4 -o train.sh
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError
from hpctrain.launch.containers import Container, default_runtime, job_binds
from hpctrain.launch.output import write_output
from hpctrain.numeric_args import count
from hpctrain.parallel.layout import check_layout, check_task_config
from hpctrain.runtime.exit_codes import PREEMPTED

# #SBATCH lines are not shell: values there cannot be quoted, so they must not need it.
_SAFE = re.compile(r"[A-Za-z0-9._/-]+")
_SAFE_CHARS = "letters, digits and . _ - /"
_NAMES = re.compile(r"[A-Za-z0-9._,-]+")
_ARRAY = re.compile(r"[0-9,:%-]+")
_SIGNAL = re.compile(r"[A-Z0-9]+")
# sbatch --dependency: TYPE[:ID[+MIN]]... joined by ',' (all) or '?' (any); or singleton.
_DEP_TYPES = ("after", "afterany", "afterburstbuffer", "aftercorr", "afternotok", "afterok",
              "singleton")
_DEPENDENCY = re.compile(r"(?:singleton|[a-z]+(?::[0-9]+(?:_[0-9]+)?(?:\+[0-9]+)?)+)"
                         r"(?:[,?](?:singleton|[a-z]+(?::[0-9]+(?:_[0-9]+)?(?:\+[0-9]+)?)+))*")
# What the job's interpreter must manage: hpctrain itself, and torch beside it (found, not
# imported: importing torch takes seconds).
_CHECK_IMPORT = ("import importlib.util, sys, hpctrain; "
                 "sys.exit(0 if importlib.util.find_spec('torch') else 3)")
_CHECK_TIMEOUT_S = 120


@dataclass
class SbatchParams:
    """What the batch script needs; every value is validated before rendering."""

    config: str
    # Absolute: the job runs here, and an interpreter that imports hpctrain (resolve_python).
    workdir: str
    python: str
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
    # sbatch --dependency, e.g. afterok:123:124 (the job waits for both to succeed).
    dependency: str | None = None
    # Another program than `python -m hpctrain train CONFIG OVERRIDES` (pipeline stages): one
    # srun step, without the preemption protocol (no --signal, --requeue or exit-75 handling).
    command: list[str] | None = None
    # Run the program(s) in this container (launch/containers.py); python is then the image's.
    container: Container | None = None
    # Training only: `hpctrain doctor` on every task first; the job stops (exit 1) on a problem.
    preflight: bool = False
    # Commands run by the batch shell after the program exited 0 (a pipeline's done-marker).
    after_success: list[list[str]] = field(default_factory=list)
    # Relative to workdir unless absolute.
    log_dir: str = "runs/slurm-logs"

    @property
    def log_path(self) -> str:
        """The absolute log folder (``--output`` is resolved by Slurm, not by this script)."""
        return os.path.join(self.workdir, self.log_dir)

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
        if self.container is not None:
            self.container.validate()
        # Inside a container the interpreter is the image's: a name on its PATH is fine.
        for key in ("workdir",) if self.container else ("workdir", "python"):
            if not os.path.isabs(getattr(self, key)):
                raise ConfigError(f"{key} {getattr(self, key)!r} is not an absolute path",
                                  expected="an absolute path, so the job finds it from any "
                                  "directory")
        for key, value, allowed, chars in (
                ("job-name", self.job_name, _SAFE, _SAFE_CHARS),
                ("partition", self.partition, _NAMES, "letters, digits and . _ - ,"),
                ("account", self.account, _NAMES, "letters, digits and . _ - ,"),
                ("array", self.array, _ARRAY, "an index list such as 0-15%4 or 1,3,5")):
            if value is not None and not allowed.fullmatch(value):
                raise ConfigError(f"--{key} {value!r} has characters an #SBATCH line cannot "
                                  "carry", expected=chars)
        if not _SAFE.fullmatch(self.log_path):
            raise ConfigError(
                f"the log folder {self.log_path!r} has characters an #SBATCH --output line "
                "cannot carry (Slurm reads it unquoted, before any shell runs)",
                expected=_SAFE_CHARS,
                hint="pass --log-dir with an absolute path made of those characters, e.g. "
                     "--log-dir $HOME/slurm-logs")
        if self.dependency is not None and not (
                _DEPENDENCY.fullmatch(self.dependency)
                and all(item.split(":")[0] in _DEP_TYPES
                        for item in re.split(r"[,?]", self.dependency))):
            raise ConfigError(f"--dependency {self.dependency!r} is not a Slurm dependency",
                              expected="TYPE:JOBID[:JOBID...] joined by ',' (all) or '?' "
                              f"(any), TYPE one of {', '.join(_DEP_TYPES)}",
                              hint="e.g. --dependency afterok:123456")
        parts = self.time.replace("-", ":").split(":")
        if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 4:
            raise ConfigError(f"--time {self.time!r} is not a Slurm time",
                              expected="MM, HH:MM:SS or D-HH:MM:SS")
        if (self.signal_lead_s < 1 or self.signal.startswith(("B:", "SIG"))
                or not _SIGNAL.fullmatch(self.signal)):
            raise ConfigError(f"--signal {self.signal!r} @ {self.signal_lead_s} s",
                              expected="a bare name such as USR2 and a lead of >= 1 s",
                              hint="no 'B:' prefix: the ranks, not the batch shell, need it")


def check_placement(cfg: JobConfig, nodes: int, tasks_per_node: int) -> None:
    """Refuse a layout training would refuse (its ``auto`` values chosen for the job's ranks,
    so a global batch they cannot split is refused before the job queues), or one whose TP
    groups straddle two nodes."""
    tp = cfg.parallel.tp
    # Before auto is resolved: the check needs only tp, and names it, not the batch.
    if not cfg.task and nodes > 1 and tasks_per_node % tp:
        fits = [d for d in range(1, tasks_per_node + 1) if tasks_per_node % d == 0 and d <= tp]
        raise ConfigError(
            f"parallel.tp = {tp} with --tasks-per-node {tasks_per_node} on {nodes} nodes: "
            "tensor-parallel groups would span nodes (ranks are numbered node by node and tp "
            "is the innermost mesh axis)",
            expected="parallel.tp dividing the tasks (GPUs) per node: its all-reduces run every "
            "layer and need NVLink, not the network",
            hint=f"use parallel.tp={fits[-1]}, or --tasks-per-node a multiple of {tp}; "
            "scale across nodes with pipeline (parallel.pp) or FSDP instead")
    cfg = _resolved(cfg, nodes * tasks_per_node)
    if cfg.task:  # a task's layout is data parallelism only; its model is not the config's
        check_task_config(cfg, nodes * tasks_per_node)
        return
    check_layout(cfg, nodes * tasks_per_node)


def _resolved(cfg: JobConfig, world_size: int) -> JobConfig:
    """A copy of ``cfg`` with its ``auto`` values chosen for ``world_size`` ranks, as each rank
    chooses at start. The submitting machine has none of the job's GPUs: the CPU's stand-in
    chooses, which never refuses for memory (the ranks size it on their GPUs) but splits the
    batch and picks a strategy the layout rules can check."""
    from hpctrain.plan.auto import CPU, resolve_auto

    job = copy.deepcopy(cfg)
    resolve_auto(job, world_size, CPU, must_fit=False)
    return job


def resolve_python(python: str | None, venv: str | None, workdir: Path) -> str:
    """The absolute interpreter for the job (default: this one), checked to import hpctrain."""
    if venv is not None:
        root = workdir / venv
        if not root.is_dir():
            raise ConfigError(f"--venv {venv}: no such directory",
                              expected="a virtual environment with hpctrain installed",
                              hint="create it with `make demo` (.venv) or python -m venv")
        candidate = root / "bin" / "python"
        if not candidate.exists():
            raise ConfigError(f"--venv {venv}: {candidate} does not exist",
                              expected="a virtual environment (DIR/bin/python)")
    elif python is None:
        candidate = Path(sys.executable)
    elif os.sep not in python:
        found = shutil.which(python)
        if found is None:
            raise ConfigError(f"--python {python}: not found on PATH",
                              expected="a path to a Python interpreter that imports hpctrain")
        candidate = Path(found)
    else:
        candidate = workdir / python
    # absolute(), not resolve(): a venv's bin/python is a symlink to the base interpreter,
    # which would lose the venv's site-packages.
    candidate = candidate.absolute()
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise ConfigError(f"python {candidate}: not an executable file",
                          expected="a Python interpreter that imports hpctrain")
    check_python(str(candidate), workdir)
    return str(candidate)


def check_python(python: str, workdir: Path) -> None:
    """Run `python` where the job will run it; refuse it unless it imports hpctrain."""
    try:
        done = subprocess.run([python, "-c", _CHECK_IMPORT], cwd=workdir, capture_output=True,
                              text=True, timeout=_CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"python {python}: could not run it ({exc})",
                          expected="a Python interpreter that imports hpctrain") from exc
    if done.returncode != 0:
        missing = "torch" if done.returncode == 3 else "hpctrain"
        detail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise ConfigError(
            f"python {python} cannot import {missing} ({detail[0]}): the job would fail",
            expected="the interpreter of an environment where hpctrain is installed",
            hint="pass --venv DIR of that environment, or --python PATH to its interpreter")


def create_log_dir(p: SbatchParams) -> Path:
    """Create the job's log folder now: Slurm cannot start a job whose --output has none."""
    path = Path(p.log_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def render_sbatch(p: SbatchParams) -> str:
    """The batch script text (deterministic: pinned by a golden file in the tests)."""
    p.validate()
    train = p.command is None
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
    lines.append(f"#SBATCH --time={p.time}")
    if train:
        lines += [f"#SBATCH --signal={p.signal}@{p.signal_lead_s}", "#SBATCH --requeue"]
    lines += [
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={p.log_path}/{p.job_name}-{out_pattern}.out",
    ]
    if p.partition:
        lines.append(f"#SBATCH --partition={p.partition}")
    if p.account:
        lines.append(f"#SBATCH --account={p.account}")
    if p.array:
        lines.append(f"#SBATCH --array={p.array}")
    if p.dependency:
        lines += [f"#SBATCH --dependency={p.dependency}", "#SBATCH --kill-on-invalid-dep=yes"]
    program = ([p.python, "-m", "hpctrain", "train", p.config, *p.overrides] if train
               else p.command)
    lines += [
        "",
        "# Slurm opens --output before this script starts and never creates its folder:",
        "# `hpctrain sbatch` did (recreate it if it is removed before submitting).",
        "set -u",
        "# Relative paths (config, data, runs/) mean what they meant where this was generated.",
        f"cd -- {shlex.quote(p.workdir)} || exit 1",
        "# One thread pool per task sized to its CPUs; more would oversubscribe the node.",
        'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"',
        'echo "hpctrain: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on '
        '${SLURM_JOB_NODELIST}"',
        "",
    ]
    srun = "srun --kill-on-bad-exit=1 --distribution=block"
    run = "{}"
    if p.container is not None:
        lines += [*p.container.shell_setup(), ""]
        srun = " ".join([srun, *p.container.srun_options(p.workdir)])
        run = " ".join([*p.container.prefix(gpus=p.gpus_per_node > 0), run])
    if train and p.preflight:
        doctor = [p.python, "-m", "hpctrain", "doctor", p.config, *p.overrides]
        lines += [
            "# Preflight: every task checks its node first (versions, GPUs, binding, network,",
            "# disk); a problem stops the job here, before it trains.",
            f"{srun} {run.format(_quote(doctor))} || exit 1",
        ]
    lines += [
        "# One task per GPU, numbered node by node (block): tensor-parallel groups stay in a node.",
        f"{srun} {run.format(_quote(program))}",
        "rc=$?",
    ]
    if train:
        log_prefix = shlex.quote(f"{p.log_path}/{p.job_name}-")
        lines += [
            'if [ "$rc" -ne 0 ]; then',
            f"    # Preempted with a committed checkpoint (exit {PREEMPTED}): rank 0 requeues "
            "itself",
            "    # when it can reach scontrol; inside a container it cannot, and asks for it in",
            "    # this log. srun may then report another code: a rank still on its way out when",
            "    # the first one left is killed by --kill-on-bad-exit. The request is what counts.",
            '    target="${SLURM_JOB_ID}"',
            '    if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then',
            '        target="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
            "    fi",
            f'    log={log_prefix}"${{target}}.out"',
            '    marker="HPCTRAIN_REQUEUE_BY_SCRIPT restart=${SLURM_RESTART_COUNT:-0} "',
            '    if grep -qs "$marker" "$log"; then',
            '        scontrol requeue "${target}"',
            "    fi",
            "fi",
        ]
    if p.after_success:
        lines.append('if [ "$rc" -eq 0 ]; then')
        lines += [f"    {_quote(argv)} || rc=$?" for argv in p.after_success]
        lines.append("fi")
    lines += ['exit "$rc"', ""]
    return "\n".join(lines)


def _quote(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


# -- the command line (shared by `hpctrain sbatch` and `hpctrain submit`) -------------------------


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The config, its overrides and the job's shape and manners, as options of `p`."""
    p.add_argument("config", type=Path, help="YAML config, e.g. configs/demo.yaml, or a task "
                   "file defining task() (hpctrain.task)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    for flag, kind, default, text in (
            ("--nodes", int, 1, "nodes of the job (sbatch --nodes)"),
            ("--tasks-per-node", int, 1, "ranks per node: one per GPU, or CPU processes"),
            ("--gpus-per-node", int, 0, "GPUs per node (sbatch --gpus-per-node; 0: none)"),
            ("--cpus-per-task", int, 1, "CPU cores per rank (sbatch --cpus-per-task)"),
            ("--time", str, "01:00:00", "time limit, HH:MM:SS or D-HH:MM:SS; the ranks "
             "checkpoint --signal-lead-s before it"),
            ("--signal-lead-s", int, 120, "seconds before the time limit at which the ranks "
             "get the signal to checkpoint and requeue"),
            ("--job-name", str, "hpctrain", "Slurm job name (also names the log files)"),
            ("--log-dir", str, "runs/slurm-logs", "folder of the job's logs, relative to "
             "this directory unless absolute; created now")):
        p.add_argument(flag, type=count(0, 65535) if kind is int else kind, default=default,
                       help=text)
    for flag, text in (("--partition", "Slurm partition (default: the cluster's)"),
                       ("--account", "account to charge (default: yours)"),
                       ("--array", "a job array, e.g. 0-7%%2 (default: none); each task gets "
                        "its own run directory")):
        p.add_argument(flag, default=None, help=text)
    p.add_argument("--dependency", default=None, metavar="TYPE:JOBID",
                   help="start after other jobs, e.g. afterok:123 (cancelled if they fail)")
    p.add_argument("--preflight", action="store_true",
                   help="run `hpctrain doctor` on every task first; stop the job on a problem")
    p.add_argument("--container", default=None, metavar="IMAGE",
                   help="run inside this image: Apptainer (.sif, docker://...) or Pyxis/enroot "
                   "(.sqsh, registry#image)")
    p.add_argument("--container-runtime", choices=("apptainer", "pyxis"), default=None,
                   help="default: pyxis for .sqsh images, else apptainer")
    p.add_argument("--bind", action="append", default=[], metavar="DIR",
                   help="with --container: another host folder the job needs (repeatable)")
    interpreter = p.add_mutually_exclusive_group()
    interpreter.add_argument("--python", default=None, metavar="PATH",
                             help="the job's Python, which must import hpctrain (default: the "
                             "one running this command; with --container: python3 of the "
                             "image)")
    interpreter.add_argument("--venv", default=None, metavar="DIR",
                             help="run the job with DIR/bin/python")


def params_from_args(args: argparse.Namespace) -> tuple[SbatchParams, JobConfig]:
    """Check the config and the layout on this shape; the script's parameters and the config."""
    from hpctrain.task import load_run_config

    # A bad config fails here, not on the cluster; a task file (.py) as `hpctrain train` reads it.
    cfg = load_run_config(args.config, args.overrides, args.nodes * args.tasks_per_node)
    check_placement(cfg, args.nodes, args.tasks_per_node)
    if args.array and cfg.run.suffix == "none":
        raise ConfigError(
            f"--array {args.array} with run.suffix=none: the tasks would all write "
            f"{Path(cfg.run.out_dir) / cfg.run.name} (the run lock lets one of them in)",
            hint="drop run.suffix=none: each task then gets <name>-<array job>_<task>")
    workdir = Path.cwd()
    container = None
    if args.container is not None:
        if args.venv is not None:
            raise ConfigError("--venv with --container",
                              expected="the interpreter inside the image",
                              hint="drop --venv; pass --python PATH (inside the image) if it is "
                              "not python3")
        log_path = os.path.join(workdir, args.log_dir)
        # A task file's folder holds the file and the helper modules it imports.
        task_dir = [str(Path(args.config).parent)] if Path(args.config).suffix == ".py" else []
        container = Container(args.container,
                              args.container_runtime or default_runtime(args.container),
                              job_binds(cfg, workdir, log_path, [*args.bind, *task_dir]))
        python = args.python or "python3"  # the image's: it cannot be checked from here
    elif args.bind:
        raise ConfigError("--bind without --container", hint="add --container IMAGE")
    else:
        python = resolve_python(args.python, args.venv, workdir)
    params = SbatchParams(
        config=str(args.config), workdir=str(workdir), container=container,
        python=python, overrides=args.overrides,
        job_name=args.job_name, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
        gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
        signal_lead_s=args.signal_lead_s, partition=args.partition, account=args.account,
        array=args.array, dependency=args.dependency, log_dir=args.log_dir,
        preflight=args.preflight)
    params.validate()
    return params, cfg


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``hpctrain sbatch`` on the top-level parser's ``sub``."""
    s = sub.add_parser("sbatch", help="write a Slurm batch script for a training config",
                       description="Print a batch script with preemption manners "
                       "(--signal without B:, --requeue, exit 75 = requeue) that runs as "
                       "written: the job works in this directory, with this interpreter, "
                       "and its log folder is created now.")
    add_job_options(s)
    s.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="write the script to FILE (its folder is created), not to stdout")
    s.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain sbatch``: print or write the script, create its log folder."""
    params, _ = params_from_args(args)
    text = render_sbatch(params)
    logs = create_log_dir(params)
    if args.output is None:
        print(text, end="")
    else:
        write_output(args.output, text)
        print(f"wrote {args.output} (logs go to {logs}/); submit it with: sbatch {args.output}",
              file=sys.stderr)
