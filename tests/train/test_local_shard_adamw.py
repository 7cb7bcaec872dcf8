"""``LocalShardAdamW``: the fused AdamW kernel on DTensors' local shards.

Two real gloo ranks. Parameters sharded evenly and unevenly, on either dimension, replicated,
and plain beside them, with weight decay, a clip divisor (``grad_scale``) and a skipped step
(``found_inf``): after four steps every shard and moment equals what ``torch.optim.AdamW``
computes through DTensor's dispatch, bit for bit, and what one process computes on the whole
tensors. Gradients in another layout than their parameter's are brought to it first: a
replicated one on a sharded parameter (the vocabulary-sharded embedding's under tensor
parallelism) and one whose sum over ranks is still pending (``Partial``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from conftest import spawn_ranks
from hpctrain.train.optim import LocalShardAdamW

PLACEMENTS = [Shard(0), Shard(0), Shard(1), Replicate(), None]  # None: a plain tensor
# The gradients LocalShardAdamW is handed: two in another layout than their parameter's.
GRAD_PLACEMENTS = [Shard(0), Replicate(), Shard(1), Partial(), None]
SHAPES = [(6, 4), (5, 3), (4, 7), (5,), (3,)]  # 5 rows and 7 columns shard unevenly over 2
STEPS = 4
SKIPPED = 2  # found_inf is set on this step: nothing may change


def _full(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _place(tensors: list[torch.Tensor], mesh, plain: bool = True,
           placements: list = PLACEMENTS) -> list[torch.Tensor]:
    """The tensors under ``placements``; ``plain=False`` replicates the plain one (torch's own
    AdamW refuses plain tensors and DTensors in one fused call)."""
    out = []
    for t, pl in zip(tensors, placements, strict=True):
        if isinstance(pl, Partial):  # each rank holds half: the sum is the tensor
            out.append(DTensor.from_local(t / 2, mesh, [pl]))
        elif pl is None and plain:
            out.append(t.clone())
        else:
            out.append(distribute_tensor(t, mesh, [pl or Replicate()]))
    return out


def _train(cls, params: list[torch.nn.Parameter], grads_of) -> torch.optim.Optimizer:
    opt = cls([{"params": params[:3], "weight_decay": 0.1},
               {"params": params[3:], "weight_decay": 0.0}],
              lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for step in range(STEPS):
        for p, g in zip(params, grads_of(step), strict=True):
            p.grad = g
        opt.grad_scale = torch.tensor(2.0)  # the clip divisor hpctrain hands the kernel
        opt.found_inf = torch.tensor(1.0 if step == SKIPPED else 0.0)
        opt.step()
    return opt


def _whole(t: torch.Tensor):
    """The whole tensor as a numpy array (a tensor sent through a queue would be shared memory
    that its rank frees as it exits)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).numpy()


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        out = {}
        for name, cls, plain, grads in (
                ("local", LocalShardAdamW, True, GRAD_PLACEMENTS),
                ("dtensor", torch.optim.AdamW, False, PLACEMENTS)):
            params = [torch.nn.Parameter(t) for t in _place(_full(0), mesh, plain)]
            opt = _train(cls, params, lambda step, plain=plain, grads=grads: _place(
                _full(step + 1), mesh, plain, grads))
            out[name] = ([_whole(p.detach()) for p in params],
                         [_whole(opt.state[p][k]) for p in params
                          for k in ("exp_avg", "exp_avg_sq", "step")],
                         all(isinstance(opt.state[p]["exp_avg"], DTensor)
                             == (pl is not None or not plain)
                             for p, pl in zip(params, PLACEMENTS, strict=True)))
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_local_shard_updates_equal_dtensor_and_whole_tensor_updates() -> None:
    results = spawn_ranks(_rank, 2)
    # One process, whole tensors, torch's own fused AdamW: the reference.
    params = [torch.nn.Parameter(t) for t in _full(0)]
    opt = _train(torch.optim.AdamW, params, lambda step: _full(step + 1))
    whole = ([p.detach() for p in params],
             [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq", "step")])
    assert float(whole[1][2]) == STEPS - 1  # the skipped step did not count
    for rank, out in results:
        local_params, local_state, state_is_sharded = out["local"]
        assert state_is_sharded, "the moments must stay DTensors (DCP reshards them)"
        got = [torch.from_numpy(a) for a in local_params + local_state]
        for mine, theirs in zip(got, [*out["dtensor"][0], *out["dtensor"][1]], strict=True):
            assert torch.equal(mine, torch.from_numpy(theirs)), (rank, mine, theirs)
        for mine, one in zip(got, [*whole[0], *whole[1]], strict=True):
            torch.testing.assert_close(mine, one, rtol=1e-6, atol=1e-7)


def test_closure_is_refused() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="no closure"):
        LocalShardAdamW([p], lr=1e-2, fused=True).step(lambda: 0.0)
