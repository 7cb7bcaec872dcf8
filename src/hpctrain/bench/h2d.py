"""Host<->device bandwidth: pageable vs pinned host memory, blocking vs ``non_blocking`` copies.

    hpctrain bench h2d --sizes 256M

Pageable copies go through a driver staging buffer and are synchronous for the host whatever
``non_blocking`` says; pinned memory lets the DMA engine read host memory directly and lets a
non-blocking copy overlap with compute. GB = 1e9 bytes.
"""

from __future__ import annotations

import torch

from hpctrain.bench.common import Results, device_name, median, time_each
from hpctrain.errors import ConfigError

COLUMNS = ["direction", "host_memory", "non_blocking", "size", "time_us", "gbps"]


def run_h2d(sizes: list[int], device: torch.device, *, warmup: int = 3,
            iters: int = 10) -> Results:
    """Time host->device and device->host copies for every memory kind and blocking mode."""
    if device.type != "cuda":
        raise ConfigError("bench h2d measures host<->GPU copies, but the device is the CPU",
                          expected="a CUDA device (--device cuda or auto on a GPU node)",
                          hint="run it on a GPU node; membw and gemm also run on the CPU")
    res = Results("h2d", COLUMNS, meta={"device": device_name(device), "warmup": warmup,
                                        "iters": iters})
    for size in sizes:
        count = max(1, size // 4)
        dev = torch.randn(count, device=device)
        for pinned in (False, True):
            host = torch.randn(count).pin_memory() if pinned else torch.randn(count)
            for direction in ("h2d", "d2h"):
                for non_blocking in (False, True):
                    if direction == "h2d":
                        def fn(h=host, d=dev, nb=non_blocking):
                            d.copy_(h, non_blocking=nb)
                    else:
                        def fn(h=host, d=dev, nb=non_blocking):
                            h.copy_(d, non_blocking=nb)
                    t = median(time_each(fn, device, warmup=warmup, iters=iters))
                    res.add(direction=direction, host_memory="pinned" if pinned else "pageable",
                            non_blocking=non_blocking, size=count * 4, time_us=t * 1e6,
                            gbps=count * 4 / t / 1e9)
    return res
