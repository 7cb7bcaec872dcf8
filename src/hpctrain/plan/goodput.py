"""Expected goodput of a run under failures (Daly's model), and where the rest of the time goes.

With failures arriving at random (exponential, mean M: the job's MTTF), a checkpoint after
every τ seconds of training that costs the run δ (the stall plus the slowdown of the steps
beside its background write: ``goodput.json``'s ``checkpoint_cost_s``) and R to get going again
after a failure (the gap and the next attempt's start-up), Daly (2006) gives the expected wall
time per second of training::

    T_wall / T_work = M · e^(R/M) · (e^((τ+δ)/M) − 1) / τ

so goodput = τ / (M · e^(R/M) · (e^((τ+δ)/M) − 1)). To first order the lost fraction is
δ/(τ+δ) for checkpoints, (τ+δ)/(2M) for work computed again and R/M for restarts; the split
printed scales these to the exact total. Start-up of the first attempt, data waits and
validation are not failures and are left out (see ``hpctrain plan budget`` for the whole run).

    hpctrain plan goodput --gpus 1024 --save-s 20 --restart-s 300   # checkpoint.mttf_gpu_hours
    hpctrain plan goodput --mttf-h 24 --from-run runs/pilot --interval-min 30
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.errors import ConfigError
from hpctrain.plan.interval import daly_interval


@dataclass(frozen=True)
class GoodputPrediction:
    """Expected goodput and the expected shares of the lost time (fractions of wall time)."""

    goodput: float
    checkpoint: float
    lost_work: float
    restart: float
    interval_s: float


def predict_goodput(mttf_s: float, save_s: float, restart_s: float,
                    interval_s: float | None = None) -> GoodputPrediction:
    """Daly's expected goodput; ``interval_s`` (training time between saves) defaults to his
    optimum for this save cost and MTTF."""
    if mttf_s <= 0 or save_s < 0 or restart_s < 0:
        raise ConfigError(f"MTTF {mttf_s} s, save {save_s} s, restart {restart_s} s",
                          expected="a positive MTTF and non-negative costs")
    tau = interval_s if interval_s is not None else daly_interval(max(save_s, 1e-9), mttf_s)
    if tau <= 0:
        raise ConfigError(f"checkpoint interval {tau} s", expected="a positive interval")
    m = mttf_s
    x = (tau + save_s) / m
    if x < 700:
        goodput = tau * math.exp(-restart_s / m) / (m * math.expm1(x))
    else:  # expm1 would overflow; goodput is ~0 and computed in the log domain
        goodput = math.exp(math.log(tau / m) - restart_s / m - x)
    shares = {"checkpoint": save_s / (tau + save_s), "lost_work": (tau + save_s) / (2 * m),
              "restart": restart_s / m}
    total = sum(shares.values())
    scale = (1 - goodput) / total if total > 0 else 0.0
    return GoodputPrediction(goodput, shares["checkpoint"] * scale,
                             shares["lost_work"] * scale, shares["restart"] * scale, tau)
