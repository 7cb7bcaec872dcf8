"""The global gradient norm over every axis of the mesh, and clipping by it.

Sharded gradients (FSDP, tensor parallelism) are DTensors: their norm is reduced over the axes
they are sharded on. Pipeline stages hold disjoint parameters, so their squared norms add up
across the ``pp`` axis. The result is one value, the same on every rank: what one process holding
the whole model would compute, which the bad-step guard and clipping need.

The squares are summed over each DTensor's local shard and then all-reduced once per mesh axis,
rather than through DTensor's own ops: those cost a dispatch per tensor on the CPU, every step
(1.3 ms against 0.54 ms of CPU for 1b's 201 gradients, ``benchmarks/step_tail_cpu.py``), at
the step's tail, where the next step's launches wait for them.

Clipping either scales the gradients in place (``clip_grads_``) or hands the fused AdamW kernel
a divisor it applies as it reads each gradient (``clip_divisor``), which saves a pass over them.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def global_grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None
                     ) -> torch.Tensor:
    """L2 norm of all gradients of the whole model (every stage and shard)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        norm = _squared_sum(grads).sqrt()
    else:  # a stage whose parameters got no gradient still joins the pipeline's sum
        norm = torch.zeros((), device=params[0].device if params else None)
    if pp_group is not None:
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    return norm


def _squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    # Each tensor's norm in fp32 whatever the gradients' dtype: bf16 gradients
    # (train.master_weights=bf16) would otherwise give a norm of 3 significant digits.
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def _squared_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of every element of ``grads``, whole tensors over all their shards."""
    parts: list[torch.Tensor] = []
    layouts: dict[tuple, list[DTensor]] = defaultdict(list)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:
        parts.append(_squares(plain))
    for g in grads:
        if isinstance(g, DTensor):
            layouts[g.device_mesh, g.placements].append(g)
    # Per mesh: one sum of its shards' squares, all-reduced once per axis.
    per_mesh: dict[DeviceMesh, torch.Tensor] = {}
    for (mesh, placements), group in layouts.items():
        if not all(isinstance(p, (Shard, Replicate)) for p in placements):
            # A pending sum (Partial) or a layout this function does not know: DTensor's own
            # reduction, exact whatever the placements, and already whole.
            parts.append(_dtensor_squared_sum(group))
            continue
        # A shard replicated over some axes is summed on each of their ranks by the
        # all-reduces below: counted once by dividing by how many ranks hold it. The local
        # shards as they are (``to_local`` would go through autograd, per tensor).
        copies = math.prod(mesh.size(d) for d, p in enumerate(placements)
                           if isinstance(p, Replicate))
        part = _squares([g._local_tensor for g in group]) / copies
        per_mesh[mesh] = per_mesh[mesh] + part if mesh in per_mesh else part
    for mesh, part in per_mesh.items():
        for axis in range(mesh.ndim):
            if mesh.size(axis) > 1:
                dist.all_reduce(part, group=mesh.get_group(axis))
        parts.append(part)
    return torch.stack(parts).sum()


def _dtensor_squared_sum(grads: list[DTensor]) -> torch.Tensor:
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum().full_tensor()


def clip_grads_(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so that their global norm ``norm`` is at most ``max_norm``."""
    grads = [p for p in params if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide every gradient by so that their global norm ``norm`` is at most
    ``max_norm`` (1 where it is already): clipping as a fused optimizer's ``grad_scale``."""
    return ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
