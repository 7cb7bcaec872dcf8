"""CPU time of an FSDP step's tail: the gradient norm and the fused AdamW step over DTensors.

    python benchmarks/step_tail_cpu.py --model 1b --repeats 50

Under FSDP every parameter and gradient is a DTensor, and each DTensor op costs a Python
dispatch per tensor on the CPU. A GPU idles when its CPU falls behind, and a profile of 1b on
four H200s (benchmarks/RESULTS.md) showed one rank waiting for launches between the gradient
norm's and the optimizer's kernels. This measures the CPU side alone, on any machine: one
process, a 1-rank gloo group, as many gradients as the model has parameters (their shapes
shrunk to 8 x 8: the GPU work is not what is measured), each path timed ``--repeats`` times
after a warm-up. It prints, in ms per step:

- the gradient norm through DTensor's own ops (what hpctrain did before);
- ``hpctrain.parallel.grad_norm.global_grad_norm`` (local squares, one all-reduce per axis);
- the same norm over plain tensors (the floor: no DTensor at all);
- the fused AdamW step: ``torch.optim.AdamW`` over DTensors (what hpctrain did before),
  ``hpctrain.train.optim.LocalShardAdamW`` over the same DTensors (their local shards), and
  ``torch.optim.AdamW`` over plain tensors (the floor).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hpctrain.models import Transformer
from hpctrain.parallel.grad_norm import global_grad_norm
from hpctrain.plan.memory_options import resolve_model
from hpctrain.train.optim import LocalShardAdamW


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _dtensor_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in params]
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    norm = torch.linalg.vector_norm(torch.stack(norms))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _params(count: int, mesh=None) -> list[torch.nn.Parameter]:
    params = []
    for _ in range(count):
        weight, grad = torch.randn(8, 8), torch.randn(8, 8)
        if mesh is not None:
            weight = distribute_tensor(weight, mesh, [Shard(0)])
            grad = distribute_tensor(grad, mesh, [Shard(0)])
        p = torch.nn.Parameter(weight)
        p.grad = grad
        params.append(p)
    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b", help="size whose parameter count is used")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    with torch.device("meta"):
        count = len(list(Transformer(resolve_model(args.model)).parameters()))
    # One thread: on a GPU the kernels run on the device and the CPU pays only the dispatch;
    # here CPU kernels on several threads would mix their compute (and any contention for the
    # cores) into what is meant to be the dispatch cost.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        sharded, plain = _params(count, mesh), _params(count)
        rows = {
            "gradient norm, DTensor ops (before)": _median_ms(
                lambda: _dtensor_norm(sharded), args.repeats),
            "gradient norm, global_grad_norm (now)": _median_ms(
                lambda: global_grad_norm(sharded, None), args.repeats),
            "gradient norm, plain tensors (floor)": _median_ms(
                lambda: global_grad_norm(plain, None), args.repeats),
        }
        for name, cls, params in (
                ("torch AdamW, DTensors (before)", torch.optim.AdamW, sharded),
                ("LocalShardAdamW, DTensors (now)", LocalShardAdamW, sharded),
                ("torch AdamW, plain tensors (floor)", torch.optim.AdamW, plain)):
            opt = cls(params, lr=1e-3, fused=True)
            rows[f"fused step, {name}"] = _median_ms(opt.step, args.repeats)
    finally:
        dist.destroy_process_group()
    print(f"{args.model}: {count} parameters (as 8 x 8 tensors), torch {torch.__version__}, "
          f"median of {args.repeats}")
    for name, ms in rows.items():
        print(f"  {name:<46} {ms:7.2f} ms")


if __name__ == "__main__":
    main()
