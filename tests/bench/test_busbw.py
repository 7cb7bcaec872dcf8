"""busbw factors exactly as nccl-tests (doc/PERFORMANCE.md), size parsing and sweeps."""

from __future__ import annotations

import pytest

from hpctrain.bench.busbw import OPS, algbw_gbps, busbw_factor, busbw_gbps
from hpctrain.bench.common import human_bytes, parse_size, size_sweep
from hpctrain.errors import ConfigError

EXPECTED = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("op", OPS)
def test_factor_matches_nccl_tests(op: str, n: int) -> None:
    assert busbw_factor(op, n) == pytest.approx(EXPECTED[op](n))


def test_every_op_has_a_factor() -> None:
    assert set(OPS) == set(EXPECTED)


def test_algbw_uses_decimal_gigabytes() -> None:
    # 1 GiB in 10 ms: 107.37 GB/s algbw; all_reduce on 4 ranks x 1.5 = 161.06 GB/s busbw.
    assert algbw_gbps(1024**3, 0.01) == pytest.approx(107.374182)
    assert busbw_gbps("all_reduce", 4, 1024**3, 0.01) == pytest.approx(161.061273)


def test_unknown_op() -> None:
    with pytest.raises(ConfigError, match="unknown collective"):
        busbw_factor("allreduce", 4)


def test_sizes_like_nccl_tests() -> None:
    assert parse_size("64M") == 64 * 1024**2
    assert parse_size("1G") == 1024**3
    assert parse_size("8") == 8
    assert size_sweep("8", "64", 2) == [8, 16, 32, 64]
    assert human_bytes(64 * 1024**2) == "64M"


@pytest.mark.parametrize("bad", ["12Q", "-5", "0", "abc", ""])
def test_bad_sizes(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_bad_sweeps() -> None:
    with pytest.raises(ConfigError, match="below"):
        size_sweep("1M", "1K", 2)
    with pytest.raises(ConfigError, match="factor"):
        size_sweep("1K", "1M", 1)
