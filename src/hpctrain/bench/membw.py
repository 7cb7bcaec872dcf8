"""Device memory bandwidth: ``dst.copy_(src)`` counted as bytes read + bytes written.

    hpctrain bench membw --sizes 1G

The datasheet bandwidth is the total the memory system moves, so a copy of S bytes that reaches
the datasheet takes 2·S / bandwidth (read S, write S).
"""

from __future__ import annotations

import re

import torch

from hpctrain.bench.common import Results, device_name, median, time_each

# Datasheet HBM bandwidth, TB/s (1e12 B/s). First match on the lower-cased name wins.
_DATASHEET_TBPS: list[tuple[str, float]] = [
    (r"\bh100\b.*\bnvl\b", 3.9),
    (r"\bh100\b.*\bpcie\b", 2.0),
    (r"\bh100\b", 3.35),
    (r"\bh200\b", 4.8),
    (r"\bb200\b", 8.0),
    (r"\ba100\b.*80", 2.039),
    (r"\ba100\b", 1.555),
    (r"\bmi300x\b", 5.3),
]

COLUMNS = ["size", "time_us", "gbps", "datasheet_gbps", "pct_of_datasheet"]


def datasheet_gbps(name: str) -> float | None:
    """Datasheet memory bandwidth of device `name` in GB/s, or None when not known."""
    lowered = name.lower()
    for pattern, tbps in _DATASHEET_TBPS:
        if re.search(pattern, lowered):
            return tbps * 1000
    return None


def run_membw(sizes: list[int], device: torch.device, *, warmup: int = 5,
              iters: int = 20) -> Results:
    """Time a device-to-device copy of each size; GB/s counts read + write."""
    name = device_name(device)
    sheet = datasheet_gbps(name) if device.type == "cuda" else None
    res = Results("membw", COLUMNS, meta={"device": name, "warmup": warmup, "iters": iters})
    for size in sizes:
        count = max(1, size // 4)
        g = torch.Generator(device=device).manual_seed(0)
        src = torch.randn(count, device=device, generator=g)
        dst = torch.empty_like(src)
        t = median(time_each(lambda s=src, d=dst: d.copy_(s), device, warmup=warmup,
                             iters=iters))
        gbps = 2 * count * 4 / t / 1e9
        res.add(size=count * 4, time_us=t * 1e6, gbps=gbps, datasheet_gbps=sheet,
                pct_of_datasheet=100 * gbps / sheet if sheet else None)
    return res
