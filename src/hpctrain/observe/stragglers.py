"""Live straggler detection from the per-window timings every rank shares.

In synchronous training every rank's step takes as long as the slowest rank's: the others wait
inside the collectives. So the step time is the same everywhere and names nobody. What differs
is each rank's *own time*: the part of a step no peer waits in. We take the data wait (local on
every layout) plus the forward pass where it holds no collective (one process, DDP: timed with
host clocks on the CPU, CUDA events on a GPU). Under FSDP, tensor or pipeline parallelism the
forward waits for peers too, so there own time is the data wait alone: a slow input pipeline is
named, a slow GPU shows in a profile (``profile.steps``).

A rank whose own time exceeds the median rank's by more than ``metrics.straggler_threshold``
of the median step time, for ``metrics.straggler_windows`` windows in a row, is named once per
streak (rank and host) in the log and as a metrics event on rank 0:

    {"event": "straggler", "step": 120, "straggler_rank": 5, "straggler_host": "gpu-b3",
     "own_time_s": 0.41, "median_own_time_s": 0.12, "slower_by": 0.31, "windows": 3}

``slower_by`` is the excess as a fraction of the median step time. When it recovers:
``{"event": "straggler_recovered", "step", "straggler_rank", "straggler_host"}``.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

log = logging.getLogger("hpctrain.stragglers")


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean seconds per step over a logging window."""

    own: float
    step: float


class StragglerDetector:
    """Counts, per rank, the windows in a row it ran slower than the median rank."""

    def __init__(self, hosts: list[str], threshold: float, windows: int, *, quiet: bool = False):
        self.hosts = hosts
        self.quiet = quiet  # judging a finished run (the report): no log lines
        self.threshold = threshold
        self.windows = windows
        self._streak = [0] * len(hosts)
        self._named = [False] * len(hosts)

    def update(self, step: int, times: list[RankTimes]) -> list[dict]:
        """Judge one window; returns the events it gives (rank 0 writes them)."""
        if len(times) < 2:
            return []
        median_own = statistics.median(t.own for t in times)
        median_step = statistics.median(t.step for t in times)
        if median_step <= 0:
            return []
        events = []
        for rank, t in enumerate(times):
            excess = (t.own - median_own) / median_step
            host = self.hosts[rank] if rank < len(self.hosts) else None
            if excess > self.threshold:
                self._streak[rank] += 1
                if self._streak[rank] >= self.windows and not self._named[rank]:
                    self._named[rank] = True
                    events.append({"event": "straggler", "step": step, "straggler_rank": rank,
                                   "straggler_host": host, "own_time_s": t.own,
                                   "median_own_time_s": median_own, "slower_by": excess,
                                   "windows": self._streak[rank]})
                    if not self.quiet:
                        log.warning("straggler: rank %d on %s is slower than the median rank by "
                                    "%.0f%% of a step (own time %.3f s vs %.3f s per step) for "
                                    "%d windows", rank, host, 100 * excess, t.own, median_own,
                                    self._streak[rank])
            else:
                if self._named[rank]:
                    events.append({"event": "straggler_recovered", "step": step,
                                   "straggler_rank": rank, "straggler_host": host})
                    if not self.quiet:
                        log.info("straggler: rank %d on %s is back within the threshold", rank,
                                 host)
                self._streak[rank] = 0
                self._named[rank] = False
        return events
