"""Collectives on real gloo ranks (spawned processes): exact results, and a planted error caught."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.bench.busbw import OPS
from hpctrain.bench.collective import CollectiveOptions, run_collectives


def _worker(rank: int, n: int, store: str, opts: CollectiveOptions, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    try:
        rows = run_collectives(opts, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(rows, out)


def run_ranks(n: int, **kw) -> list[dict]:
    opts = CollectiveOptions(sizes=[4096], warmup=0, iters=2, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.pt")
        mp.spawn(_worker, args=(n, str(Path(tmp) / "store"), opts, out), nprocs=n)
        return torch.load(out)


# The 2-rank clean run is tests/bench/test_bench_cli.py's launcher test (real elastic launch).
@pytest.fixture(scope="module", params=[3])
def clean(request) -> tuple[int, list[dict]]:
    return request.param, run_ranks(request.param)


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


def test_planted_corruption_is_detected() -> None:
    ops = ["all_reduce", "all_gather", "sendrecv"]
    rows = run_ranks(2, ops=ops, corrupt_rank=1)
    for r in rows:
        wrong = [r[f"{m}_wrong"] for m in ("oop", "ip") if r[f"{m}_wrong"] is not None]
        assert wrong and all(w > 0 for w in wrong), r
