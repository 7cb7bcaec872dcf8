"""The measured windows of a run that fell more than 5% below its median, and what was in them.

A benchmark's rate is the median of its logging windows; a window well below it is either
something the run did (a checkpoint, a validation, a profile), a data stall, one rank's CPU
falling behind its GPU, or something the metrics cannot see (the GPU or the network). Every
slow window is listed with the evidence the metrics files hold, and a cause read from it:

- ``events: checkpoint, ...`` where a run event fell in the window (an event at step ``e``
  happened after step ``e``'s window was logged, so it counts in the window that follows);
- ``data wait`` where some rank waited for its batches 5% of the step or more;
- ``rank R behind its CPU`` where that rank's host waited at the window's sync less than a tenth
  of what the ranks' median waited, that median being 1 ms or more (its GPU was waiting for
  launches: ``host_wait_s``);
- otherwise ``not in the metrics (GPU or communication)``.

    slow = slow_windows(windows, events, first_step=10, last_step=40)  # bench.model.summarise
    # [{"step": 30, "tokens_per_s": 47210.0, "below_median": 0.081, "cause": "events: checkpoint",
    #   "data_time_s": 0.0004, "host_wait_s": [0.061, 0.059, 0.002, 0.060], "events": [...]}]
"""

from __future__ import annotations

import statistics
from typing import Any

THRESHOLD = 0.05  # a window this far below the median is listed
DATA_SHARE = 0.05  # a data wait of this share of the step counts as a cause
CPU_BEHIND = 0.1  # a rank waiting less than this share of the ranks' median wait is behind
# Below this median wait no host was ahead of its device at all (a CPU run, whose "device" never
# lags, or every rank launch-bound): one rank cannot be told apart from the others.
MIN_WAIT_S = 1e-3


def slow_windows(windows: list[list[dict[str, Any]]], events: list[dict[str, Any]],
                 first_step: int, last_step: int,
                 threshold: float = THRESHOLD) -> list[dict[str, Any]]:
    """The windows ending in ``(first_step, last_step]`` (the measured span) whose rank-0
    tokens/s fell more than ``threshold`` below the span's median, each with its evidence.

    ``windows``: per rank, its step records; ``events``: the other metrics records of all
    ranks (run events, validation results).
    """
    ends = [r["step"] for r in windows[0]]
    measured = [r for r in windows[0] if first_step < r["step"] <= last_step]
    if not measured:
        return []
    median = statistics.median(r["tokens_per_s"] for r in measured)
    events = [e for e in events if "event" in e or "val_loss" in e]
    slow = []
    for record in measured:
        below = 1 - record["tokens_per_s"] / median
        if below <= threshold:
            continue
        step = record["step"]
        start = max((e for e in ends if e < step), default=0)
        same = [next((r for r in rank if r["step"] == step), None) for rank in windows]
        found = sorted({_name(e) for e in events if _in_window(e, start, step)})
        waits = [None if r is None else r.get("host_wait_s") for r in same]
        data = max((r.get("data_time_s", 0.0) for r in same if r is not None), default=0.0)
        slow.append({"step": step, "tokens_per_s": record["tokens_per_s"],
                     "below_median": round(below, 4),
                     "cause": _cause(found, data, record.get("step_time_s"), waits),
                     "data_time_s": data, "host_wait_s": waits, "events": found})
    return slow


def _name(event: dict[str, Any]) -> str:
    return event.get("event") or "validation"


def _in_window(event: dict[str, Any], start: int, end: int) -> bool:
    """Whether ``event`` cost time in the window of steps ``(start, end]``."""
    if "first_step" in event:  # a profile spans its steps
        return event["first_step"] <= end and event.get("last_step", end) > start
    step = event.get("step")
    # Written after step's window was logged: its time falls in the next window.
    return isinstance(step, int) and start <= step < end


def _cause(events: list[str], data_time: float, step_time: float | None,
           waits: list[float | None]) -> str:
    if events:
        return "events: " + ", ".join(events)
    if step_time and data_time >= DATA_SHARE * step_time:
        return "data wait"
    known = [w for w in waits if w is not None]
    if len(known) > 1:
        typical = statistics.median(known)
        behind = [r for r, w in enumerate(waits) if w is not None and w < CPU_BEHIND * typical]
        if behind and typical >= MIN_WAIT_S:
            return ", ".join(f"rank {r}" for r in behind) + " behind its CPU"
    return "not in the metrics (GPU or communication)"
