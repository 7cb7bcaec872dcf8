"""Fault injection for the fault-tolerance tests; inert unless ``HPCTRAIN_FAULTS`` is set.

The test suite proves recovery by causing the failures it recovers from, in real processes:

    HPCTRAIN_FAULTS="save_io_error@step=4;nan@step=5-7;hang@step=3,rank=1"

Each entry is ``kind@key=value,...``; ``step`` takes a number or an inclusive range, ``rank``
limits the fault to one rank (default: all). ``slow@step=1-20,rank=1,seconds=0.3`` makes a rank
a straggler: it sleeps that long inside each forward pass of those steps.
``slow_save@step=S,seconds=T`` holds the write of the checkpoint of step S for T seconds (a save
still in flight, on demand). ``hang@step=S,seconds=T,until=PATH`` holds the run before step S
for T seconds or until the file PATH exists, whichever comes first (a test that has done what
it held the run for lets it go on; PATH holds no ``,`` or ``;``). ``once=1`` makes an entry fire
only the first time it matches in a process (a rollback repeats step numbers).
"""

from __future__ import annotations

import errno
import os
import time
from functools import cache

KINDS = ("save_io_error", "nan", "hang", "slow", "slow_save")

# Entries with once=1 that have fired in this process (by position in HPCTRAIN_FAULTS).
_fired: set[int] = set()


@cache
def _specs() -> tuple[tuple[str, dict[str, str]], ...]:
    raw = os.environ.get("HPCTRAIN_FAULTS", "").strip()
    specs = []
    for entry in filter(None, (e.strip() for e in raw.split(";"))):
        kind, _, args = entry.partition("@")
        if kind not in KINDS:
            raise ValueError(f"HPCTRAIN_FAULTS: unknown fault {kind!r}; known: {KINDS}")
        params = dict(kv.split("=", 1) for kv in args.split(",") if kv)
        specs.append((kind, params))
    return tuple(specs)


def _matches(params: dict[str, str], step: int, rank: int) -> bool:
    if "rank" in params and int(params["rank"]) != rank:
        return False
    lo, _, hi = params.get("step", "").partition("-")
    if not lo:
        return True
    return int(lo) <= step <= int(hi or lo)


def active(kind: str, step: int, rank: int | None = None) -> dict[str, str] | None:
    """The parameters of an injected fault of ``kind`` at this step and rank, else None."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    for i, (k, params) in enumerate(_specs()):
        if k == kind and _matches(params, step, rank) and i not in _fired:
            if params.get("once") == "1":
                _fired.add(i)
            return params
    return None


def maybe_fail_save(step: int) -> None:
    """Raise the error a full disk gives, if a ``save_io_error`` fault is set for this step."""
    if active("save_io_error", step):
        raise OSError(errno.ENOSPC, "No space left on device (injected by HPCTRAIN_FAULTS)")


def maybe_slow_save(step: int) -> None:
    """Sleep inside the checkpoint write, if a ``slow_save`` fault is set for this step."""
    params = active("slow_save", step)
    if params:
        time.sleep(float(params.get("seconds", 5)))
