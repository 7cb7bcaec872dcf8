"""When to save: every N steps, every N minutes, the automatic interval, before the time limit.

Time-based decisions are taken on rank 0 and shared through the per-step control exchange, so
every rank saves at the same step even though their clocks differ.

``auto`` (the default) is :func:`hpctrain.plan.interval.auto_interval` — Daly's optimum from the
measured cost of a save and the job's MTTF, never below cost / ``max_overhead`` — re-derived
after every save; the first save comes after ``first_minutes``. A time-based save never starts
while the previous one is still writing: it is postponed until that one has committed.

Under Slurm one more save is due when the job's end time is nearer than the longest save
measured so far (stall plus background write) plus ``limit_margin_minutes``.

Intervals are measured on the monotonic clock: the wall clock jumps when NTP steps it, which
would make a save come at once or not for hours. Only the Slurm end time, a wall-clock time,
is compared with the wall clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.plan.interval import AutoInterval, auto_interval, job_mttf

log = logging.getLogger("hpctrain.checkpoint")


class SaveSchedule:
    """Decides whether a step ends with a save."""

    def __init__(self, cfg: CheckpointConfig, n_gpus: int, *, end_time: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.n_gpus = n_gpus
        self.clock = clock  # intervals
        self.wall_clock = wall_clock  # only against end_time (Unix time)
        self.minutes = {"minutes": cfg.every_minutes,
                        "auto": cfg.first_minutes}.get(cfg.cadence)
        self.choice: AutoInterval | None = None  # the automatic interval, once a save is timed
        self._said: AutoInterval | None = None  # the last one the log announced
        self.end_time = end_time if cfg.saves_before_limit else None
        self.longest_save_s = 0.0  # stall + background write, the longest so far
        self._limit_saved = False
        self._last = clock()
        if cfg.cadence == "auto":
            log.info("checkpoint interval auto: first save after %.1f min (checkpoint."
                     "first_minutes), then Daly's optimum from its measured cost, at most "
                     "%.1f%% of the run (checkpoint.max_overhead)", self.minutes,
                     cfg.max_overhead * 100)

    def due_by_step(self, step: int) -> bool:
        """Step-based cadence: identical on every rank without communication."""
        return self.cfg.cadence == "steps" and step % self.cfg.every_steps == 0

    def due_by_time(self, in_flight: bool = False) -> bool:
        """Rank 0's time-based answer (shared with the others by the caller): the interval has
        passed and no save is still writing (``in_flight``), or the time limit is near."""
        if self._near_limit(self.wall_clock()):
            return True
        if self.minutes is None or in_flight:
            return False
        return self.clock() - self._last >= self.minutes * 60

    def _near_limit(self, now: float) -> bool:
        """Once: the job ends before a save started now would commit (with the margin)."""
        if self.end_time is None or self._limit_saved:
            return False
        left = self.end_time - now
        if left > self.longest_save_s + self.cfg.limit_margin_minutes * 60:
            return False
        self._limit_saved = True
        log.warning("saving a checkpoint now: the job's time limit is %.0f s away (longest "
                    "save so far %.1f s, checkpoint.limit_margin_minutes %.1f)", left,
                    self.longest_save_s, self.cfg.limit_margin_minutes)
        return True

    def committed(self, save_s: float) -> None:
        """A save took ``save_s`` from its start to its commit (the time-limit margin)."""
        self.longest_save_s = max(self.longest_save_s, save_s)

    def saved(self, cost_s: float) -> None:
        """Restart the clock; under ``auto`` re-derive the interval from the measured cost of a
        save: what it costs the run (the loop's stall plus the slowdown of the steps beside its
        background write, see observe/goodput.py), not the stall alone."""
        self._last = self.clock()
        if self.cfg.cadence != "auto":
            return
        mttf_s = job_mttf(self.cfg.mttf_gpu_hours * 3600, self.n_gpus)
        choice = auto_interval(cost_s, mttf_s, self.cfg.max_overhead)
        self.choice = choice
        self.minutes = choice.seconds / 60
        # Said once per change: every save's cost differs a little, and a line per save that
        # repeats the interval would be noise. A change is 10%, or another bound taking over.
        said = self._said
        if (said is None or said.bound_by_overhead != choice.bound_by_overhead
                or abs(choice.seconds - said.seconds) > 0.1 * said.seconds):
            self._said = choice
            log.info("checkpoint interval: %s", choice.reason())
