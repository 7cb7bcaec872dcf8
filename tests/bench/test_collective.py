"""Collectives on real gloo ranks (spawned processes): exact results, and a planted error caught."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import fork_spawn
from hpctrain.bench.busbw import OPS
from hpctrain.bench.collective import CollectiveOptions, run_collectives

CLEAN_RANKS = 3
# name -> (ranks, options): the clean run on 3 ranks, a planted error on 2 (of the same 3).
CASES = {
    "clean": (CLEAN_RANKS, CollectiveOptions(sizes=[4096], warmup=0, iters=2)),
    "corrupt": (2, CollectiveOptions(sizes=[4096], warmup=0, iters=2,
                                     ops=["all_reduce", "all_gather", "sendrecv"],
                                     corrupt_rank=1)),
}


def _worker(rank: int, tmp: str) -> None:
    """One of 3 processes: every case it takes part in, each in a group of its own size."""
    torch.set_num_threads(1)
    for name, (n, opts) in CASES.items():
        if rank >= n:
            continue
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{name}", rank=rank,
                                world_size=n)
        try:
            rows = run_collectives(opts, torch.device("cpu"))
        finally:
            dist.destroy_process_group()
        if rank == 0:
            torch.save(rows, f"{tmp}/{name}.pt")


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """Case name -> rank 0's rows, all cases from one spawn of 3 processes."""
    with tempfile.TemporaryDirectory() as tmp:
        fork_spawn(_worker, (tmp,), CLEAN_RANKS)
        return {name: torch.load(Path(tmp) / f"{name}.pt") for name in CASES}


# The 2-rank clean run is tests/bench/test_bench_cli.py's launcher test (real elastic launch).
@pytest.fixture(scope="module")
def clean(runs: dict[str, list[dict]]) -> tuple[int, list[dict]]:
    return CLEAN_RANKS, runs["clean"]


def test_every_op_is_exact(clean) -> None:
    n, rows = clean
    assert {r["op"] for r in rows} == set(OPS)
    for r in rows:
        modes = [m for m in ("oop", "ip") if r[f"{m}_time_us"] is not None]
        assert modes, r
        for m in modes:
            assert r[f"{m}_wrong"] == 0, r
            assert r[f"{m}_time_us"] > 0


def test_sizes_are_rounded_to_ranks(clean) -> None:
    n, rows = clean
    for r in rows:
        assert r["count"] * 4 == r["size"]
        if r["op"] in ("all_gather", "reduce_scatter", "all_to_all"):
            assert r["count"] % n == 0


def test_busbw_follows_factor(clean) -> None:
    n, rows = clean
    ar = next(r for r in rows if r["op"] == "all_reduce")
    assert ar["ip_busbw"] == pytest.approx(ar["ip_algbw"] * 2 * (n - 1) / n)


def test_planted_corruption_is_detected(runs: dict[str, list[dict]]) -> None:
    rows = runs["corrupt"]
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "sendrecv"}
    for r in rows:
        wrong = [r[f"{m}_wrong"] for m in ("oop", "ip") if r[f"{m}_wrong"] is not None]
        assert wrong and all(w > 0 for w in wrong), r
