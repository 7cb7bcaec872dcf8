"""When to save: every N steps, every N minutes, or the Young/Daly optimum.

Time-based decisions are taken on rank 0 and shared through the per-step control exchange, so
every rank saves at the same step even though their clocks differ.
"""

from __future__ import annotations

import logging
import time

from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.plan.interval import daly_interval, job_mttf, young_interval

log = logging.getLogger("hpctrain.checkpoint")


class SaveSchedule:
    """Decides whether a step ends with a save."""

    def __init__(self, cfg: CheckpointConfig, n_gpus: int):
        self.cfg = cfg
        self.n_gpus = n_gpus
        self.minutes = cfg.every if cfg.interval in ("minutes", "auto") else None
        self._last = time.monotonic()

    def due_by_step(self, step: int) -> bool:
        """Step-based cadence: identical on every rank without communication."""
        return self.cfg.interval == "steps" and step % int(self.cfg.every) == 0

    def due_by_time(self) -> bool:
        """Time-based cadence, meaningful on rank 0 (shared with the others by the caller)."""
        if self.minutes is None:
            return False
        return time.monotonic() - self._last >= self.minutes * 60

    def saved(self, cost_s: float) -> None:
        """Restart the clock; under ``auto`` re-derive the interval from the measured cost of a
        save: what it costs the run (the loop's stall plus the slowdown of the steps beside its
        background write, see observe/goodput.py), not the stall alone."""
        self._last = time.monotonic()
        if self.cfg.interval != "auto":
            return
        mttf_s = job_mttf(self.cfg.mttf_gpu_hours * 3600, self.n_gpus)
        # Never below 1 s, so a near-free async save does not schedule saves back to back.
        delta = max(cost_s, 1.0)
        self.minutes = daly_interval(delta, mttf_s) / 60
        log.info("checkpoint interval (Daly): %.1f min from save cost %.2f s and job MTTF "
                 "%.1f h (%.0f GPU-h per GPU / %d GPUs); Young: %.1f min",
                 self.minutes, delta, mttf_s / 3600, self.cfg.mttf_gpu_hours, self.n_gpus,
                 young_interval(delta, mttf_s) / 60)
