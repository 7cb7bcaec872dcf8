"""``global_grad_norm`` over DTensor gradients: local squares, one all-reduce per mesh axis.

Four real gloo ranks on a 2 x 2 mesh (``dp_shard`` x ``tp``), gradients under every placement a
layout gives them (sharded on one axis or both, unevenly, replicated, plain tensors beside them,
and a pending sum that takes DTensor's own path): the norm equals the norm of the whole tensors,
on every rank. The layouts' training tests check it against one process as well.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from conftest import spawn_ranks
from hpctrain.parallel.grad_norm import global_grad_norm

PLACEMENTS = [
    (Shard(0), Shard(1)),       # FSDP x TP: a column-parallel weight
    (Shard(0), Replicate()),    # FSDP x TP: a norm gain, replicated over tp
    (Replicate(), Shard(0)),    # TP alone on this axis
    (Replicate(), Replicate()),
    (Shard(1), Shard(0)),
]
SHAPES = [(6, 4), (5,), (7, 3), (3, 3), (4, 9)]  # uneven shards: 5, 7, 9 rows over 2


def _full_grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _param(full: torch.Tensor, grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(full))
    p.grad = grad
    return p


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        full = _full_grads()
        dtensors = [distribute_tensor(g, mesh, list(pl))
                    for g, pl in zip(full, PLACEMENTS, strict=True)]
        extra = torch.arange(4.0)  # a plain (unsharded) gradient beside them
        params = [_param(g, g) for g in dtensors] + [_param(extra, extra)]
        sharded = global_grad_norm(params, None).item()
        # A pending sum over tp: each rank holds a quarter of the first gradient's value on its
        # dp half; DTensor's own reduction must see the sum.
        pending = distribute_tensor(full[0], mesh, [Shard(0), Replicate()])
        partial = type(pending).from_local(pending.to_local() / 2, mesh, [Shard(0), Partial()])
        mixed = global_grad_norm([_param(full[0], partial), *params[1:]], None).item()
        queue.put((rank, sharded, mixed))
    finally:
        dist.destroy_process_group()


def test_norm_of_sharded_gradients_equals_the_whole_tensors_norm() -> None:
    results = spawn_ranks(_rank, 4)
    full = _full_grads()
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full]
                                                  + [torch.arange(4.0)])).item()
    for rank, sharded, mixed in results:
        assert abs(sharded - expected) <= 1e-6 * expected, (rank, sharded, expected)
        assert abs(mixed - expected) <= 1e-6 * expected, (rank, mixed, expected)
    # Every rank holds the same value, bit for bit: the guard and the clip agree everywhere.
    assert len({r[1] for r in results}) == 1 and len({r[2] for r in results}) == 1
