"""Real `hpctrain train` runs for the checkpoint benchmarks (checkpoint.py, checkpoint_done.py):
start one, and read what rank 0 (or every rank) recorded.

Imported by the scripts beside it (``python benchmarks/X.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hpctrain.bench.common import run_command
from hpctrain.observe.metrics import read_metrics
from hpctrain.runtime.env import MULTICAST_OFF

REPO = Path(__file__).resolve().parents[1]
# Overrides every benchmark run takes: no progress bar, the run directory named as asked, and a
# watchdog that waits out a first compile of the 8b model.
COMMON = ["metrics.progress=false", "run.suffix=none", "watchdog.timeout=1800"]
# The tiny CPU stand-in for the 1b model (--cpu-smoke: checks a script, measures nothing).
CPU_TINY = ["configs/demo.yaml", "run.device=cpu", "train.precision=fp32", "data.seq_len=64",
            "train.micro_batch=2", "data.max_bytes=2000000"]


def run_train(out: Path, name: str, args: list[str], *, ranks: int = 1,
              env: dict[str, str] | None = None, fresh: bool = True,
              timeout: float = 1800) -> Path:
    """Run `hpctrain train` with ``args`` into ``out/name`` (removed first when ``fresh``;
    else the run resumes there); return the run directory (raise with the log tail)."""
    run_dir = out / name
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "hpctrain", "train", *args, *COMMON, f"run.out_dir={out}",
           f"run.name={name}"]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    print("$", " ".join(cmd[2:]), flush=True)
    code, tail, wall = run_command(cmd, timeout=timeout,
                                   env={**os.environ, **MULTICAST_OFF, **(env or {})}, cwd=REPO)
    if code != 0:
        raise RuntimeError(f"{name} failed ({code}):\n{tail}")
    print(f"  {name}: {wall:.0f} s", flush=True)
    return run_dir


def events(run_dir: Path, kind: str, rank: int = 0) -> list[dict]:
    """Metrics events of one kind from one rank (rank 0 unless said)."""
    return [r for r in read_metrics(run_dir / "metrics" / f"rank-{rank:03d}.jsonl")
            if r.get("event") == kind]


def all_ranks(run_dir: Path, kind: str) -> list[dict]:
    """Metrics events of one kind from every rank's file."""
    return [r for path in sorted((run_dir / "metrics").glob("rank-*.jsonl"))
            for r in read_metrics(path) if r.get("event") == kind]


def step_records(run_dir: Path) -> list[dict]:
    """Rank 0's step records."""
    return [r for r in read_metrics(run_dir / "metrics" / "rank-000.jsonl") if "loss" in r]
