"""Numbers on the command line: finite, in a range, or argparse refuses them (exit 2).

``float("nan")``, ``float("inf")``, ``1e400`` and negative counts all parse as numbers; every
numeric option of ``plan``, ``bench``, ``tune``, ``data``, ``sbatch``/``submit`` goes through
one of these types instead, so a bad value stops with a message naming the option and the range:

    p.add_argument("--save-min", type=real(minimum=0, open_min=True))   # > 0, finite
    p.add_argument("--gpus", type=count(1))                              # integer >= 1
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from hpctrain.shown import quoted

# Far above any real value of an option here, far below where float arithmetic overflows.
HUGE = 1e18
MAX_INT = 2**40
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\+?\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def real(minimum: float = 0.0, maximum: float = HUGE, *,
         open_min: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in [minimum, maximum] (``open_min``: > minimum)."""
    low = f"> {minimum:g}" if open_min else f">= {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{quoted(text, 40)} is not a number") from None
        if not (math.isfinite(value) and (value > minimum if open_min else value >= minimum)
                and value <= maximum):
            raise argparse.ArgumentTypeError(
                f"{quoted(text, 40)} is out of range: expected a finite number {low} and "
                f"<= {maximum:g}")
        return value

    parse.__name__ = "number"  # argparse names the type in its message
    return parse


def count(minimum: int = 0, maximum: int = MAX_INT) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{quoted(text, 40)} is not an integer") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: expected an integer from {minimum} to {maximum}")
        return value

    parse.__name__ = "integer"
    return parse


def big_count(text: str, maximum: float = HUGE) -> float:
    """'300B' -> 3e11, '1T' -> 1e12, '2e9' -> 2e9 (decimal suffixes, as for token counts);
    ValueError for anything else, zero, or more than ``maximum``."""
    match = _COUNT.match(text)
    if match is None:
        raise ValueError(f"{quoted(text, 40)} is not a count (e.g. 300B, 1T, 2e12)")
    value = float(match.group(1)) * _SCALE[match.group(2).lower()]
    if not (math.isfinite(value) and 0 < value <= maximum):
        raise ValueError(f"{quoted(text, 40)} is out of range: expected more than 0 and at most "
                         f"{maximum:g}")
    return value
