"""``hpctrain report``, ``runs`` and ``profile``: look at runs without writing code.

    hpctrain report runs/llama-1234                 # runs/llama-1234/report.html
    hpctrain report runs/a runs/b -o compare.html   # several runs overlaid, config difference
    hpctrain runs runs/                             # state, step, loss, tokens/s, goodput, Slurm
    hpctrain profile runs/llama-1234                # where the profiled steps' GPU time went
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from hpctrain.errors import HpctrainError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``report``, ``runs`` and ``profile`` on the top-level sub-parser set."""
    r = sub.add_parser("report", help="one self-contained HTML report of one or several runs",
                       description="Write one HTML file (no network needed to open it) with "
                       "the runs' curves, stragglers, goodput, timeline, hang forensics, "
                       "profiles, config and provenance.")
    r.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run directories")
    r.add_argument("-o", "--output", type=Path, default=None,
                   help="where to write (default: RUN/report.html, or ./report.html for "
                   "several runs)")
    s = sub.add_parser("runs", help="a table of runs: state, step, loss, tokens/s, goodput",
                       description="List the run directories under DIR with their state "
                       "(running, done, failed, preempted, hung), last step, loss, tokens/s, "
                       "goodput and, under Slurm, the job's state from squeue.")
    s.add_argument("dir", nargs="?", type=Path, default=Path("runs"), metavar="DIR",
                   help="folder holding run directories (default: runs)")
    s.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p = sub.add_parser("profile", help="where the GPU time of profiled steps went",
                       description="Summarise the profiler traces of a run (profile.steps): "
                       "GPU time by kind (GEMM, attention, communication, optimizer, fused "
                       "pointwise, copies), GPU idle time and exposed communication, per rank.")
    p.add_argument("target", type=Path, metavar="RUN_OR_TRACE",
                   help="a run directory, or one rank-NNN.trace.json")
    p.add_argument("--top", type=int, default=8, help="largest kernels listed per trace")


def run(args: argparse.Namespace) -> None:
    """Dispatch ``report``, ``runs`` or ``profile``."""
    if args.command == "profile":
        from hpctrain.observe.trace_summary import find_traces, markdown, summarise_trace

        print(markdown([summarise_trace(path, steps, args.top)
                        for path, steps in find_traces(args.target)]))
        return
    if args.command == "report":
        from hpctrain.observe.report import default_output, write_report
        from hpctrain.observe.rundata import load_run

        runs = [load_run(path) for path in args.runs]
        _warn_damaged(note for run in runs for note in run.damaged)
        out = args.output or default_output(args.runs)
        try:
            write_report(runs, out)
        except OSError as e:
            raise HpctrainError(f"cannot write the report to {out}: {e.strerror}",
                                hint="pass -o PATH in a folder you can write") from None
        print(out)
        return
    from hpctrain.observe.runs import print_runs, runs_table

    rows = runs_table(args.dir)
    _warn_damaged(note for row in rows for note in row["damaged"])
    if args.json:
        for row in rows:
            print(json.dumps(row))
    elif rows:
        print_runs(rows)
    else:
        print(f"no runs under {args.dir}", file=sys.stderr)


def _warn_damaged(notes: Iterable[str]) -> None:
    """Say on stderr which files of the runs are damaged (they are shown as absent)."""
    for note in notes:
        print(f"warning: damaged, read as absent: {note}", file=sys.stderr)
