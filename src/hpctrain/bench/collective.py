"""Collective benchmark with nccl-tests semantics, on NCCL (GPU) or gloo (CPU).

For every operation and size: time (µs), algbw and busbw (see `busbw`), and #wrong, out-of-place
and in-place, like ``all_reduce_perf -b 8 -e 128M -f 2``::

    hpctrain bench collective --nproc 4 -b 64M -e 1G -f 2 --ops all_reduce all_gather

Correctness: every rank fills its input with random integer-valued floats from a generator seeded
by (seed, op, size, rank), so each rank can regenerate every other rank's input and compute the
exact expected output (sums of small integers are exact in fp32/bf16). #wrong counts the elements
that differ, summed over ranks, checked once per size and mode before the timed repetitions.

Timing: warm-up, then the median of ``iters`` repetitions per rank, CUDA events on the rank's own
device on GPU, a barrier then perf_counter on CPU; the reported time is the slowest rank's median.

CUDA graphs (nccl-tests ``-G``), ``--cuda-graph N``: after the eager correctness check and a
warm-up on a side stream, N back-to-back calls are captured into one graph; every timed
repetition is one replay, and the time per call is the replay's time / N. This strips the CPU
launch overhead that dominates small messages. NCCL only (GPUs); refused on gloo.

torch.distributed has no out-of-place all_reduce, broadcast or reduce, and no in-place
all_to_all or send/recv; those columns stay empty instead of timing something else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpctrain.bench.busbw import OPS, algbw_gbps, busbw_gbps
from hpctrain.bench.common import time_each
from hpctrain.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
ROOT = 0

# torch 2.13 renamed the tensor variants (the old names warn); the device machine runs 2.11.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

COLUMNS = ["op", "size", "count", "type", "root",
           "oop_time_us", "oop_algbw", "oop_busbw", "oop_wrong",
           "ip_time_us", "ip_algbw", "ip_busbw", "ip_wrong"]


@dataclass
class CollectiveOptions:
    """What to run: operations, sizes in bytes (nccl-tests' S), dtype, repetitions, checking."""

    ops: list[str] = field(default_factory=lambda: list(OPS))
    sizes: list[int] = field(default_factory=lambda: [1024, 1024**2])
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20
    check: bool = True
    seed: int = 0
    # > 0: capture this many calls in one CUDA graph and time its replays (nccl-tests -G).
    cuda_graph: int = 0
    # Test hook: this rank adds 1 to one element of every result before the check, so the test
    # suite can prove that a wrong result is reported as #wrong > 0.
    corrupt_rank: int | None = None

    def validate(self) -> None:
        """Raise ConfigError for unknown ops/dtypes or non-positive repetition counts."""
        for op in self.ops:
            if op not in OPS:
                raise ConfigError(f"unknown collective {op!r}", expected=f"one of {', '.join(OPS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}", expected=", ".join(DTYPES))
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"iters={self.iters}, warmup={self.warmup}",
                              expected="iters >= 1 and warmup >= 0")
        if self.cuda_graph < 0:
            raise ConfigError(f"--cuda-graph {self.cuda_graph}", expected="N >= 1 calls per graph")


def run_collectives(opts: CollectiveOptions, device: torch.device) -> list[dict]:
    """Benchmark every op x size on the initialised default group; same rows on every rank."""
    opts.validate()
    rows = []
    for op_index, op in enumerate(opts.ops):
        for size_index, size in enumerate(opts.sizes):
            row = _bench_one(op, size, opts, device, seed=(opts.seed, op_index, size_index))
            if row is not None:
                rows.append(row)
    return rows


class _Case:
    """One op at one size on this rank: buffers, the call, and the expected output."""

    def __init__(self, op: str, count: int, dtype: torch.dtype, device: torch.device,
                 seed: tuple[int, int, int]):
        self.op, self.dtype, self.device, self.seed = op, dtype, device, seed
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.count = count  # elements of the S-sized buffer
        # Integers small enough that a sum over all ranks stays exact in the dtype.
        self.hi = 8 if dtype in (torch.float32, torch.float64) else max(1, min(8, 100 // self.n))

    def data(self, rank: int, count: int) -> torch.Tensor:
        """Rank `rank`'s input, regenerable by any rank."""
        a, b, c = self.seed
        g = torch.Generator(device=self.device)
        g.manual_seed(((a * 1009 + b) * 1013 + c) * 4099 + rank + 1)
        ints = torch.randint(-self.hi, self.hi + 1, (count,), generator=g, device=self.device,
                             dtype=torch.int32)
        return ints.to(self.dtype)

    def sum_all(self, count: int) -> torch.Tensor:
        total = torch.zeros(count, dtype=torch.float64 if self.dtype == torch.float64
                            else torch.float32, device=self.device)
        for r in range(self.n):
            total += self.data(r, count)
        return total.to(self.dtype)

    # Each returns (fn, output, expected) with inputs freshly filled; None = mode not offered.
    def out_of_place(self) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor | None] | None:
        op, n, rank, count = self.op, self.n, self.rank, self.count
        chunk = count // n
        if op == "all_gather":
            inp, out = self.data(rank, chunk), torch.empty(count, dtype=self.dtype,
                                                           device=self.device)
            expected = torch.cat([self.data(r, chunk) for r in range(n)])
            return (lambda: _all_gather(out, inp)), out, expected
        if op == "reduce_scatter":
            inp = self.data(rank, count)
            out = torch.empty(chunk, dtype=self.dtype, device=self.device)
            expected = self.sum_all(count)[rank * chunk:(rank + 1) * chunk]
            return (lambda: _reduce_scatter(out, inp)), out, expected
        if op == "all_to_all":
            inp = self.data(rank, count)
            out = torch.empty(count, dtype=self.dtype, device=self.device)
            expected = torch.cat([self.data(r, count)[rank * chunk:(rank + 1) * chunk]
                                  for r in range(n)])
            return (lambda: dist.all_to_all_single(out, inp)), out, expected
        if op == "sendrecv":
            inp = self.data(rank, count)
            out = torch.empty(count, dtype=self.dtype, device=self.device)
            peer_to, peer_from = (rank + 1) % n, (rank - 1) % n
            expected = self.data(peer_from, count)

            def sendrecv() -> None:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, peer_to),
                                               dist.P2POp(dist.irecv, out, peer_from)])
                for req in reqs:
                    req.wait()

            return sendrecv, out, expected
        return None

    def in_place(self) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor | None] | None:
        op, n, rank, count = self.op, self.n, self.rank, self.count
        chunk = count // n
        if op == "all_reduce":
            buf = self.data(rank, count)
            return (lambda: dist.all_reduce(buf)), buf, self.sum_all(count)
        if op == "broadcast":
            buf = self.data(rank, count)
            return (lambda: dist.broadcast(buf, src=ROOT)), buf, self.data(ROOT, count)
        if op == "reduce":
            buf = self.data(rank, count)
            # Only the root's buffer is defined afterwards.
            expected = self.sum_all(count) if rank == ROOT else None
            return (lambda: dist.reduce(buf, dst=ROOT)), buf, expected
        if op == "all_gather":
            out = torch.empty(count, dtype=self.dtype, device=self.device)
            mine = out[rank * chunk:(rank + 1) * chunk]
            mine.copy_(self.data(rank, chunk))
            expected = torch.cat([self.data(r, chunk) for r in range(n)])
            return (lambda: _all_gather(out, mine)), out, expected
        if op == "reduce_scatter":
            buf = self.data(rank, count)
            mine = buf[rank * chunk:(rank + 1) * chunk]
            expected = self.sum_all(count)[rank * chunk:(rank + 1) * chunk]
            return (lambda: _reduce_scatter(mine, buf)), mine, expected
        return None


def _bench_one(op: str, size: int, opts: CollectiveOptions, device: torch.device,
               seed: tuple[int, int, int]) -> dict | None:
    n = dist.get_world_size()
    dtype = DTYPES[opts.dtype]
    elsize = torch.empty((), dtype=dtype).element_size()
    count = size // elsize
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = count // n * n  # nccl-tests rounds S down to a multiple of n elements
    if count < 1 or (op == "sendrecv" and n < 2):
        return None
    nbytes = count * elsize
    case = _Case(op, count, dtype, device, seed)
    row: dict = {"op": op, "size": nbytes, "count": count, "type": opts.dtype,
                 "root": ROOT if op in ("broadcast", "reduce") else None}
    for mode, builder in (("oop", case.out_of_place), ("ip", case.in_place)):
        built = builder()
        if built is None:
            row.update({f"{mode}_time_us": None, f"{mode}_algbw": None, f"{mode}_busbw": None,
                        f"{mode}_wrong": None})
            continue
        fn, out, expected = built
        wrong = 0
        if opts.check:
            fn()
            if opts.corrupt_rank == dist.get_rank():
                out.view(-1)[0] += 1
            if expected is not None:
                wrong = int((out != expected).sum().item())
        if opts.cuda_graph:
            times = _graph_times(fn, device, opts)
        else:
            before = dist.barrier if device.type == "cpu" else None
            times = time_each(fn, device, warmup=opts.warmup, iters=opts.iters, before=before)
        stats = torch.tensor([_median(times), float(wrong)], dtype=torch.float64, device=device)
        slowest = stats[:1].clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        wrong_total = stats[1:].clone()
        dist.all_reduce(wrong_total)
        t = float(slowest.item())
        row.update({
            f"{mode}_time_us": t * 1e6,
            f"{mode}_algbw": algbw_gbps(nbytes, t),
            f"{mode}_busbw": busbw_gbps(op, n, nbytes, t),
            f"{mode}_wrong": int(wrong_total.item()) if opts.check else None,
        })
    return row


def _graph_times(fn: Callable[[], None], device: torch.device,
                 opts: CollectiveOptions) -> list[float]:
    """Seconds per call: replays of a graph holding `opts.cuda_graph` calls, divided by that."""
    if device.type != "cuda":
        raise ConfigError("--cuda-graph needs NCCL on GPUs", expected="a CUDA device")
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # capture wants its kernels warmed up off the main stream
            for _ in range(max(1, opts.warmup)):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(opts.cuda_graph):
                fn()
        torch.cuda.synchronize()
    replays = time_each(graph.replay, device, warmup=1, iters=opts.iters)
    return [t / opts.cuda_graph for t in replays]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
