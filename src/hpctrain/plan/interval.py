"""Checkpoint interval from save time δ and the job's mean time to failure M (Young, Daly).

Young (1974): ``T = sqrt(2·δ·M)``. Daly (2006), higher order:
``T = sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ`` for δ < 2M, else ``T = M``.
Worked example (FIELD_NOTES): δ = 5 min, M = 24 h = 1440 min → Young 120.0 min, Daly 116.7 min.

A job on n GPUs fails when any of them does: ``M_job = M_gpu / n`` (exponential failures). Llama 3
saw one interruption every ~3.1 h on 16,384 H100s, i.e. ~50k GPU-hours per GPU.

``checkpoint.interval=auto`` (the training default) and ``hpctrain plan interval`` both take
their answer from :func:`auto_interval`: Daly's optimum, but never so often that saves cost more
than ``max_overhead`` of the run (interval >= save cost / max_overhead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.errors import ConfigError


def young_interval(save_s: float, mttf_s: float) -> float:
    """Young's optimal checkpoint interval, in the units of the inputs."""
    _check(save_s, mttf_s)
    return math.sqrt(2.0 * save_s * mttf_s)


def daly_interval(save_s: float, mttf_s: float) -> float:
    """Daly's higher-order optimal checkpoint interval (compute time between saves)."""
    _check(save_s, mttf_s)
    if save_s >= 2.0 * mttf_s:
        return mttf_s
    r = save_s / (2.0 * mttf_s)
    return math.sqrt(2.0 * save_s * mttf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - save_s


@dataclass(frozen=True)
class AutoInterval:
    """The interval ``checkpoint.interval=auto`` picks, with the numbers behind it (seconds)."""

    seconds: float
    save_s: float
    mttf_s: float
    daly_s: float
    floor_s: float  # save cost / max_overhead
    max_overhead: float

    @property
    def bound_by_overhead(self) -> bool:
        """Whether the overhead cap, not Daly, set the interval."""
        return self.floor_s > self.daly_s

    def reason(self) -> str:
        """Why this interval, in one line (the training log and ``plan interval`` say it)."""
        why = (f"the {self.max_overhead:.1%} overhead cap, save cost / {self.max_overhead:g} "
               f"(Daly's optimum: {self.daly_s / 60:.1f} min)" if self.bound_by_overhead
               else f"Daly's optimum (the {self.max_overhead:.1%} overhead cap needs at least "
               f"{self.floor_s / 60:.1f} min)")
        return (f"{self.seconds / 60:.1f} min from a save cost of {self.save_s:.2f} s and a job "
                f"MTTF of {self.mttf_s / 3600:.1f} h: {why}")


# A near-free save still counts as one second, so saves never come back to back.
_MIN_SAVE_S = 1.0


def auto_interval(save_s: float, mttf_s: float, max_overhead: float = 0.01) -> AutoInterval:
    """Daly's interval for a save costing ``save_s``, at least ``save_s / max_overhead``."""
    if not 0 < max_overhead < 1:
        raise ConfigError(f"max overhead {max_overhead}", expected="a fraction in (0, 1)",
                          hint="0.01 keeps periodic saves at or below 1% of the run")
    delta = max(save_s, _MIN_SAVE_S)
    daly = daly_interval(delta, mttf_s)
    floor = delta / max_overhead
    return AutoInterval(max(daly, floor), delta, mttf_s, daly, floor, max_overhead)


def job_mttf(per_gpu_mttf: float, n_gpus: int) -> float:
    """MTTF of a job on `n_gpus` GPUs, each failing independently with MTTF `per_gpu_mttf`."""
    if n_gpus < 1:
        raise ConfigError(f"{n_gpus} GPUs", expected="at least 1 GPU")
    if per_gpu_mttf <= 0:
        raise ConfigError(f"per-GPU MTTF {per_gpu_mttf}", expected="a positive time")
    return per_gpu_mttf / n_gpus


def _check(save_s: float, mttf_s: float) -> None:
    if save_s <= 0 or mttf_s <= 0:
        raise ConfigError(f"save time {save_s} and MTTF {mttf_s}",
                          expected="both positive", hint="e.g. --save-min 5 --mttf-h 24")
