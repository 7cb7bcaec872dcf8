"""Checkpoint interval from save time δ and the job's mean time to failure M (Young, Daly).

Young (1974): ``T = sqrt(2·δ·M)``. Daly (2006), higher order:
``T = sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ`` for δ < 2M, else ``T = M``.
Worked example (FIELD_NOTES): δ = 5 min, M = 24 h = 1440 min → Young 120.0 min, Daly 116.7 min.

A job on n GPUs fails when any of them does: ``M_job = M_gpu / n`` (exponential failures). Llama 3
saw one interruption every ~3.1 h on 16,384 H100s, i.e. ~50k GPU-hours per GPU.
"""

from __future__ import annotations

import math

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
