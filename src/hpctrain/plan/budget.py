"""Walltime and GPU-hours of a run from tokens to train and a measured throughput.

    walltime = tokens / (tokens/s per GPU × GPUs) × (1 + margin)
    GPU-hours = walltime_h × GPUs

The margin (default 15%, 10–20% is usual) covers restarts, checkpoint stalls, evaluation and
queueing between requeues. tokens/s comes from a benchmark or from a pilot run's
``metrics/rank-*.jsonl`` (`tokens_per_s_from_run`: median over the windows after warm-up, per GPU).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import ConfigError


@dataclass(frozen=True)
class Budget:
    """A planned run: wall-clock time, GPU-hours, and a warning when over the threshold."""

    tokens: float
    tokens_per_s_per_gpu: float
    gpus: int
    margin: float
    walltime_s: float
    gpu_hours: float
    warning: str | None


def plan_budget(tokens: float, tokens_per_s_per_gpu: float, gpus: int, *, margin: float = 0.15,
                warn_gpu_hours: float | None = 10_000.0) -> Budget:
    """Return walltime (with `margin`) and GPU-hours; warn above `warn_gpu_hours`."""
    if tokens <= 0 or tokens_per_s_per_gpu <= 0:
        raise ConfigError(f"tokens={tokens}, tokens/s={tokens_per_s_per_gpu}",
                          expected="both positive")
    if gpus < 1:
        raise ConfigError(f"gpus={gpus}", expected="at least 1")
    if not 0 <= margin < 1:
        raise ConfigError(f"margin={margin}", expected="a fraction such as 0.1-0.2")
    walltime = tokens / (tokens_per_s_per_gpu * gpus) * (1 + margin)
    gpu_hours = walltime / 3600 * gpus
    warning = None
    if warn_gpu_hours is not None and gpu_hours > warn_gpu_hours:
        warning = (f"{gpu_hours:,.0f} GPU-hours exceeds the {warn_gpu_hours:,.0f} threshold: "
                   "check the allocation and run a pilot first")
    return Budget(tokens, tokens_per_s_per_gpu, gpus, margin, walltime, gpu_hours, warning)


def tokens_per_s_from_run(run_dir: Path, skip_fraction: float = 0.4) -> float:
    """Per-GPU tokens/s of a pilot run: median after the first `skip_fraction` of logged steps,
    averaged over ranks."""
    from hpctrain.observe.metrics import read_metrics

    files = sorted((Path(run_dir) / "metrics").glob("rank-*.jsonl"))
    if not files:
        raise ConfigError(f"no metrics/rank-*.jsonl under {run_dir}",
                          expected="a run directory written by `hpctrain train`",
                          hint="pass --tokens-per-s instead, or point at the pilot's run dir")
    per_rank = []
    for path in files:
        rows = [r for r in read_metrics(path) if isinstance(r.get("tokens_per_s"), int | float)]
        if not rows:
            continue
        last = max(r["step"] for r in rows)
        kept = [r["tokens_per_s"] for r in rows if r["step"] > skip_fraction * last] or \
            [r["tokens_per_s"] for r in rows]
        per_rank.append(statistics.median(kept))
    if not per_rank:
        raise ConfigError(f"no tokens_per_s records in {run_dir}/metrics",
                          hint="let the pilot run at least one logging window")
    return statistics.mean(per_rank)


def format_duration(seconds: float) -> str:
    """'3d 04:05' / '04:05:06' style duration."""
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    return f"{days}d {h:02d}:{m:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"
