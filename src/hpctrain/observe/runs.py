"""``hpctrain runs [DIR]``: a table of the runs under DIR (default ``runs``).

    RUN         STATE    STEP  LOSS   TOKENS/S  GOODPUT  KWH    TOKENS/J  CO2E KG  SLURM
    llama-1234  running   420  3.412    71.2k       -        -         -        -  1234 RUNNING
    llama-1b    done     2000  2.870    63.2k   97.1%    0.412     122.0    0.198

State: ``running`` while ``run.lock`` has a fresh heartbeat, else from ``exit_info.json``:
done (0), preempted (75), hung (124), interrupted (130), failed (anything else), unknown (no exit
info and no live lock: killed without a word). Step and loss are rank 0's last training window
(read from the end of its metrics file); tokens/s is the number the run recorded when it ended
(``rundata.recorded_tokens_per_s``, the same as its ``done:`` line and its report), and while it
runs its last window's; goodput and energy (the GPUs' kWh, tokens per joule and CO2e over all
attempts, when metered) from ``goodput.json``. The Slurm job comes from the lock's
holder or the run's name (``<name>-<job>``; an archived run, ``<name>-archived-<time>``, names
none of its own). Under Slurm the job's state comes from ``squeue --json`` (one call for all
runs; none when squeue is missing, slow or fails), for runs that are not archived.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hpctrain.errors import HpctrainError
from hpctrain.observe.report import run_state
from hpctrain.observe.rundata import (
    RunData,
    is_run_dir,
    last_train_record,
    load_run,
    recorded_tokens_per_s,
)
from hpctrain.observe.svg import fmt
from hpctrain.shown import shown

_SQUEUE_TIMEOUT_S = 10.0
# "<name>-<job>" or "<name>-<array job>_<task>": the suffix hpctrain gives a run under Slurm.
_JOB_SUFFIX = re.compile(r"-(\d+(?:_\d+)?)$")
# What `--fresh` appends (runtime/rundir.archive_run): "-archived-<%Y%m%d-%H%M%S>[-<n>]".
_ARCHIVED = re.compile(r"-archived-\d{8}-\d{6}(?:-\d+)?$")


# Energy columns: the row's key and significant digits.
_ENERGY = {"KWH": ("kwh", 3), "TOKENS/J": ("tokens_per_j", 4), "CO2E KG": ("co2e_kg", 3)}


def _figure(value: Any, digits: int) -> str:
    return f"{value:.{digits}g}" if isinstance(value, int | float) else "-"


def find_runs(folder: Path) -> list[Path]:
    """Run directories directly under ``folder`` (or ``folder`` itself if it is one)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HpctrainError(f"{folder} is not a directory",
                            expected="the folder that holds run directories (run.out_dir)",
                            hint="hpctrain runs runs/")
    if is_run_dir(folder):
        return [folder]
    return sorted((p for p in folder.iterdir() if is_run_dir(p)),
                  key=lambda p: p.stat().st_mtime)


def slurm_job(run: RunData) -> str | None:
    """The Slurm job id of a run, from its lock holder or its directory name (an archived
    run's name is that of the run it was, whose job id it keeps: ``a-12-archived-<time>``)."""
    holder = (run.lock or {}).get("job") or ""
    for part in str(holder).split("/"):
        if part.startswith("slurm:"):
            return part.removeprefix("slurm:")
    m = _JOB_SUFFIX.search(_ARCHIVED.sub("", run.name))
    return m.group(1) if m else None


def is_archived(name: str) -> bool:
    """Whether a run directory's name is one ``--fresh`` gave an older run."""
    return _ARCHIVED.search(name) is not None


def squeue_states(jobs: list[str], squeue: str | None = None) -> dict[str, str]:
    """{job id: state} from ``squeue --json``; {} when squeue is missing or fails."""
    squeue = squeue or shutil.which("squeue")
    if not jobs or squeue is None:
        return {}
    try:
        done = subprocess.run([squeue, "--json", "--jobs", ",".join(sorted(set(jobs)))],
                              capture_output=True, text=True, timeout=_SQUEUE_TIMEOUT_S,
                              check=False)
        data = json.loads(done.stdout) if done.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}
    states = {}
    for job in data.get("jobs") or []:
        if not isinstance(job, dict):
            continue
        state = job.get("job_state")
        # Slurm 22.05 gives a string, 23.02 and later a list of flags.
        state = ",".join(state) if isinstance(state, list) else str(state or "")
        ids = [str(job.get("job_id"))]
        array_job, task = _number(job.get("array_job_id")), _number(job.get("array_task_id"))
        if array_job and task is not None:
            ids.append(f"{array_job}_{task}")
        for job_id in ids:
            states[job_id] = state
    return states


def _number(value: Any) -> int | None:
    """A job number as squeue writes it: N, or (23.02+) {"set": true, "number": N}."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set") else None
    return value if isinstance(value, int) else None


def runs_table(folder: Path, squeue: str | None = None) -> list[dict[str, Any]]:
    """One row per run under ``folder``: name, state, step, loss, tokens/s, goodput, slurm."""
    runs = [load_run(path, metrics=False) for path in find_runs(folder)]
    jobs = {run.name: slurm_job(run) for run in runs}
    # The queue knows the job as the live run's, never as an archived copy's.
    live = {run.name: jobs[run.name] for run in runs if not is_archived(run.name)}
    states = squeue_states([j for j in live.values() if j], squeue)
    rows = []
    for run in runs:
        last = last_train_record(run.root) or {}
        goodput = (run.goodput or {}).get("goodput")
        energy = (run.goodput or {}).get("energy") or {}
        job, state = jobs[run.name], run_state(run)
        rate = last.get("tokens_per_s") if state == "running" else recorded_tokens_per_s(run)
        rows.append({"run": run.name, "state": state, "step": last.get("step"),
                     "loss": last.get("loss"), "tokens_per_s": rate,
                     "goodput": goodput if isinstance(goodput, int | float) else None,
                     "kwh": energy.get("kwh"), "tokens_per_j": energy.get("tokens_per_j"),
                     "co2e_kg": energy.get("co2e_kg"),
                     "slurm_job": job,
                     "slurm_state": states.get(job) if run.name in live and job else None,
                     "path": str(run.root), "damaged": run.damaged})
    return rows


def print_runs(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    """The table on the terminal (plain text when not a terminal)."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a file: no wrapping at 80 columns
            console = Console(width=200)
    table = Table(box=None, header_style="bold")
    for column in ("RUN", "STATE", "STEP", "LOSS", "TOKENS/S", "GOODPUT", *_ENERGY, "SLURM"):
        table.add_column(column, justify="left" if column in ("RUN", "STATE", "SLURM")
                         else "right")
    for r in rows:
        loss = r["loss"]
        # Text, not markup: a run folder's name or a recorded job id is anyone's text, and
        # rich would read "[link=...]" in it as markup.
        table.add_row(
            Text(shown(r["run"])), r["state"], "-" if r["step"] is None else Text(shown(r["step"])),
            fmt(loss) if isinstance(loss, int | float) else "-",
            fmt(r["tokens_per_s"]) if isinstance(r["tokens_per_s"], int | float) else "-",
            f"{100 * r['goodput']:.1f}%" if r["goodput"] is not None else "-",
            *(_figure(r.get(key), digits) for key, digits in _ENERGY.values()),
            Text(shown(" ".join(str(x) for x in (r["slurm_job"], r["slurm_state"]) if x) or "-")))
    console.print(table)
