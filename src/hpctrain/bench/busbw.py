"""Algorithm and bus bandwidth exactly as nccl-tests defines them (doc/PERFORMANCE.md there).

``algbw = S / t`` with GB = 1e9 bytes, and ``busbw = algbw * factor(op, n)``: the factor turns
the rate one rank sees into the rate each link carries, so busbw is comparable across rank
counts and with the hardware's link bandwidth. ``S`` is nccl-tests' size: the buffer of one rank
for all_reduce/broadcast/reduce/sendrecv, and the *total* (gathered / pre-scatter / all-peer)
buffer for all_gather, reduce_scatter and alltoall.

    busbw_factor("all_reduce", 4)   # 1.5  = 2(n-1)/n
    busbw_factor("all_gather", 4)   # 0.75 = (n-1)/n
"""

from __future__ import annotations

from hpctrain.errors import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
       "sendrecv")


def busbw_factor(op: str, n: int) -> float:
    """Return nccl-tests' bus-bandwidth factor of collective `op` over `n` ranks."""
    if n < 1:
        raise ConfigError(f"{n} ranks", expected="at least 1 rank")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ConfigError(f"unknown collective {op!r}", expected=f"one of {', '.join(OPS)}")


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Return S / t in GB/s (GB = 1e9 bytes), as nccl-tests' algbw column."""
    return size_bytes / seconds / 1e9


def busbw_gbps(op: str, n: int, size_bytes: int, seconds: float) -> float:
    """Return algbw x factor in GB/s, as nccl-tests' busbw column."""
    return algbw_gbps(size_bytes, seconds) * busbw_factor(op, n)
