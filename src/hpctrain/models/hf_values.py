"""Values read from a Hugging Face ``config.json``, checked the same way for every family: an
untrusted file, so a count that is not a positive integer (a bool is not one) or a size that is
not a finite positive number is a ConfigError naming the file and the key."""

from __future__ import annotations

import math
from typing import Any

from hpctrain.errors import ConfigError


def positive_int(raw: dict, key: str, where: str, default: int | None = None) -> int:
    """``raw[key]`` (else ``default``), refused unless a positive integer."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} = {value!r} is not a positive integer")
    return value


def positive_number(value: Any, key: str, where: str) -> float:
    """``value`` (read from ``key``), refused unless a finite positive number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value <= 0:
        raise ConfigError(f"{where}: {key} = {value!r} is not a positive number")
    return float(value)
