"""Walltime and GPU-hours of a run from tokens to train and a measured throughput.

    walltime = tokens / (tokens/s per GPU × GPUs) × (1 + margin)
    GPU-hours = walltime_h × GPUs

The margin (default 15%, 10–20% is usual) covers restarts, checkpoint stalls, evaluation and
queueing between requeues. tokens/s comes from a benchmark or from a pilot run's
``metrics/rank-*.jsonl`` (`tokens_per_s_from_run`: median over the windows after warm-up, per GPU).

Cost and emissions of the planned run (`plan_energy`)::

    cost     = GPU-hours × price per GPU-hour
    GPU kWh  = GPU watts × GPU-hours / 1000             (a mean board power, e.g. the TDP)
          or = tokens × joules/token × (1 + margin) / 3.6e6  (measured by `bench model`)
    site kWh = GPU kWh × PUE                 (cooling, power conversion; 1.0 = the GPUs only)
    CO2e kg  = site kWh × grid gCO2e/kWh / 1000

Worked example: 1T tokens at 8,600 tokens/s per GPU on 256 GPUs, 15% margin -> 37,145 GPU-hours;
at $2.50 per GPU-hour $92,862; at 700 W 26,001 kWh; with PUE 1.2 and 400 gCO2e/kWh 12.5 t CO2e.
Only the GPUs are counted: CPUs, memory, network and storage add to both.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import ConfigError
from hpctrain.records import BadRecord, Int, List, Real, Record

# What `bench model` writes (model.json) and a metrics row, as far as a budget reads them.
_RATE = Real(1e-9)
_STEP = Int()
_BENCH = Record({"rows": List(Record({"tokens_per_s_per_gpu": _RATE,
                                      "joules_per_token": Real(0.0, optional=True,
                                                               nullable=True)}),
                              min_len=1)})


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
    if not math.isfinite(walltime) or walltime > 1e15:  # past 30 million years
        raise ConfigError(f"{tokens:.3g} tokens at {tokens_per_s_per_gpu:.3g} tokens/s per GPU "
                          f"on {gpus} GPUs would take longer than any allocation",
                          expected="a tokens/s measured on the hardware (e.g. --from-run)")
    gpu_hours = walltime / 3600 * gpus
    warning = None
    if warn_gpu_hours is not None and gpu_hours > warn_gpu_hours:
        warning = (f"{gpu_hours:,.0f} GPU-hours exceeds the {warn_gpu_hours:,.0f} threshold: "
                   "check the allocation and run a pilot first")
    return Budget(tokens, tokens_per_s_per_gpu, gpus, margin, walltime, gpu_hours, warning)


@dataclass(frozen=True)
class Energy:
    """Cost and emissions of a planned run; None where the input for it was not given."""

    cost: float | None
    gpu_kwh: float | None
    site_kwh: float | None
    co2e_kg: float | None
    basis: str  # how gpu_kwh was obtained


def plan_energy(budget: Budget, *, price_per_gpu_hour: float | None = None,
                gpu_watts: float | None = None, joules_per_token: float | None = None,
                grid_gco2_per_kwh: float | None = None, pue: float = 1.0) -> Energy:
    """Return cost, energy and CO2e of `budget` from a price, a power or J/token, and the grid."""
    for name, value in (("price per GPU-hour", price_per_gpu_hour), ("GPU watts", gpu_watts),
                        ("joules per token", joules_per_token),
                        ("grid gCO2e/kWh", grid_gco2_per_kwh)):
        if value is not None and value < 0:
            raise ConfigError(f"{name} = {value}", expected="a value >= 0")
    if gpu_watts is not None and joules_per_token is not None:
        raise ConfigError("both GPU watts and joules per token given",
                          expected="one of them", hint="joules/token from `bench model` is "
                          "measured; watts (e.g. the TDP) is an upper-bound guess")
    if pue < 1:
        raise ConfigError(f"PUE = {pue}", expected=">= 1 (1.0 counts the GPUs only)")
    if grid_gco2_per_kwh is not None and gpu_watts is None and joules_per_token is None:
        raise ConfigError("CO2e needs the energy of the run",
                          expected="--gpu-watts W or --joules-per-token J (or --from-bench)",
                          hint="bench model measures joules per token on the GPUs")
    cost = None if price_per_gpu_hour is None else budget.gpu_hours * price_per_gpu_hour
    gpu_kwh, basis = None, "not estimated"
    if gpu_watts is not None:
        gpu_kwh = gpu_watts * budget.gpu_hours / 1000
        basis = f"{gpu_watts:g} W per GPU for {budget.gpu_hours:,.0f} GPU-hours"
    elif joules_per_token is not None:
        gpu_kwh = budget.tokens * joules_per_token * (1 + budget.margin) / 3.6e6
        basis = f"{joules_per_token:.3g} J/token (+{budget.margin:.0%} margin)"
    site_kwh = None if gpu_kwh is None else gpu_kwh * pue
    co2e = None
    if grid_gco2_per_kwh is not None and site_kwh is not None:
        co2e = site_kwh * grid_gco2_per_kwh / 1000
    return Energy(cost, gpu_kwh, site_kwh, co2e, basis)


def from_bench(path: Path) -> tuple[float, float | None]:
    """(tokens/s per GPU, joules/token or None) from a `bench model` results dir or model.json."""
    import json

    p = Path(path)
    p = p / "model.json" if p.is_dir() else p
    if not p.is_file():
        raise ConfigError(f"no bench model results at {path}",
                          expected="a folder written by `hpctrain bench model` (model.json)")
    try:
        results = _BENCH.check(json.loads(p.read_bytes()), p)
    except ValueError as e:  # not JSON
        raise ConfigError(f"{p} is not a bench model result: {str(e)[:80]}",
                          hint="rerun bench model") from None
    except BadRecord as e:
        raise ConfigError(f"{p} holds no usable tokens_per_s_per_gpu: {e.what}",
                          expected=e.expected, hint="rerun bench model") from None
    first = results["rows"][0]
    return float(first["tokens_per_s_per_gpu"]), first.get("joules_per_token")


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
        # A metrics file is read back, not trusted: a rate that is not a positive finite
        # number, or a row without a step, does not count.
        rows = [r for r in read_metrics(path)
                if _RATE.problem(r.get("tokens_per_s"), "") is None
                and _STEP.problem(r.get("step"), "") is None]
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
