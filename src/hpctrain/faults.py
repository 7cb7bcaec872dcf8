"""Fault injection for the fault-tolerance tests; inert unless ``HPCTRAIN_FAULTS`` is set.

The test suite proves recovery by causing the failures it recovers from, in real processes:

    HPCTRAIN_FAULTS="save_io_error@step=4;nan@step=5-7;hang@step=3,rank=1"

Each entry is ``kind@key=value,...``; ``step`` takes a number or an inclusive range, ``rank``
limits the fault to one rank (default: all). ``slow@step=1-20,rank=1,seconds=0.3`` makes a rank
a straggler: it sleeps that long inside each forward pass of those steps.
"""

from __future__ import annotations

import errno
import os
from functools import cache

KINDS = ("save_io_error", "nan", "hang", "slow")


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
    for k, params in _specs():
        if k == kind and _matches(params, step, rank):
            return params
    return None


def maybe_fail_save(step: int) -> None:
    """Raise the error a full disk gives, if a ``save_io_error`` fault is set for this step."""
    if active("save_io_error", step):
        raise OSError(errno.ENOSPC, "No space left on device (injected by HPCTRAIN_FAULTS)")
